/*
 * Shard contexts straight from a model file (the loaders' shard_* options,
 * docs/sharding.md "Shard contexts"): on the golden's tiny.gguf, read with
 * pread, each rank of worlds 1..5 holds its part of every layer's wkv
 * (engram_shard_bytes: the parts tile the whole), the loader owns that much
 * less memory (engram_context_memory), and row ranges summed + wkv output
 * ranges joined + engram_gate_from_kv give engram_apply's highway bit for
 * bit. Bad specs (a world of 0, a rank not below its world) are refused by
 * both loaders with nothing written; an options struct from before the shard
 * fields reads as the whole layer.
 */
#include "engram.h"
#include "check.h"

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DATA "tests/golden/data/"
#define TINY DATA "tiny.gguf"
#define NT 5
#define ST ENGRAM_STATUS_OK

static const uint32_t g_layers[2] = {1, 3};

struct geo {
    size_t d, hc, k_in, k_out, heads, n_ids;
};

static engram_context *open_shard(uint32_t tr, uint32_t tw, uint32_t wr, uint32_t ww) {
    engram_gguf_options o;
    engram_gguf_options_init(&o);
    o.shard_table_rank = tr;
    o.shard_table_world = tw;
    o.shard_wkv_rank = wr;
    o.shard_wkv_world = ww;
    engram_context *ctx = NULL;
    if (engram_create_from_gguf(TINY, &o, &ctx) != ST) return NULL;
    return ctx;
}

static int geometry(engram_context *ctx, struct geo *g) {
    engram_info info;
    engram_info_init(&info);
    if (engram_context_info(ctx, &info) != ST) return 0;
    g->d = info.hidden_size;
    g->hc = info.hc;
    g->k_in = (size_t)info.cols * info.head_dim;
    g->k_out = g->d * (g->hc + 1);
    g->heads = info.n_heads;
    g->n_ids = NT * engram_row_ids_per_token(ctx);
    return 1;
}

/* The wkv bytes `ctx` holds over both layers, and the bytes its loader owns. */
static int held(engram_context *ctx, uint64_t *wkv, uint64_t *loaded) {
    *wkv = 0;
    for (int i = 0; i < 2; i++) {
        uint64_t t = 0, w = 0;
        if (engram_shard_bytes(ctx, g_layers[i], &t, &w) != ST) return 0;
        *wkv += w;
    }
    return engram_context_memory(ctx, loaded, NULL) == ST;
}

/* One layer through the split calls of the ranks' contexts into `hw`. */
static int split_layer(engram_context **ctxs, uint32_t world, const struct geo *g, uint32_t layer,
                       const int64_t *ids, float *hw) {
    size_t nr = NT * g->k_in, nk = NT * g->k_out;
    float *rows = (float *)calloc(nr, sizeof(float));
    float *part = (float *)calloc(nr, sizeof(float));
    float *kv = (float *)calloc(nk, sizeof(float));
    float *mine = (float *)calloc(nk, sizeof(float));
    int ok = rows && part && kv && mine;
    for (size_t i = 0; ok && i < nr; i++) rows[i] = -0.0f;
    for (uint32_t r = 0; ok && r < world; r++) {
        uint64_t b = 0, e = 0;
        ok = engram_shard_held(ctxs[r], layer, &b, &e, NULL, NULL) == ST &&
             engram_gather_rows(ctxs[r], layer, NT, ids, g->n_ids, b, e, 0, (uint32_t)g->heads, part, nr,
                                ENGRAM_TYPE_F32, NULL) == ST;
        for (size_t i = 0; ok && i < nr; i++) rows[i] += part[i];
    }
    for (uint32_t r = 0; ok && r < world; r++) {
        uint64_t o0 = 0, o1 = 0;
        ok = engram_shard_held(ctxs[r], layer, NULL, NULL, &o0, &o1) == ST;
        size_t w = (size_t)(o1 - o0);
        ok = ok && engram_kv_columns(ctxs[r], layer, NT, rows, nr, ENGRAM_TYPE_F32, o0, o1, mine, NT * w,
                                     ENGRAM_TYPE_F32, NULL) == ST;
        for (size_t t = 0; ok && t < NT; t++) memcpy(kv + t * g->k_out + o0, mine + t * w, w * sizeof(float));
    }
    ok = ok && engram_gate_from_kv(ctxs[world - 1], layer, NT, ids, g->n_ids, kv, nk, ENGRAM_TYPE_F32, hw,
                                   NT * g->hc * g->d * sizeof(float), ENGRAM_TYPE_F32, NULL) == ST;
    free(rows);
    free(part);
    free(kv);
    free(mine);
    return ok;
}

static void worlds(void) {
    engram_context *whole = open_shard(0, 1, 0, 1);
    struct geo g;
    if (!check(whole != NULL && geometry(whole, &g), "tiny.gguf opens whole")) return;
    const int32_t tok[NT] = {3, 7, ENGRAM_TOKEN_DEAD, 11, 2};
    const int32_t seq[NT] = {0, 0, 0, 0, 0};
    const int32_t pos[NT] = {0, 1, 2, 3, 4};
    size_t nh = NT * g.hc * g.d;
    int64_t *ids = (int64_t *)calloc(g.n_ids, sizeof(int64_t));
    float *want = (float *)calloc(nh, sizeof(float));
    float *hw = (float *)calloc(nh, sizeof(float));
    uint64_t whole_wkv = 0, whole_loaded = 0;
    int ok = ids && want && hw && engram_hash(whole, tok, seq, pos, NT, ids, g.n_ids) == ST;
    for (size_t i = 0; i < nh && ok; i++) want[i] = (float)((int)(i % 13) - 6) * 0.25f;
    for (int i = 0; i < 2 && ok; i++) ok = engram_apply(whole, g_layers[i], ids, NT, want, ENGRAM_TYPE_F32, NULL) == ST;
    ok = ok && held(whole, &whole_wkv, &whole_loaded) && whole_wkv > 0;
    check(ok, "the whole layer applied; its wkv is %llu bytes, its loader owns %llu", (unsigned long long)whole_wkv,
          (unsigned long long)whole_loaded);
    for (uint32_t world = 1; ok && world <= 5; world++) {
        engram_context *ctxs[5] = {NULL, NULL, NULL, NULL, NULL};
        uint64_t wkv_sum = 0;
        int mem_ok = 1;
        for (uint32_t r = 0; r < world; r++) {
            ctxs[r] = open_shard(r, world, r, world);
            uint64_t w = 0, loaded = 0;
            if (!ctxs[r] || !held(ctxs[r], &w, &loaded)) {
                mem_ok = 0;
                continue;
            }
            wkv_sum += w;
            /* The loader read only this rank's wkv: it owns what the whole
               one does less the other ranks' wkv (arrays are 16-byte words). */
            long long saved = (long long)whole_loaded - (long long)loaded;
            long long expect = (long long)(whole_wkv - w);
            if (saved < expect - 64 || saved > expect + 64) mem_ok = 0;
        }
        check(mem_ok && wkv_sum == whole_wkv,
              "world %u: each rank's loader owns only its wkv part, and the parts tile wkv", world);
        for (size_t i = 0; i < nh; i++) hw[i] = (float)((int)(i % 13) - 6) * 0.25f;
        int run = mem_ok;
        for (int i = 0; i < 2 && run; i++) run = split_layer(ctxs, world, &g, g_layers[i], ids, hw);
        check(run && memcmp(hw, want, nh * sizeof(float)) == 0,
              "world %u: rows summed, kv joined, gate_from_kv: engram_apply's highway bit for bit", world);
        for (uint32_t r = 0; r < world; r++) engram_free(ctxs[r]);
    }
    free(ids);
    free(want);
    free(hw);
    engram_free(whole);
}

static void bad_specs(void) {
    const uint32_t specs[4][4] = {{0, 0, 0, 1}, {2, 2, 0, 1}, {0, 1, 0, 0}, {0, 1, 3, 3}};
    for (int i = 0; i < 4; i++) {
        const uint32_t *s = specs[i];
        engram_gguf_options o;
        engram_gguf_options_init(&o);
        o.shard_table_rank = s[0];
        o.shard_table_world = s[1];
        o.shard_wkv_rank = s[2];
        o.shard_wkv_world = s[3];
        engram_context *ctx = NULL;
        engram_status st = engram_create_from_gguf(TINY, &o, &ctx);
        check(st == ENGRAM_STATUS_ERR_INVALID_ARGUMENT && ctx == NULL && strstr(engram_last_error(), "shard"),
              "gguf shard (%u of %u, %u of %u) refused: %s", s[0], s[1], s[2], s[3], engram_last_error());
        engram_safetensors_options so;
        engram_safetensors_options_init(&so);
        so.tokenizer_json = DATA "deepseek_v4_tokenizer.json";
        so.shard_table_rank = s[0];
        so.shard_table_world = s[1];
        so.shard_wkv_rank = s[2];
        so.shard_wkv_world = s[3];
        st = engram_create_from_safetensors(DATA "dialects/checkpoint", &so, &ctx);
        check(st == ENGRAM_STATUS_ERR_INVALID_ARGUMENT && ctx == NULL,
              "safetensors shard (%u of %u, %u of %u) refused", s[0], s[1], s[2], s[3]);
    }
    /* A valid checkpoint shard: its wkv part is whole scale blocks. */
    engram_safetensors_options so;
    engram_safetensors_options_init(&so);
    so.tokenizer_json = DATA "deepseek_v4_tokenizer.json";
    so.shard_wkv_rank = 1;
    so.shard_wkv_world = 2;
    engram_context *ctx = NULL;
    uint64_t o0 = 0, o1 = 0, r1 = 0, rows = 0;
    int ok = engram_create_from_safetensors(DATA "dialects/checkpoint", &so, &ctx) == ST;
    ok = ok && engram_shard_held(ctx, 1, NULL, &rows, &o0, &o1) == ST && o0 > 0 && o1 > o0;
    check(ok, "checkpoint wkv shard 1 of 2 holds outputs [%llu, %llu) of every layer", (unsigned long long)o0,
          (unsigned long long)o1);
    /* Widening it again is refused, nothing changes. */
    check(engram_context_set_shard(ctx, 0, 1, 0, 1) == ENGRAM_STATUS_ERR_INVALID_ARGUMENT &&
              engram_shard_held(ctx, 1, NULL, &r1, NULL, NULL) == ST && r1 == rows,
          "a loaded shard cannot be widened by engram_context_set_shard");
    engram_free(ctx);
}

static void old_layout_and_nulls(void) {
    /* A caller's struct that ends before the shard fields: the whole layer,
       whatever lies past its end. */
    unsigned char buf[sizeof(engram_gguf_options) + 16];
    memset(buf, 0xA5, sizeof buf);
    engram_gguf_options *o = (engram_gguf_options *)(void *)buf;
    size_t old = offsetof(engram_gguf_options, shard_table_rank);
    engram_gguf_options_init_sized(o, old);
    engram_context *ctx = NULL;
    uint64_t b = 1, e = 0, o0 = 1, o1 = 0;
    int ok = engram_create_from_gguf(TINY, o, &ctx) == ST &&
             engram_shard_held(ctx, 1, &b, &e, &o0, &o1) == ST && b == 0 && o0 == 0 && e > 0 && o1 > 0;
    check(ok, "an options struct from before the shard fields loads the whole layer");
    uint64_t t = 7, w = 7;
    check(engram_shard_bytes(NULL, 1, &t, &w) == ENGRAM_STATUS_ERR_NULL_ARGUMENT && t == 7 && w == 7,
          "engram_shard_bytes(NULL ctx) is ERR_NULL_ARGUMENT, writes nothing");
    check(engram_context_memory(NULL, &t, &w) == ENGRAM_STATUS_ERR_NULL_ARGUMENT && t == 7,
          "engram_context_memory(NULL ctx) is ERR_NULL_ARGUMENT, writes nothing");
    check(ctx && engram_shard_bytes(ctx, 2, &t, &w) != ST && t == 7 && w == 7,
          "engram_shard_bytes of a layer the model does not have is refused, writes nothing");
    check(ctx && engram_shard_bytes(ctx, 1, NULL, NULL) == ST && engram_context_memory(ctx, NULL, NULL) == ST,
          "engram_shard_bytes and engram_context_memory take NULL out pointers");
    engram_free(ctx);
}

int main(void) {
    worlds();
    bad_specs();
    old_layout_and_nulls();
    return check_summary("test_shard_load");
}
