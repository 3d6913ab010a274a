/*
 * A small valid model for the teardown and stress tests (valid as C11 and
 * C++17): one engram layer (id 5), D = 64, hc = 2, Hd = 32, N = 2, H = 2
 * (C = 2), a bf16 table of 18 rows, f32 wkv, q and k. Its values come in
 * "versions" (the stress test replaces the layer with other values); every
 * value is exact in bf16 or f32.
 */
#ifndef ENGRAM_C_TESTS_MINI_MODEL_H
#define ENGRAM_C_TESTS_MINI_MODEL_H

#include "engram.h"

#include <stdint.h>
#include <string.h>

#define MM_LAYER 5u
#define MM_D 64
#define MM_HC 2
#define MM_HD 32
#define MM_H 2
#define MM_N 2
#define MM_C ((MM_N - 1) * MM_H)
#define MM_ROWS 18
#define MM_VOCAB 16
#define MM_K_IN (MM_C * MM_HD)          /* 64 */
#define MM_K_OUT (MM_D * (MM_HC + 1))   /* 192 */
#define MM_HW (MM_HC * MM_D)            /* highway values per token */
#define MM_TABLE_BYTES (MM_ROWS * MM_HD * 2)
#define MM_WKV_BYTES (MM_K_OUT * MM_K_IN * 4)

static const uint32_t mm_layer_ids[1] = {MM_LAYER};
static const int32_t mm_token_map[MM_VOCAB] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
static const uint64_t mm_multipliers[MM_N] = {UINT64_C(0x1f3a5c7e9b2d4f61), UINT64_C(0x7edcba9876543211)};
static const uint64_t mm_primes[MM_C] = {7, 11};
static const uint64_t mm_offsets[MM_C] = {0, 7};

static inline engram_config mm_config(uint32_t n_threads, uint32_t max_tokens, uint32_t max_seqs) {
    engram_config c;
    engram_config_init(&c);
    c.hidden_size = MM_D;
    c.hc = MM_HC;
    c.head_dim = MM_HD;
    c.n_heads = MM_H;
    c.max_ngram = MM_N;
    c.eps = 1e-6f;
    c.layer_ids = mm_layer_ids;
    c.n_layers = 1;
    c.token_map = mm_token_map;
    c.token_map_len = MM_VOCAB;
    c.pad_id = 0;
    c.multipliers = mm_multipliers;
    c.n_multipliers = MM_N;
    c.primes = mm_primes;
    c.n_primes = MM_C;
    c.offsets = mm_offsets;
    c.n_offsets = MM_C;
    c.max_tokens = max_tokens;
    c.max_seqs = max_seqs;
    c.max_positions = 4096;
    c.n_threads = n_threads;
    return c;
}

/* The bf16 bits of an f32 whose value bf16 holds exactly. */
static inline uint16_t mm_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

/* Version `v` of the table: [MM_ROWS, MM_HD] bf16. */
static inline void mm_fill_table(uint16_t *t, int v) {
    for (int r = 0; r < MM_ROWS; r++)
        for (int i = 0; i < MM_HD; i++)
            t[r * MM_HD + i] = mm_bf16((float)((r * 7 + i * 3 + v * 5) % 15 - 7) / 8.0f);
}

/* Version `v` of wkv: [MM_K_OUT, MM_K_IN] f32. */
static inline void mm_fill_wkv(float *w, int v) {
    for (int o = 0; o < MM_K_OUT; o++)
        for (int i = 0; i < MM_K_IN; i++) w[o * MM_K_IN + i] = (float)((o * 5 + i * 3 + v * 11) % 13 - 6) / 64.0f;
}

/* q and k: [MM_HC, MM_D] f32. */
static inline void mm_fill_qk(float *q, float *k) {
    for (int i = 0; i < MM_HW; i++) {
        q[i] = 1.0f + (float)(i % 5) / 8.0f;
        k[i] = 1.0f - (float)(i % 3) / 8.0f;
    }
}

static inline engram_layer_weights mm_weights(const uint16_t *table, const float *wkv, const float *q,
                                              const float *k) {
    engram_layer_weights w;
    engram_layer_weights_init(&w);
    w.layer_id = MM_LAYER;
    w.table_type = ENGRAM_TYPE_BF16;
    w.table = table;
    w.table_rows = MM_ROWS;
    w.wkv = wkv;
    w.wkv_type = ENGRAM_TYPE_F32;
    w.q = q;
    w.k = k;
    w.qk_type = ENGRAM_TYPE_F32;
    return w;
}

/* A highway for `n` tokens: [n, MM_HC, MM_D] f32. */
static inline void mm_fill_highway(float *hw, int n) {
    for (int i = 0; i < n * MM_HW; i++) hw[i] = (float)(i % 11 - 5) / 4.0f;
}

#endif /* ENGRAM_C_TESTS_MINI_MODEL_H */
