/*
 * Loading the real model from C: engram_tables_from_files (the DeepSeek
 * tokenizer and a V4.1 config.json give the published tables, which hash a real
 * text to the golden's ids), engram_create_from_gguf (the gguf-py fixtures:
 * hash constants in two widths agree, pread and mmap tables agree, a file
 * without the constants is completed from config + tokenizer), engram_prefetch,
 * engram_stage,
 * and every bad input of each: the right status, a message, *out untouched.
 *
 * Paths are relative to the repository root (c_tests/run.sh runs from there);
 * scratch files go to target/.
 */
#include "engram.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "filler.h"

#define DATA "tests/golden/data/"
#define TOKENIZER DATA "deepseek_v4_tokenizer.json"

static int last_error_has(const char *what) {
    const char *m = engram_last_error();
    return m != NULL && strstr(m, what) != NULL;
}

/* Copy the first `n` bytes of `src` to `dst` (n = 0: all), optionally
 * overwriting the first four bytes with `magic`. */
static int copy_file(const char *src, const char *dst, size_t n, const char *magic) {
    FILE *f = fopen(src, "rb");
    if (!f) return 0;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    if (len <= 0) {
        fclose(f);
        return 0;
    }
    size_t want = n ? n : (size_t)len;
    unsigned char *buf = (unsigned char *)malloc(want);
    size_t got = buf ? fread(buf, 1, want, f) : 0;
    fclose(f);
    if (got != want) {
        free(buf);
        return 0;
    }
    if (magic) memcpy(buf, magic, 4);
    FILE *o = fopen(dst, "wb");
    int ok = o && fwrite(buf, 1, want, o) == want;
    if (o) fclose(o);
    free(buf);
    return ok;
}

static void test_tables(void) {
    engram_tables *t = NULL;
    engram_status s = engram_tables_from_files(DATA "v41_config.json", TOKENIZER, &t);
    if (!check(s == ENGRAM_STATUS_OK && t != NULL, "engram_tables_from_files(v41_config.json, DeepSeek tokenizer)")) {
        note("status %d: %s", (int)s, engram_last_error());
        return;
    }
    check(engram_tables_compressed_vocab(t) == 99092, "99,092 compressed ids (got %zu)",
          engram_tables_compressed_vocab(t));
    check(engram_tables_layer_rows(t, 1) == UINT64_C(384006168) &&
              engram_tables_layer_rows(t, 14) == UINT64_C(384016682) && engram_tables_layer_rows(t, 2) == 0,
          "rows 384,006,168 and 384,016,682; 0 for a layer that is not an engram layer");

    engram_config cfg;
    engram_config_init(&cfg);
    check(engram_tables_fill_config(t, &cfg) == ENGRAM_STATUS_OK, "engram_tables_fill_config");
    check(cfg.n_layers == 2 && cfg.layer_ids[0] == 1 && cfg.layer_ids[1] == 14 && cfg.max_ngram == 4 &&
              cfg.n_heads == 8 && cfg.token_map_len == 129280 && cfg.pad_id == 2 && cfg.n_multipliers == 8 &&
              cfg.n_primes == 48 && cfg.n_offsets == 48 && cfg.hidden_size == 5120 && cfg.hc == 4 &&
              cfg.head_dim == 256,
          "the config's hash fields and geometry are filled");
    cfg.max_tokens = 64;
    cfg.max_seqs = 2;
    cfg.max_positions = 1024;
    engram_context *ctx = NULL;
    s = engram_create(&cfg, &ctx);
    check(s == ENGRAM_STATUS_OK, "engram_create from the derived tables (%d)", (int)s);
    engram_tables_free(t); /* the context copied them */
    if (ctx) {
        /* "The quick brown fox jumps over the lazy dog." as the DeepSeek tokenizer encodes it. */
        static const int32_t tokens[10] = {671, 4787, 13769, 46012, 54994, 1060, 270, 41638, 6397, 16};
        int32_t seq[10] = {0}, pos[10];
        for (int i = 0; i < 10; i++) pos[i] = i;
        int64_t ids[10 * 48];
        s = engram_hash(ctx, tokens, seq, pos, 10, ids, 10 * 48);
        check(s == ENGRAM_STATUS_OK && ids[0] == 5184683 && ids[1] == 27616858 && ids[3] == 48930683 &&
                  ids[48] == 15897228 && ids[51] == 63623820 && ids[10 * 48 - 1] == 370668501,
              "a real text hashes to the golden generator's ids");
        engram_free(ctx);
    }

    /* Bad inputs. */
    engram_tables *keep = (engram_tables *)&keep; /* a sentinel: must stay as it is */
    engram_tables *o = keep;
    check(engram_tables_from_files(NULL, TOKENIZER, &o) == ENGRAM_STATUS_ERR_NULL_ARGUMENT && o == keep &&
              last_error_has("config_json"),
          "engram_tables_from_files: NULL config path");
    check(engram_tables_from_files(DATA "v41_config.json", NULL, &o) == ENGRAM_STATUS_ERR_NULL_ARGUMENT && o == keep,
          "engram_tables_from_files: NULL tokenizer path");
    check(engram_tables_from_files(DATA "v41_config.json", TOKENIZER, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT,
          "engram_tables_from_files: NULL out");
    check(engram_tables_from_files(DATA "no_such_config.json", TOKENIZER, &o) == ENGRAM_STATUS_ERR_IO && o == keep &&
              last_error_has("no_such_config.json"),
          "engram_tables_from_files: a missing file is ERR_IO, naming it");
    check(engram_tables_from_files(DATA "gguf_expected.json", TOKENIZER, &o) == ENGRAM_STATUS_ERR_INVALID_CONFIG &&
              o == keep && last_error_has("layer ids"),
          "engram_tables_from_files: a JSON without engram fields is ERR_INVALID_CONFIG, naming the field");
    check(engram_tables_from_files(DATA "v41_config.json", DATA "v41_config.json", &o) ==
                  ENGRAM_STATUS_ERR_INVALID_CONFIG &&
              o == keep,
          "engram_tables_from_files: a tokenizer.json that is not one is ERR_INVALID_CONFIG");
    check(engram_tables_from_files("", TOKENIZER, &o) == ENGRAM_STATUS_ERR_INVALID_ARGUMENT && o == keep,
          "engram_tables_from_files: an empty path");
    engram_config c2;
    engram_config_init(&c2);
    check(engram_tables_fill_config(NULL, &c2) == ENGRAM_STATUS_ERR_NULL_ARGUMENT,
          "engram_tables_fill_config: NULL tables");
    c2.struct_size = 3;
    /* struct_size is checked before the tables are read. */
    check(engram_tables_fill_config((const engram_tables *)keep, &c2) == ENGRAM_STATUS_ERR_STRUCT_SIZE,
          "engram_tables_fill_config: wrong struct_size");
    check(engram_tables_layer_rows(NULL, 1) == 0 && engram_tables_compressed_vocab(NULL) == 0,
          "NULL tables: 0 rows, 0 ids");
    engram_tables_free(NULL);
    check(1, "engram_tables_free(NULL) is a no-op");
}

/* Hash the golden's 12 prefill tokens; returns the status. */
static engram_status hash_prefill(engram_context *ctx, int64_t *ids) {
    int32_t tokens[12], seq[12] = {0}, pos[12];
    for (int i = 0; i < 12; i++) {
        tokens[i] = (int32_t)(bits("prefill.tokens", (uint64_t)i) % 48);
        pos[i] = i;
    }
    return engram_hash(ctx, tokens, seq, pos, 12, ids, 12 * 8);
}

/* Apply layer `lid` to 12 tokens on a fresh highway; the result in `hw`. */
static engram_status apply12(engram_context *ctx, uint32_t lid, const int64_t *ids, float *hw) {
    for (int i = 0; i < 12 * 4 * 64; i++) hw[i] = value("prefill.0.highway", (uint64_t)i, 1.0, 0.0);
    return engram_apply(ctx, lid, ids, 12, hw, ENGRAM_TYPE_F32, NULL);
}

static void test_gguf(void) {
    engram_gguf_options o;
    engram_gguf_options_init(&o);
    check(o.struct_size == sizeof o && o.backend == ENGRAM_BACKEND_CPU && o.mmap_tables == 0 &&
              o.config_json == NULL && o.max_tokens > 0,
          "engram_gguf_options_init: defaults");
    o.max_tokens = 64;
    o.max_seqs = 4;
    o.max_positions = 256;
    o.n_threads = 2;
    engram_context *a = NULL, *b = NULL, *m = NULL, *d = NULL;
    check(engram_create_from_gguf(DATA "tiny.gguf", &o, &a) == ENGRAM_STATUS_OK && a != NULL,
          "engram_create_from_gguf(tiny.gguf)");
    check(engram_create_from_gguf(DATA "tiny_u32.gguf", &o, &b) == ENGRAM_STATUS_OK && b != NULL,
          "engram_create_from_gguf(tiny_u32.gguf): u32 primes and token map, i64 multipliers, no offsets");
    o.mmap_tables = 1;
    check(engram_create_from_gguf(DATA "tiny.gguf", &o, &m) == ENGRAM_STATUS_OK, "tiny.gguf with mapped tables");
    o.mmap_tables = 0;
    o.config_json = DATA "tiny_config.json";
    o.tokenizer_json = TOKENIZER;
    check(engram_create_from_gguf(DATA "tiny_noconst.gguf", &o, &d) == ENGRAM_STATUS_OK,
          "tiny_noconst.gguf completed from config.json + tokenizer.json");
    o.config_json = NULL;
    o.tokenizer_json = NULL;
    if (a && b && m && d) {
        check(engram_row_ids_per_token(a) == 8, "8 row ids per token (2 layers, C = 4)");
        int64_t ia[96], ib[96], im[96];
        check(hash_prefill(a, ia) == ENGRAM_STATUS_OK && hash_prefill(b, ib) == ENGRAM_STATUS_OK &&
                  hash_prefill(m, im) == ENGRAM_STATUS_OK && memcmp(ia, ib, sizeof ia) == 0 &&
                  memcmp(ia, im, sizeof ia) == 0,
              "the same hash ids from both integer widths");
        static float ha[12 * 4 * 64], hb[12 * 4 * 64], hm[12 * 4 * 64];
        check(apply12(a, 1, ia, ha) == ENGRAM_STATUS_OK && apply12(b, 1, ia, hb) == ENGRAM_STATUS_OK &&
                  apply12(m, 1, ia, hm) == ENGRAM_STATUS_OK && memcmp(ha, hb, sizeof ha) == 0 &&
                  memcmp(ha, hm, sizeof ha) == 0,
              "layer 1 (bf16 in both files): the same highway, pread or mapped");
        /* Prefetch both layers, then apply: the same result as without. */
        static float hp[12 * 4 * 64];
        check(engram_prefetch(a, 1, ia, 12) == ENGRAM_STATUS_OK && engram_prefetch(a, 3, ia, 12) == ENGRAM_STATUS_OK,
              "engram_prefetch both layers");
        check(apply12(a, 1, ia, hp) == ENGRAM_STATUS_OK && memcmp(hp, ha, sizeof hp) == 0,
              "apply after prefetch: the same highway");
        apply12(m, 3, ia, hm);
        check(apply12(a, 3, ia, hp) == ENGRAM_STATUS_OK && memcmp(hp, hm, sizeof hp) == 0,
              "layer 3 after prefetch (pread) equals the mapped table's result");
        /* prefetch's bad inputs. */
        int64_t bad[96];
        memcpy(bad, ia, sizeof bad);
        bad[2] = INT64_C(1) << 40;
        check(engram_prefetch(NULL, 1, ia, 12) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "engram_prefetch: NULL ctx");
        check(engram_prefetch(a, 1, NULL, 12) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "engram_prefetch: NULL row_ids");
        check(engram_prefetch(a, 2, ia, 12) == ENGRAM_STATUS_ERR_UNKNOWN_LAYER, "engram_prefetch: unknown layer");
        check(engram_prefetch(a, 1, bad, 12) == ENGRAM_STATUS_ERR_INVALID_ROW_ID && last_error_has("row id"),
              "engram_prefetch: a row id outside the table");
        check(engram_prefetch(a, 1, ia, 65) == ENGRAM_STATUS_ERR_CAPACITY, "engram_prefetch: more than max_tokens");
        check(engram_prefetch(a, 1, ia, 0) == ENGRAM_STATUS_OK, "engram_prefetch: zero tokens");
        /* engram_stage on the CPU backend starts the gather as prefetch does. */
        check(engram_stage(a, 1, ia, 12, NULL) == ENGRAM_STATUS_OK, "engram_stage on the CPU backend");
        check(apply12(a, 1, ia, hp) == ENGRAM_STATUS_OK && memcmp(hp, ha, sizeof hp) == 0,
              "apply after engram_stage: the same highway");
        check(engram_stage(NULL, 1, ia, 12, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "engram_stage: NULL ctx");
        check(engram_stage(a, 1, NULL, 12, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "engram_stage: NULL row_ids");
        check(engram_stage(a, 2, ia, 12, NULL) == ENGRAM_STATUS_ERR_UNKNOWN_LAYER, "engram_stage: unknown layer");
        check(engram_stage(a, 1, bad, 12, NULL) == ENGRAM_STATUS_ERR_INVALID_ROW_ID && last_error_has("row id"),
              "engram_stage: a row id outside the table");
        check(engram_stage(a, 1, ia, 65, NULL) == ENGRAM_STATUS_ERR_CAPACITY, "engram_stage: more than max_tokens");
        check(engram_stage(a, 1, ia, 0, NULL) == ENGRAM_STATUS_OK, "engram_stage: zero tokens");
    }
    engram_free(a);
    engram_free(b);
    engram_free(m);
    engram_free(d);

    /* Bad files and options: the right status, *out untouched. */
    engram_context *keep = (engram_context *)&keep;
    engram_context *out = keep;
    check(engram_create_from_gguf(DATA "tiny_noconst.gguf", &o, &out) == ENGRAM_STATUS_ERR_INVALID_CONFIG &&
              out == keep && last_error_has("deepseek41.engram.multipliers") &&
              last_error_has("deepseek41.engram.token_map"),
          "a file without the hash constants and no config: ERR_INVALID_CONFIG naming the missing keys");
    o.config_json = DATA "tiny_config.json";
    check(engram_create_from_gguf(DATA "tiny_noconst.gguf", &o, &out) == ENGRAM_STATUS_ERR_INVALID_ARGUMENT &&
              out == keep,
          "config_json without tokenizer_json");
    o.config_json = NULL;
    check(engram_create_from_gguf(NULL, &o, &out) == ENGRAM_STATUS_ERR_NULL_ARGUMENT && out == keep, "NULL path");
    check(engram_create_from_gguf(DATA "tiny.gguf", NULL, &out) == ENGRAM_STATUS_ERR_NULL_ARGUMENT && out == keep,
          "NULL options");
    check(engram_create_from_gguf(DATA "tiny.gguf", &o, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "NULL out");
    check(engram_create_from_gguf(DATA "no_such.gguf", &o, &out) == ENGRAM_STATUS_ERR_IO && out == keep,
          "a missing file: ERR_IO");
    engram_gguf_options small = o;
    small.struct_size = sizeof small + 1;
    check(engram_create_from_gguf(DATA "tiny.gguf", &small, &out) == ENGRAM_STATUS_ERR_STRUCT_SIZE && out == keep,
          "wrong struct_size");
    small = o;
    small.backend = ENGRAM_BACKEND_CUDA;
    {
        /* Without a driver (CI): ERR_DEVICE, nothing created; with one: a context. */
        int st = (int)engram_create_from_gguf(DATA "tiny.gguf", &small, &out);
        check((st == ENGRAM_STATUS_ERR_DEVICE && out == keep) || (st == ENGRAM_STATUS_OK && out != keep),
              "the CUDA backend: ERR_DEVICE without a driver, else a context (%d: %s)", st,
              st ? engram_last_error() : "ok");
        if (st == ENGRAM_STATUS_OK) {
            engram_free(out);
            out = keep;
        }
    }
    small.backend = 7;
    check(engram_create_from_gguf(DATA "tiny.gguf", &small, &out) == ENGRAM_STATUS_ERR_UNSUPPORTED && out == keep,
          "an unknown backend: ERR_UNSUPPORTED");
    small = o;
    small.max_tokens = 0;
    check(engram_create_from_gguf(DATA "tiny.gguf", &small, &out) == ENGRAM_STATUS_ERR_INVALID_CONFIG && out == keep,
          "max_tokens 0: ERR_INVALID_CONFIG");
    const char *cut = "target/c_tests_tables_cut.gguf";
    const char *magic = "target/c_tests_tables_magic.gguf";
    if (check(copy_file(DATA "tiny.gguf", cut, 1000, NULL) && copy_file(DATA "tiny.gguf", magic, 0, "GGUX"),
              "write the scratch files in target/")) {
        check(engram_create_from_gguf(cut, &o, &out) == ENGRAM_STATUS_ERR_FORMAT && out == keep &&
                  last_error_has("truncated"),
              "a truncated file: ERR_FORMAT, 'truncated'");
        check(engram_create_from_gguf(magic, &o, &out) == ENGRAM_STATUS_ERR_FORMAT && out == keep &&
                  last_error_has("not a GGUF file"),
              "a wrong magic: ERR_FORMAT, 'not a GGUF file'");
        remove(cut);
        remove(magic);
    }
    check(strcmp(engram_status_str(ENGRAM_STATUS_ERR_IO), "I/O error") == 0 &&
              strcmp(engram_status_str(ENGRAM_STATUS_ERR_FORMAT), "malformed file") == 0,
          "status texts of ERR_IO and ERR_FORMAT");
}

/* Write `text` to `path`; 1 on success. */
static int write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    int ok = fputs(text, f) >= 0;
    return fclose(f) == 0 && ok;
}

/* A WordLevel tokenizer.json whose tokens are "a" = 0, "b" = `b`, "c" = `c`. */
static int write_tokenizer(const char *path, long long b, long long c) {
    char text[512];
    snprintf(text, sizeof text,
             "{\"version\":\"1.0\",\"truncation\":null,\"padding\":null,\"added_tokens\":[],"
             "\"normalizer\":null,\"pre_tokenizer\":null,\"post_processor\":null,\"decoder\":null,"
             "\"model\":{\"type\":\"WordLevel\",\"vocab\":{\"a\":0,\"b\":%lld,\"c\":%lld},\"unk_token\":\"a\"}}",
             b, c);
    return write_text(path, text);
}

/* A tokenizer.json is bounded by what it holds: a three-token file naming id
 * 2^31-2 used to make the token map span 2^31 ids (86 GB of work buffers, an
 * abort). The map spans the ids below len(tokenizer) (transformers' count:
 * here 3), as the reference's does (docs/tokenizers.md): an id at or beyond
 * it (5, 60000, 2^24, 2^31-2) is refused by both loaders with a message. */
static void test_hostile_tokenizer(void) {
    const char *cfg = "target/c_tests_tables_small_config.json";
    const char *tok = "target/c_tests_tables_tokenizer.json";
    if (!check(write_text(cfg, "{\"hidden_size\":64,\"hc_mult\":4,\"engram_layer_ids\":[1],"
                               "\"engram_max_ngram_size\":2,\"engram_n_heads\":1,\"engram_vocab_size\":100,"
                               "\"engram_head_dim\":64,\"engram_pad_token_id\":0}"),
               "write a small config.json in target/"))
        return;
    static const struct {
        long long b, c;
        int ok;
        const char *what;
    } cases[] = {
        {1, 2, 1, "ids 0, 1, 2 (no holes)"},
        {1, 5, 0, "ids 0, 1, 5 (id 5 beyond len(tokenizer) = 3)"},
        {1, 60000, 0, "ids 0, 1, 60000 (id 60000 beyond len(tokenizer) = 3)"},
        {1, 2147483646LL, 0, "id 2^31-2 in a three-token file"},
        {1, 16777216LL, 0, "id 2^24 (the map would span 2^24+1 ids)"},
        {1, 70000, 0, "ids 0, 1, 70000 (69,997 holes: more than tokens + 65,536)"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (!check(write_tokenizer(tok, cases[i].b, cases[i].c), "write %s", cases[i].what)) continue;
        engram_tables *keep = (engram_tables *)&keep;
        engram_tables *t = keep;
        engram_status s = engram_tables_from_files(cfg, tok, &t);
        if (cases[i].ok) {
            int ok = check(s == ENGRAM_STATUS_OK && t != keep, "engram_tables_from_files: %s is accepted",
                           cases[i].what);
            if (!ok) note("status %d: %s", (int)s, engram_last_error());
            if (ok) {
                engram_config c;
                engram_config_init(&c);
                check(engram_tables_fill_config(t, &c) == ENGRAM_STATUS_OK && c.token_map_len == 3 &&
                          c.token_map[0] == 0 && c.token_map[1] == 1 && c.token_map[2] == 2 &&
                          engram_tables_compressed_vocab(t) == 3,
                      "%s: the map spans len(tokenizer) ids, three compressed ids", cases[i].what);
                engram_tables_free(t);
            }
        } else {
            int ok = check(s == ENGRAM_STATUS_ERR_INVALID_CONFIG && t == keep && last_error_has("tokenizer"),
                           "engram_tables_from_files: %s is ERR_INVALID_CONFIG, *out untouched", cases[i].what);
            if (!ok) note("status %d: %s", (int)s, engram_last_error());
            /* The GGUF path that completes a file from config.json + tokenizer.json. */
            engram_gguf_options o;
            engram_gguf_options_init(&o);
            o.max_tokens = 16;
            o.max_seqs = 2;
            o.max_positions = 64;
            o.config_json = DATA "tiny_config.json";
            o.tokenizer_json = tok;
            engram_context *kc = (engram_context *)&kc;
            engram_context *ctx = kc;
            s = engram_create_from_gguf(DATA "tiny_noconst.gguf", &o, &ctx);
            ok = check(s == ENGRAM_STATUS_ERR_INVALID_CONFIG && ctx == kc && last_error_has("tokenizer"),
                       "engram_create_from_gguf + tokenizer_json: %s is ERR_INVALID_CONFIG, *out untouched",
                       cases[i].what);
            if (!ok) note("status %d: %s", (int)s, engram_last_error());
        }
    }
    remove(cfg);
    remove(tok);
}

int main(void) {
    test_tables();
    test_gguf();
    test_hostile_tokenizer();
    return check_summary("test_tables");
}
