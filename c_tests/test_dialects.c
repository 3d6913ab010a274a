/*
 * The loaders of issue 11 from C, under AddressSanitizer: every dialect
 * fixture of tests/golden/data/dialects/ opens with engram_create_from_gguf
 * (the checkpoint with engram_create_from_safetensors) and hashes like its
 * reference; every bad-input mutation of expected.json (its line copy,
 * mutations_c.txt) gets its status and a message naming its keys, leaking
 * nothing; the split fp8 table format through engram_set_layer; the
 * struct_size of the grown and new options structs in both directions; a
 * FIFO where a model file is expected; a model file cut short after open.
 *
 * Paths are relative to the repository root (c_tests/run.sh runs from
 * there); scratch files go to target/.
 */
#if !defined(__cplusplus) && !defined(_POSIX_C_SOURCE)
#define _POSIX_C_SOURCE 200809L
#endif
#include "engram.h"

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "check.h"
#include "filler.h"

#define DATA "tests/golden/data/"
#define DIALECTS DATA "dialects/"
#define TOKENIZER DATA "deepseek_v4_tokenizer.json"
#define SCRATCH "target/c_dialects"

static int last_error_has(const char *what) {
    const char *m = engram_last_error();
    return m != NULL && strstr(m, what) != NULL;
}

/* ---- mutations_c.txt ---------------------------------------------------- */

#define MAX_LINES 128
#define MAX_LINE 4096

typedef struct {
    char name[64], open[128], files[1024], flags[64];
} fixture;

static fixture g_fixtures[16];
static int g_n_fixtures;
static char *g_mutations[MAX_LINES];
static int g_n_mutations;

static int read_mutations(void) {
    FILE *f = fopen(DIALECTS "mutations_c.txt", "r");
    if (!f) return 0;
    char line[MAX_LINE];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        if (strncmp(line, "fixture ", 8) == 0 && g_n_fixtures < 16) {
            fixture *x = &g_fixtures[g_n_fixtures++];
            if (sscanf(line + 8, "%63s %127s %1023s %63s", x->name, x->open, x->files, x->flags) != 4) {
                fclose(f);
                return 0;
            }
        } else if (strncmp(line, "mutation ", 9) == 0 && g_n_mutations < MAX_LINES) {
            size_t n = strlen(line + 9) + 1;
            g_mutations[g_n_mutations] = (char *)malloc(n);
            if (!g_mutations[g_n_mutations]) break;
            memcpy(g_mutations[g_n_mutations++], line + 9, n);
        }
    }
    fclose(f);
    return g_n_fixtures > 0 && g_n_mutations > 0;
}

static const fixture *find_fixture(const char *name) {
    for (int i = 0; i < g_n_fixtures; i++) {
        if (strcmp(g_fixtures[i].name, name) == 0) return &g_fixtures[i];
    }
    return NULL;
}

static int has_flag(const fixture *x, const char *flag) { return strstr(x->flags, flag) != NULL; }

/* Open fixture `x` whose files are under `base` (ending in '/'). */
static engram_status open_fixture(const fixture *x, const char *base, engram_context **out) {
    char path[512], tables[512];
    snprintf(path, sizeof path, "%s%s", base, x->open);
    snprintf(tables, sizeof tables, "%scheckpoint", base);
    if (has_flag(x, "safetensors")) {
        engram_safetensors_options o;
        engram_safetensors_options_init(&o);
        o.tokenizer_json = TOKENIZER;
        return engram_create_from_safetensors(path, &o, out);
    }
    engram_gguf_options o;
    engram_gguf_options_init(&o);
    if (has_flag(x, "tables")) o.tables_dir = tables;
    if (has_flag(x, "tokenizer")) o.tokenizer_json = TOKENIZER;
    return engram_create_from_gguf(path, &o, out);
}

/* Copy fixture `x`'s files (and the checkpoint, for "tables") into `dir`. */
static int stage_fixture(const fixture *x, const char *dir) {
    char d[512], src[512], dst[512];
    snprintf(d, sizeof d, "%s/checkpoint", dir);
    mkdir(dir, 0700);
    mkdir(d, 0700);
    char files[1024];
    snprintf(files, sizeof files, "%s", x->files);
    int ok = 1;
    for (char *tok = strtok(files, ","); tok; tok = strtok(NULL, ",")) {
        snprintf(src, sizeof src, "%s%s", DIALECTS, tok);
        snprintf(dst, sizeof dst, "%s/%s", dir, tok);
        ok &= copy_whole_file(src, dst);
    }
    if (has_flag(x, "tables")) {
        static const char *ck[] = {"config.json", "model.safetensors.index.json",
                                   "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"};
        for (size_t i = 0; i < sizeof ck / sizeof ck[0]; i++) {
            snprintf(src, sizeof src, "%scheckpoint/%s", DIALECTS, ck[i]);
            snprintf(dst, sizeof dst, "%s/checkpoint/%s", dir, ck[i]);
            ok &= copy_whole_file(src, dst);
        }
    }
    return ok;
}

static void unstage(const char *dir) {
    char p[512];
    static const char *names[] = {"config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
                                  "model-00002-of-00002.safetensors"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(p, sizeof p, "%s/checkpoint/%s", dir, names[i]);
        remove(p);
    }
    for (int i = 0; i < g_n_fixtures; i++) {
        char files[1024];
        snprintf(files, sizeof files, "%s", g_fixtures[i].files);
        for (char *tok = strtok(files, ","); tok; tok = strtok(NULL, ",")) {
            snprintf(p, sizeof p, "%s/%s", dir, tok);
            remove(p);
        }
    }
    snprintf(p, sizeof p, "%s/checkpoint", dir);
    rmdir(p);
    rmdir(dir);
}

static int hexbyte(const char *s) {
    unsigned v = 0;
    for (int i = 0; i < 2; i++) {
        char c = s[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else return -1;
    }
    return (int)v;
}

/* Apply one op ("patch,FILE,OFFSET,OLD,NEW" or "delete,FILE") under `dir`. */
static int apply_op(const char *dir, char *op) {
    char *kind = strtok(op, ",");
    char *file = strtok(NULL, ",");
    if (!kind || !file) return 0;
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    if (strcmp(kind, "delete") == 0) return remove(path) == 0;
    char *off = strtok(NULL, ","), *old_hex = strtok(NULL, ","), *new_hex = strtok(NULL, ",");
    if (!off || !old_hex || !new_hex || strlen(old_hex) != strlen(new_hex)) return 0;
    FILE *f = fopen(path, "r+b");
    if (!f) return 0;
    long at = atol(off);
    size_t n = strlen(old_hex) / 2;
    int ok = fseek(f, at, SEEK_SET) == 0;
    for (size_t i = 0; ok && i < n; i++) {
        int c = fgetc(f);
        ok = c == hexbyte(old_hex + 2 * i);
    }
    ok = ok && fseek(f, at, SEEK_SET) == 0;
    for (size_t i = 0; ok && i < n; i++) ok = fputc(hexbyte(new_hex + 2 * i), f) != EOF;
    if (fclose(f) != 0) ok = 0;
    return ok;
}

static void test_mutations(void) {
    int done = 0;
    for (int i = 0; i < g_n_mutations; i++) {
        char line[MAX_LINE];
        snprintf(line, sizeof line, "%s", g_mutations[i]);
        char *save = NULL;
        char *fx = strtok_r(line, " ", &save), *name = strtok_r(NULL, " ", &save);
        char *status = strtok_r(NULL, " ", &save), *names = strtok_r(NULL, " ", &save);
        char *ops = strtok_r(NULL, " ", &save);
        const fixture *x = fx ? find_fixture(fx) : NULL;
        if (!check(x && name && status && names && ops, "mutation line %d parses", i)) continue;
        char dir[256];
        snprintf(dir, sizeof dir, SCRATCH "_m%d", i);
        int ok = stage_fixture(x, dir);
        char *osave = NULL;
        for (char *op = strtok_r(ops, ";", &osave); op; op = strtok_r(NULL, ";", &osave)) {
            char buf[2048];
            snprintf(buf, sizeof buf, "%s", op);
            ok &= apply_op(dir, buf);
        }
        if (check(ok, "%s/%s: the mutated copy is written", fx, name)) {
            char base[300];
            snprintf(base, sizeof base, "%s/", dir);
            engram_context *c = NULL;
            engram_status st = open_fixture(x, base, &c);
            int named = 1;
            char nbuf[1024];
            snprintf(nbuf, sizeof nbuf, "%s", names);
            char *nsave = NULL;
            for (char *k = strtok_r(nbuf, ",", &nsave); k; k = strtok_r(NULL, ",", &nsave)) {
                if (!last_error_has(k)) {
                    named = 0;
                    note("the message does not name %s", k);
                }
            }
            if (!check((int)st == atoi(status) && c == NULL && named, "%s/%s: status %s and a message naming %s",
                       fx, name, status, names)) {
                note("got status %d: %s", (int)st, engram_last_error());
            }
            engram_free(c);
        }
        unstage(dir);
        done++;
    }
    check(done >= 40, "%d mutations of expected.json checked from C", done);
}

/* ---- every fixture opens and hashes like its reference ------------------- */

/* Hash `n` tokens (seq 0, pos 0..n) and apply every layer (f32 highway). */
static int hash_and_apply(engram_context *c, const int32_t *tok, uint32_t n, int64_t *ids, size_t cap) {
    int32_t seq[8] = {0}, pos[8];
    for (uint32_t i = 0; i < n; i++) pos[i] = (int32_t)i;
    if (engram_hash(c, tok, seq, pos, n, ids, cap) != ENGRAM_STATUS_OK) return 0;
    static const uint32_t layers[2] = {1, 3};
    for (int l = 0; l < 2; l++) {
        float *h = (float *)build_values("c.dialects.h", (size_t)n * TINY_HC * TINY_D, 1.0, 0.0, 0);
        engram_status st = engram_apply(c, layers[l], ids, n, h, ENGRAM_TYPE_F32, NULL);
        int finite = 1;
        for (size_t i = 0; i < (size_t)n * TINY_HC * TINY_D; i++) finite &= isfinite(h[i]) != 0;
        free(h);
        if (st != ENGRAM_STATUS_OK || !finite) return 0;
    }
    return 1;
}

static void test_fixtures(void) {
    /* References: tiny.gguf (the tiny hash), tiny_noconst + config + tokenizer (the derived hash). */
    engram_gguf_options o;
    engram_gguf_options_init(&o);
    engram_context *tiny = NULL, *derived = NULL;
    check(engram_create_from_gguf(DATA "tiny.gguf", &o, &tiny) == ENGRAM_STATUS_OK, "reference: tiny.gguf");
    o.config_json = DATA "tiny_config.json";
    o.tokenizer_json = TOKENIZER;
    check(engram_create_from_gguf(DATA "tiny_noconst.gguf", &o, &derived) == ENGRAM_STATUS_OK,
          "reference: tiny_noconst.gguf + config + tokenizer");
    static const int32_t tiny_tok[4] = {1, 2, 3, 4};
    static const int32_t real_tok[4] = {19923, 14, 2058, 3};
    int64_t want_t[4 * 8], want_d[4 * 8];
    check(tiny && derived && hash_and_apply(tiny, tiny_tok, 4, want_t, 32) &&
              hash_and_apply(derived, real_tok, 4, want_d, 32),
          "references hash and apply");
    for (int i = 0; i < g_n_fixtures; i++) {
        const fixture *x = &g_fixtures[i];
        engram_context *c = NULL;
        engram_status st = open_fixture(x, DIALECTS, &c);
        if (!check(st == ENGRAM_STATUS_OK && c != NULL, "%s opens", x->name)) {
            note("%s", engram_last_error());
            continue;
        }
        int derived_hash = has_flag(x, "tokenizer");
        int64_t ids[4 * 8];
        int ok = hash_and_apply(c, derived_hash ? real_tok : tiny_tok, 4, ids, 32);
        check(ok && memcmp(ids, derived_hash ? want_d : want_t, sizeof ids) == 0,
              "%s: hash ids equal the reference's; apply succeeds on both layers", x->name);
        engram_free(c);
        /* Mapped too. */
        if (!has_flag(x, "safetensors")) {
            engram_gguf_options m;
            engram_gguf_options_init(&m);
            m.mmap_tables = 1;
            char tables[256];
            snprintf(tables, sizeof tables, DIALECTS "checkpoint");
            if (has_flag(x, "tables")) m.tables_dir = tables;
            if (has_flag(x, "tokenizer")) m.tokenizer_json = TOKENIZER;
            char path[256];
            snprintf(path, sizeof path, DIALECTS "%s", x->open);
            c = NULL;
            check(engram_create_from_gguf(path, &m, &c) == ENGRAM_STATUS_OK &&
                      hash_and_apply(c, derived_hash ? real_tok : tiny_tok, 4, ids, 32),
                  "%s opens mapped", x->name);
            engram_free(c);
        }
    }
    /* Tables elsewhere, without tables_dir: refused saying where they are. */
    engram_gguf_options_init(&o);
    engram_context *c = NULL;
    check(engram_create_from_gguf(DIALECTS "ds4gw_style.gguf", &o, &c) == ENGRAM_STATUS_ERR_IO && c == NULL &&
              last_error_has("deepseek4.engram.0.table_path") && last_error_has("tables_dir"),
          "ds4gw_style.gguf without tables_dir: ERR_IO naming the key and tables_dir");
    o.tables_dir = "target/no_such_dir";
    check(engram_create_from_gguf(DIALECTS "ds4gw_style.gguf", &o, &c) == ENGRAM_STATUS_ERR_IO && c == NULL,
          "a tables_dir without the shard: ERR_IO");
    /* A tokenizer alone whose token map differs from the file's. */
    engram_gguf_options_init(&o);
    o.tokenizer_json = TOKENIZER;
    check(engram_create_from_gguf(DATA "tiny.gguf", &o, &c) == ENGRAM_STATUS_ERR_INVALID_CONFIG && c == NULL &&
              last_error_has("token_map"),
          "tokenizer_json alone, disagreeing with the file's token map: ERR_INVALID_CONFIG");
    engram_free(tiny);
    engram_free(derived);
}

/* ---- engram_create_from_safetensors: bad arguments ------------------------- */

static void test_safetensors_args(void) {
    engram_safetensors_options o;
    engram_safetensors_options_init(&o);
    check(o.struct_size == sizeof o && o.tokenizer_json == NULL && o.mmap_tables == 0 && o.max_tokens > 0 &&
              o.backend == ENGRAM_BACKEND_CPU,
          "engram_safetensors_options_init: defaults");
    engram_context *keep = (engram_context *)&o, *out = keep;
    const char *ck = DIALECTS "checkpoint";
    check(engram_create_from_safetensors(NULL, &o, &out) == ENGRAM_STATUS_ERR_NULL_ARGUMENT && out == keep,
          "NULL model_dir");
    check(engram_create_from_safetensors(ck, NULL, &out) == ENGRAM_STATUS_ERR_NULL_ARGUMENT && out == keep,
          "NULL options");
    check(engram_create_from_safetensors(ck, &o, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "NULL out");
    check(engram_create_from_safetensors(ck, &o, &out) == ENGRAM_STATUS_ERR_INVALID_CONFIG && out == keep &&
              last_error_has("tokenizer.json"),
          "a checkpoint without tokenizer.json and none given: ERR_INVALID_CONFIG naming it");
    o.tokenizer_json = "target/no_such_tokenizer.json";
    check(engram_create_from_safetensors(ck, &o, &out) == ENGRAM_STATUS_ERR_IO && out == keep,
          "a missing tokenizer_json: ERR_IO");
    o.tokenizer_json = TOKENIZER;
    check(engram_create_from_safetensors("target/no_such_checkpoint", &o, &out) == ENGRAM_STATUS_ERR_IO &&
              out == keep,
          "a missing directory: ERR_IO");
    check(engram_create_from_safetensors(DATA "tiny.gguf", &o, &out) == ENGRAM_STATUS_ERR_IO && out == keep &&
              last_error_has("not a directory"),
          "a file instead of a directory: ERR_IO");
    engram_safetensors_options s = o;
    s.backend = ENGRAM_BACKEND_CUDA;
    {
        /* The CUDA backend opens a checkpoint where a driver and a device exist; a machine
         * without them (CI) gets ERR_DEVICE with a message, out untouched. */
        engram_status st = engram_create_from_safetensors(ck, &s, &out);
        if (st == ENGRAM_STATUS_OK) {
            check(out != keep && out != NULL, "the CUDA backend: opens where a device exists");
            engram_free(out);
            out = keep;
        } else {
            check(st == ENGRAM_STATUS_ERR_DEVICE && out == keep && engram_last_error()[0] != '\0',
                  "the CUDA backend without a device: ERR_DEVICE with a message, out untouched");
        }
    }
    s = o;
    s.struct_size = sizeof s + 8;
    char a[32], b[32];
    snprintf(a, sizeof a, "%zu", sizeof s + 8);
    snprintf(b, sizeof b, "%zu", sizeof s);
    check(engram_create_from_safetensors(ck, &s, &out) == ENGRAM_STATUS_ERR_STRUCT_SIZE && out == keep &&
              last_error_has(a) && last_error_has(b),
          "a larger (newer) struct_size: ERR_STRUCT_SIZE naming both sizes");
    s.struct_size = offsetof(engram_safetensors_options, row_cache_bytes) - 8;
    check(engram_create_from_safetensors(ck, &s, &out) == ENGRAM_STATUS_ERR_STRUCT_SIZE && out == keep,
          "a smaller struct_size than any layout: ERR_STRUCT_SIZE");
    s.struct_size = offsetof(engram_safetensors_options, row_cache_bytes);
    check(engram_create_from_safetensors(ck, &s, &out) == ENGRAM_STATUS_OK && out != keep,
          "the 0.3 layout (ending before row_cache_bytes): opens, no row cache");
    if (out != keep) engram_free(out);
    out = keep;
    engram_safetensors_options_init_sized(NULL, sizeof o); /* ignored */
    s = o;
    s.mmap_tables = 1;
    check(engram_create_from_safetensors(ck, &s, &out) == ENGRAM_STATUS_OK && out != keep, "mapped: opens");
    if (out != keep) engram_free(out);
}

/* ---- struct_size: the 0.2 layouts of the grown structs -------------------- */

static void test_struct_sizes(void) {
    engram_gguf_options o;
    engram_gguf_options_init(&o);
    engram_context *c = NULL;
    o.struct_size = offsetof(engram_gguf_options, tables_dir);
    check(engram_create_from_gguf(DATA "tiny.gguf", &o, &c) == ENGRAM_STATUS_OK && c != NULL,
          "engram_gguf_options of the 0.2 layout (without tables_dir) still works");
    engram_free(c);
    c = NULL;
    o.struct_size = sizeof o + 8;
    char a[32], b[32];
    snprintf(a, sizeof a, "%zu", sizeof o + 8);
    snprintf(b, sizeof b, "%zu", sizeof o);
    check(engram_create_from_gguf(DATA "tiny.gguf", &o, &c) == ENGRAM_STATUS_ERR_STRUCT_SIZE && c == NULL &&
              last_error_has(a) && last_error_has(b),
          "engram_gguf_options: a larger struct_size is refused naming both sizes");
    o.struct_size = offsetof(engram_gguf_options, tables_dir) - 4;
    check(engram_create_from_gguf(DATA "tiny.gguf", &o, &c) == ENGRAM_STATUS_ERR_STRUCT_SIZE && c == NULL,
          "engram_gguf_options: smaller than the oldest layout is refused");
    /* Between the two layouts: half of the tables_dir pointer. Reading it would
     * make a pointer of the caller's low half and zeros. */
    o.tables_dir = "target/no_such_tables_dir";
    o.struct_size = offsetof(engram_gguf_options, tables_dir) + 4;
    check(engram_create_from_gguf(DATA "tiny.gguf", &o, &c) == ENGRAM_STATUS_ERR_STRUCT_SIZE && c == NULL &&
              last_error_has("layout"),
          "engram_gguf_options: a struct_size that cuts the tables_dir pointer is refused, naming the layouts");
    /* The 0.3 layout (ending before row_cache_bytes): no row cache. */
    o.tables_dir = NULL;
    o.struct_size = offsetof(engram_gguf_options, row_cache_bytes);
    check(engram_create_from_gguf(DATA "tiny.gguf", &o, &c) == ENGRAM_STATUS_OK && c != NULL,
          "engram_gguf_options of the 0.3 layout (without row_cache_bytes) still works");
    engram_free(c);
    c = NULL;
    o.struct_size = offsetof(engram_gguf_options, row_cache_bytes) + 4;
    check(engram_create_from_gguf(DATA "tiny.gguf", &o, &c) == ENGRAM_STATUS_ERR_STRUCT_SIZE && c == NULL,
          "engram_gguf_options: a struct_size that cuts row_cache_bytes is refused");
}

/* ---- the split fp8 table through engram_set_layer -------------------------- */

#define ROWS1 420


/* The value of an e4m3 code (not NaN) times 2^(scale - 127), as f32 bits. */
static float fp8_value(uint8_t code, uint8_t scale) {
    int e = (code >> 3) & 15, m = code & 7;
    float v = e == 0 ? ldexpf((float)m, -9) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
    v = ldexpf(v, (int)scale - 127);
    return (code & 0x80) ? -v : v;
}

/* wkv as block-scaled fp8 (codes + 16 x 32 block scales) gives the highway of
   the same weights widened to bf16, bit for bit; a NaN code is refused naming
   its block, a block size of 0 naming the field, and neither changes the layer. */
static void fp8_wkv_matches_bf16(engram_context *c, const engram_layer_weights *base, const int64_t *ids) {
    const size_t m = TINY_KV_OUT, k = TINY_KV_IN, br = 16, bc = 32;
    const size_t nsc = ((m + br - 1) / br) * ((k + bc - 1) / bc);
    uint8_t *codes = (uint8_t *)malloc(m * k);
    uint8_t *sc = (uint8_t *)malloc(nsc);
    uint16_t *wide = (uint16_t *)malloc(m * k * 2);
    if (!check(codes && sc && wide, "fp8 wkv buffers")) return;
    for (size_t i = 0; i < m * k; i++) {
        uint8_t b = (uint8_t)(i * 2654435761u >> 13);
        codes[i] = (b & 0x7F) == 0x7F ? (uint8_t)(b ^ 1) : b;
    }
    for (size_t i = 0; i < nsc; i++) sc[i] = (uint8_t)(118 + i % 12);
    for (size_t o = 0; o < m; o++)
        for (size_t i = 0; i < k; i++) {
            float v = fp8_value(codes[o * k + i], sc[(o / br) * ((k + bc - 1) / bc) + i / bc]);
            uint32_t bits;
            memcpy(&bits, &v, 4);
            wide[o * k + i] = (uint16_t)(bits >> 16); /* exact: the low half is zero */
        }
    size_t nh = (size_t)6 * TINY_HC * TINY_D;
    float *h1 = (float *)build_values("c.fp8wkv.h", nh, 1.0, 0.0, 0);
    float *h2 = (float *)build_values("c.fp8wkv.h", nh, 1.0, 0.0, 0);
    float *h3 = (float *)build_values("c.fp8wkv.h", nh, 1.0, 0.0, 0);
    engram_layer_weights w = *base;
    w.wkv = wide;
    w.wkv_type = ENGRAM_TYPE_BF16;
    check(engram_set_layer(c, &w) == ENGRAM_STATUS_OK && engram_apply(c, 1, ids, 6, h1, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_OK,
          "the widened bf16 wkv");
    w.wkv = codes;
    w.wkv_type = ENGRAM_TYPE_FP8_E4M3_E8M0_BLOCK;
    w.wkv_scales = sc;
    w.wkv_block_rows = (uint32_t)br;
    w.wkv_block_cols = (uint32_t)bc;
    check(engram_set_layer(c, &w) == ENGRAM_STATUS_OK && engram_apply(c, 1, ids, 6, h2, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_OK &&
              memcmp(h1, h2, nh * sizeof(float)) == 0,
          "ENGRAM_TYPE_FP8_E4M3_E8M0_BLOCK wkv: the highway of the widened bf16 wkv, bit for bit");
    engram_layer_weights bad = w;
    bad.wkv_block_rows = 0;
    check(engram_set_layer(c, &bad) == ENGRAM_STATUS_ERR_INVALID_ARGUMENT && last_error_has("wkv_block_rows"),
          "fp8 wkv with a block size of 0: ERR_INVALID_ARGUMENT naming it");
    bad = w;
    bad.wkv_scales = NULL;
    check(engram_set_layer(c, &bad) == ENGRAM_STATUS_ERR_NULL_ARGUMENT && last_error_has("wkv_scales"),
          "fp8 wkv without scales: ERR_NULL_ARGUMENT naming wkv_scales");
    /* A copy with a NaN code (the layer set borrows `codes`: never modify it). */
    uint8_t *nan_codes = (uint8_t *)malloc(m * k);
    if (!check(nan_codes != NULL, "a copy of the codes")) return;
    memcpy(nan_codes, codes, m * k);
    nan_codes[(br + 1) * k + bc + 2] = 0xFF;
    bad = w;
    bad.wkv = nan_codes;
    check(engram_set_layer(c, &bad) == ENGRAM_STATUS_ERR_INVALID_DATA && last_error_has("fp8 block (1, 1)"),
          "a NaN code: ERR_INVALID_DATA naming its block (%s)", engram_last_error());
    check(engram_apply(c, 1, ids, 6, h3, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_OK && memcmp(h1, h3, nh * sizeof(float)) == 0,
          "the refused fp8 set_layer calls changed nothing");
    check(engram_set_layer(c, base) == ENGRAM_STATUS_OK, "the layer back as it was");
    free(nan_codes);
    free(h1);
    free(h2);
    free(h3);
    free(codes);
    free(sc);
    free(wide);
}

static void test_split_layer(void) {
    engram_gguf_options go;
    engram_gguf_options_init(&go);
    engram_context *c = NULL;
    if (!check(engram_create_from_gguf(DATA "tiny.gguf", &go, &c) == ENGRAM_STATUS_OK, "a context to set layers on"))
        return;
    char tn[64];
    table_name(tn, sizeof tn, 1);
    uint8_t *packed = build_table_fp8(tn, ROWS1, TINY_HD);
    uint8_t *codes = (uint8_t *)filler_alloc((size_t)ROWS1 * TINY_HD);
    uint8_t *scales = (uint8_t *)filler_alloc((size_t)ROWS1 * (TINY_HD / 32));
    for (size_t r = 0; r < ROWS1; r++) {
        memcpy(codes + r * TINY_HD, packed + r * (TINY_HD + 2), TINY_HD);
        memcpy(scales + r * 2, packed + r * (TINY_HD + 2) + TINY_HD, 2);
    }
    void *wkv = build_wkv(1, TINY_KV_OUT, TINY_KV_IN, 1);
    void *q = build_qk(1, "q", TINY_HC, TINY_D, 1);
    void *k = build_qk(1, "k", TINY_HC, TINY_D, 1);
    engram_layer_weights w;
    engram_layer_weights_init(&w);
    check(w.struct_size == sizeof w && w.table_scales == NULL, "engram_layer_weights_init: table_scales NULL");
    w.layer_id = 1;
    w.table_type = ENGRAM_TYPE_FP8_E4M3_E8M0;
    w.table = packed;
    w.table_rows = ROWS1;
    w.wkv = wkv;
    w.wkv_type = ENGRAM_TYPE_BF16;
    w.q = q;
    w.k = k;
    w.qk_type = ENGRAM_TYPE_BF16;
    /* A caller of the 0.2 layout: struct_size ends before table_scales. */
    engram_layer_weights old = w;
    old.struct_size = offsetof(engram_layer_weights, table_scales);
    old.table_scales = codes; /* past its struct_size: never read */
    check(engram_set_layer(c, &old) == ENGRAM_STATUS_OK, "engram_layer_weights of the 0.2 layout (packed fp8)");
    static const int32_t tok[6] = {1, 2, 3, 4, 6, 7};
    int32_t seq[6] = {0}, pos[6] = {0, 1, 2, 3, 4, 5};
    int64_t ids[6 * 8];
    check(engram_hash(c, tok, seq, pos, 6, ids, 48) == ENGRAM_STATUS_OK, "hash");
    size_t nh = (size_t)6 * TINY_HC * TINY_D;
    float *ha = (float *)build_values("c.split.h", nh, 1.0, 0.0, 0);
    float *hb = (float *)build_values("c.split.h", nh, 1.0, 0.0, 0);
    float *hc = (float *)build_values("c.split.h", nh, 1.0, 0.0, 0);
    check(engram_apply(c, 1, ids, 6, ha, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_OK, "apply, packed table");
    /* The same table as two arrays. */
    engram_layer_weights s = w;
    s.table_type = ENGRAM_TYPE_FP8_E4M3_E8M0_SPLIT;
    s.table = codes;
    s.table_scales = scales;
    check(engram_set_layer(c, &s) == ENGRAM_STATUS_OK, "set_layer with a split fp8 table (table + table_scales)");
    check(engram_apply(c, 1, ids, 6, hb, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_OK &&
              memcmp(ha, hb, nh * sizeof(float)) == 0,
          "the split table gives the packed table's highway bit for bit");
    engram_layer_weights bad = s;
    bad.table_scales = NULL;
    check(engram_set_layer(c, &bad) == ENGRAM_STATUS_ERR_NULL_ARGUMENT && last_error_has("table_scales"),
          "split without table_scales: ERR_NULL_ARGUMENT naming it");
    bad = w;
    bad.table_scales = scales;
    check(engram_set_layer(c, &bad) == ENGRAM_STATUS_ERR_INVALID_ARGUMENT && last_error_has("table_scales"),
          "table_scales with a packed table: ERR_INVALID_ARGUMENT naming it");
    check(engram_apply(c, 1, ids, 6, hc, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_OK &&
              memcmp(ha, hc, nh * sizeof(float)) == 0,
          "the refused set_layer calls changed nothing");
    /* A caller of the layout that ends before wkv_scales: those fields are never read. */
    engram_layer_weights mid = s;
    mid.struct_size = offsetof(engram_layer_weights, wkv_scales);
    mid.wkv_scales = codes;
    mid.wkv_block_rows = 7;
    check(engram_set_layer(c, &mid) == ENGRAM_STATUS_OK, "engram_layer_weights of the layout before wkv_scales");
    fp8_wkv_matches_bf16(c, &s, ids);
    bad = w;
    bad.struct_size = sizeof w + 8;
    char a[32], b[32];
    snprintf(a, sizeof a, "%zu", sizeof w + 8);
    snprintf(b, sizeof b, "%zu", sizeof w);
    check(engram_set_layer(c, &bad) == ENGRAM_STATUS_ERR_STRUCT_SIZE && last_error_has(a) && last_error_has(b),
          "engram_layer_weights: a larger struct_size is refused naming both sizes");
    bad = s;
    bad.struct_size = offsetof(engram_layer_weights, table_scales) + 4;
    check(engram_set_layer(c, &bad) == ENGRAM_STATUS_ERR_STRUCT_SIZE && last_error_has("layout"),
          "engram_layer_weights: a struct_size that cuts the table_scales pointer is refused, naming the layouts");
    float *hd = (float *)build_values("c.split.h", nh, 1.0, 0.0, 0);
    check(engram_apply(c, 1, ids, 6, hd, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_OK &&
              memcmp(ha, hd, nh * sizeof(float)) == 0,
          "the refused struct_size changed nothing");
    free(hd);
    engram_free(c);
    free(packed);
    free(codes);
    free(scales);
    free(wkv);
    free(q);
    free(k);
    free(ha);
    free(hb);
    free(hc);
}

/* ---- hostile files ---------------------------------------------------------- */

static void test_fifo(void) {
    const char *fifo = SCRATCH "_fifo.gguf";
    remove(fifo);
    if (!check(mkfifo(fifo, 0600) == 0, "mkfifo %s", fifo)) return;
    alarm(120); /* a blocked open() would hang here: fail loudly instead */
    engram_gguf_options o;
    engram_gguf_options_init(&o);
    engram_context *c = NULL;
    check(engram_create_from_gguf(fifo, &o, &c) == ENGRAM_STATUS_ERR_IO && c == NULL && last_error_has("FIFO"),
          "engram_create_from_gguf on a FIFO: ERR_IO at once");
    engram_tables *t = NULL;
    check(engram_tables_from_files(fifo, TOKENIZER, &t) == ENGRAM_STATUS_ERR_IO && t == NULL &&
              last_error_has("FIFO"),
          "engram_tables_from_files with a FIFO config.json: ERR_IO");
    check(engram_tables_from_files(DATA "tiny_config.json", fifo, &t) == ENGRAM_STATUS_ERR_IO && t == NULL,
          "engram_tables_from_files with a FIFO tokenizer.json: ERR_IO");
    mkdir(SCRATCH "_fifo_ck", 0700);
    remove(SCRATCH "_fifo_ck/config.json");
    check(mkfifo(SCRATCH "_fifo_ck/config.json", 0600) == 0, "mkfifo config.json");
    engram_safetensors_options so;
    engram_safetensors_options_init(&so);
    so.tokenizer_json = TOKENIZER;
    check(engram_create_from_safetensors(SCRATCH "_fifo_ck", &so, &c) == ENGRAM_STATUS_ERR_IO && c == NULL &&
              last_error_has("FIFO"),
          "engram_create_from_safetensors with a FIFO config.json: ERR_IO");
    alarm(0);
    remove(SCRATCH "_fifo_ck/config.json");
    rmdir(SCRATCH "_fifo_ck");
    remove(fifo);
}

/* The end of blk.1.engram_embd's data in tiny.gguf (tests/gguf_hostile.rs
 * computes it from the header): layer 1's table stays, everything after it goes. */
#define TINY_LAYER1_TABLE_END 61408

static void test_cut_after_open(void) {
    const char *p = SCRATCH "_cut.gguf";
    if (!check(copy_whole_file(DATA "tiny.gguf", p), "copy tiny.gguf")) return;
    engram_gguf_options o;
    engram_gguf_options_init(&o); /* mmap_tables = 0: pread */
    engram_context *c = NULL;
    if (!check(engram_create_from_gguf(p, &o, &c) == ENGRAM_STATUS_OK, "open the copy")) return;
    static const int32_t tok[4] = {1, 2, 3, 4};
    int32_t seq[4] = {0}, pos[4] = {0, 1, 2, 3};
    int64_t ids[32];
    check(engram_hash(c, tok, seq, pos, 4, ids, 32) == ENGRAM_STATUS_OK, "hash");
    size_t nh = (size_t)4 * TINY_HC * TINY_D;
    float *h = (float *)build_values("c.cut.h", nh, 1.0, 0.0, 0);
    float *x = (float *)build_values("c.cut.h", nh, 1.0, 0.0, 0);
    check(truncate(p, TINY_LAYER1_TABLE_END) == 0, "truncate the file under the context");
    check(engram_apply(c, 1, ids, 4, h, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_OK,
          "layer 1 (its wkv, q, k read at open; its table before the cut) still applies: no SIGBUS");
    memcpy(h, x, nh * sizeof(float));
    check(engram_apply(c, 3, ids, 4, h, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_ERR_IO &&
              memcmp(h, x, nh * sizeof(float)) == 0,
          "layer 3 (its table cut off): ERR_IO, the highway untouched");
    check(engram_prefetch(c, 3, ids, 4) == ENGRAM_STATUS_OK &&
              engram_apply(c, 3, ids, 4, h, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_ERR_IO,
          "prefetched: ERR_IO too");
    engram_free(c);
    free(h);
    free(x);
    remove(p);
}

int main(void) {
    if (!check(read_mutations(), "read " DIALECTS "mutations_c.txt")) return check_summary("test_dialects");
    test_fixtures();
    test_safetensors_args();
    test_struct_sizes();
    test_split_layer();
    test_fifo();
    test_cut_after_open();
    test_mutations();
    for (int i = 0; i < g_n_mutations; i++) free(g_mutations[i]);
    return check_summary("test_dialects");
}
