/*
 * The split points and shard contexts (docs/sharding.md) on the mini model:
 * every layout (table row ranges summed in rank order, heads reassembled,
 * wkv output ranges concatenated) at world sizes 1..5 gives engram_apply's
 * highway bit for bit, and every bad input is a status that writes nothing:
 * NULL pointers, bad and empty ranges, ranges outside the table or outside
 * what a shard holds, mismatched lengths and types, whole-layer calls on a
 * shard context.
 */
#include "check.h"
#include "mini_model.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define NT 6
#define ST ENGRAM_STATUS_OK

static uint16_t g_table[MM_ROWS * MM_HD];
static float g_wkv[MM_K_OUT * MM_K_IN];
static float g_q[MM_HW], g_k[MM_HW];
static int64_t g_ids[NT * MM_C];
static float g_hw_ref[NT * MM_HW];
static uint16_t g_rows_ref[NT * MM_K_IN];
static uint16_t g_kv_ref[NT * MM_K_OUT];

/* A context with the mini model's layer set, sharded as given. */
static engram_context *make(uint32_t tr, uint32_t tw, uint32_t wr, uint32_t ww) {
    engram_config c = mm_config(1, 64, 4);
    engram_context *ctx = NULL;
    if (engram_create(&c, &ctx) != ST) return NULL;
    engram_layer_weights w = mm_weights(g_table, g_wkv, g_q, g_k);
    if (engram_set_layer(ctx, &w) != ST || engram_context_set_shard(ctx, tr, tw, wr, ww) != ST) {
        engram_free(ctx);
        return NULL;
    }
    return ctx;
}

static int is_neg_zero(float f) { return f == 0.0f && signbit(f); }

/* The reference: engram_apply's highway, engram_read_back's rows and kv. */
static int reference(void) {
    engram_context *ctx = make(0, 1, 0, 1);
    if (!ctx) return 0;
    const int32_t tok[NT] = {3, 7, ENGRAM_TOKEN_DEAD, 11, 2, 9};
    const int32_t seq[NT] = {0, 0, 0, 0, 1, 1};
    const int32_t pos[NT] = {0, 1, 2, 3, 0, 1};
    int ok = engram_hash(ctx, tok, seq, pos, NT, g_ids, NT * MM_C) == ST;
    mm_fill_highway(g_hw_ref, NT);
    ok = ok && engram_apply(ctx, MM_LAYER, g_ids, NT, g_hw_ref, ENGRAM_TYPE_F32, NULL) == ST;
    ok = ok && engram_read_back(ctx, MM_LAYER, g_ids, NT, g_rows_ref, NT * MM_K_IN, g_kv_ref, NT * MM_K_OUT) == ST;
    engram_free(ctx);
    return ok;
}

/* Rows summed over the ranks of `world` (row ranges), in rank order; then
 * engram_apply_rows on the last rank's context. */
static void rows_layout(uint32_t world) {
    float sum[NT * MM_K_IN], part[NT * MM_K_IN];
    float hw[NT * MM_HW];
    int ok = 1;
    engram_context *last = NULL;
    for (uint32_t r = 0; r < world && ok; r++) {
        engram_context *ctx = make(r, world, 0, 1);
        uint64_t b = 0, e = 0;
        ok = ctx && engram_shard_held(ctx, MM_LAYER, &b, &e, NULL, NULL) == ST;
        ok = ok && engram_gather_rows(ctx, MM_LAYER, NT, g_ids, NT * MM_C, b, e, 0, MM_H, part,
                                      NT * MM_K_IN, ENGRAM_TYPE_F32, NULL) == ST;
        for (int i = 0; ok && i < NT * MM_K_IN; i++) sum[i] = r == 0 ? part[i] : sum[i] + part[i];
        if (last) engram_free(last);
        last = ctx;
    }
    /* The summed rows are read_back's rows (bf16 widened), -0 for the dead token. */
    int same_rows = ok;
    for (int t = 0; ok && t < NT; t++)
        for (int i = 0; i < MM_K_IN; i++) {
            float s = sum[t * MM_K_IN + i];
            uint32_t u;
            memcpy(&u, &s, 4);
            if (t == 2 ? !is_neg_zero(s) : (u >> 16) != g_rows_ref[t * MM_K_IN + i] || (u & 0xFFFF))
                same_rows = 0;
        }
    check(same_rows, "world %u: the row ranges' gathers sum to read_back's rows (dead token -0)", world);
    mm_fill_highway(hw, NT);
    ok = ok && engram_apply_rows(last, MM_LAYER, NT, g_ids, NT * MM_C, sum, NT * MM_K_IN, ENGRAM_TYPE_F32,
                                 hw, sizeof hw, ENGRAM_TYPE_F32, NULL) == ST;
    check(ok && memcmp(hw, g_hw_ref, sizeof hw) == 0,
          "world %u: row ranges + sum + engram_apply_rows == engram_apply, bit for bit", world);
    engram_free(last);
}

/* kv over the ranks' output ranges, concatenated; then engram_gate_from_kv. */
static void wkv_layout(uint32_t world) {
    uint16_t kv[NT * MM_K_OUT];
    float hw[NT * MM_HW];
    int ok = 1;
    engram_context *ctx = NULL;
    for (uint32_t r = 0; r < world && ok; r++) {
        if (ctx) engram_free(ctx);
        ctx = make(0, 1, r, world);
        uint64_t b = 0, e = 0;
        ok = ctx && engram_shard_held(ctx, MM_LAYER, NULL, NULL, &b, &e) == ST && b < e;
        uint16_t part[NT * MM_K_OUT];
        size_t w = (size_t)(e - b);
        ok = ok && engram_kv_columns(ctx, MM_LAYER, NT, g_rows_ref, NT * MM_K_IN, ENGRAM_TYPE_BF16, b, e, part,
                                     NT * w, ENGRAM_TYPE_BF16, NULL) == ST;
        for (int t = 0; ok && t < NT; t++) memcpy(&kv[t * MM_K_OUT + b], &part[t * w], w * 2);
    }
    int same_kv = ok;
    for (int t = 0; ok && t < NT; t++)
        if (t != 2 && memcmp(&kv[t * MM_K_OUT], &g_kv_ref[t * MM_K_OUT], MM_K_OUT * 2) != 0) same_kv = 0;
    check(same_kv, "world %u: the output ranges' kv, joined, is read_back's kv", world);
    mm_fill_highway(hw, NT);
    ok = ok && engram_gate_from_kv(ctx, MM_LAYER, NT, g_ids, NT * MM_C, kv, NT * MM_K_OUT, ENGRAM_TYPE_BF16, hw,
                                   sizeof hw, ENGRAM_TYPE_F32, NULL) == ST;
    check(ok && memcmp(hw, g_hw_ref, sizeof hw) == 0,
          "world %u: output ranges + join + engram_gate_from_kv == engram_apply, bit for bit", world);
    engram_free(ctx);
}

/* One head a rank, compacted, reassembled in column order. */
static void heads_layout(void) {
    engram_context *ctx = make(0, 1, 0, 1);
    uint16_t rows[NT * MM_K_IN], part[NT * (MM_N - 1) * MM_HD];
    int ok = ctx != NULL;
    for (uint32_t h = 0; ok && h < MM_H; h++) {
        ok = engram_gather_rows(ctx, MM_LAYER, NT, g_ids, NT * MM_C, 0, MM_ROWS, h, h + 1, part,
                                NT * (MM_N - 1) * MM_HD, ENGRAM_TYPE_BF16, NULL) == ST;
        for (int t = 0; ok && t < NT; t++)
            for (int k = 0; k < MM_N - 1; k++)
                memcpy(&rows[(t * MM_C + k * MM_H + h) * MM_HD], &part[(t * (MM_N - 1) + k) * MM_HD], MM_HD * 2);
    }
    float hw[NT * MM_HW];
    mm_fill_highway(hw, NT);
    ok = ok && engram_apply_rows(ctx, MM_LAYER, NT, g_ids, NT * MM_C, rows, NT * MM_K_IN, ENGRAM_TYPE_BF16, hw,
                                 sizeof hw, ENGRAM_TYPE_F32, NULL) == ST;
    check(ok && memcmp(hw, g_hw_ref, sizeof hw) == 0,
          "heads: one head a rank, compacted, reassembled, engram_apply_rows == engram_apply");
    /* A bf16 highway: engram_apply_rows == engram_apply too. */
    uint16_t a[NT * MM_HW], b[NT * MM_HW];
    for (int i = 0; i < NT * MM_HW; i++) a[i] = b[i] = mm_bf16((float)(i % 7 - 3) / 2.0f);
    ok = ok && engram_apply(ctx, MM_LAYER, g_ids, NT, a, ENGRAM_TYPE_BF16, NULL) == ST;
    ok = ok && engram_apply_rows(ctx, MM_LAYER, NT, g_ids, NT * MM_C, rows, NT * MM_K_IN, ENGRAM_TYPE_BF16, b,
                                 sizeof b, ENGRAM_TYPE_BF16, NULL) == ST;
    check(ok && memcmp(a, b, sizeof a) == 0, "bf16 highway: engram_apply_rows == engram_apply");
    engram_free(ctx);
}

#define EXPECT(call, st, what)                                                                   \
    do {                                                                                         \
        engram_status s_ = (call);                                                               \
        check(s_ == (st), "%s -> %s", what, engram_status_str(s_));                              \
        if (s_ != (st)) note("expected %s; last error: %s", engram_status_str(st), engram_last_error()); \
    } while (0)

static void bad_input(void) {
    engram_context *ctx = make(0, 1, 0, 1);
    engram_context *sh = make(1, 3, 0, 1);
    engram_context *ws = make(0, 1, 1, 2);
    float out[NT * MM_K_IN], hw[NT * MM_HW];
    uint16_t kv[NT * MM_K_OUT];
    const size_t on = NT * MM_K_IN, ni = NT * MM_C;
    for (size_t i = 0; i < on; i++) out[i] = 42.0f;
    mm_fill_highway(hw, NT);
    const uint32_t F = ENGRAM_TYPE_F32, B = ENGRAM_TYPE_BF16;
    EXPECT(engram_gather_rows(NULL, MM_LAYER, NT, g_ids, ni, 0, MM_ROWS, 0, MM_H, out, on, F, NULL),
           ENGRAM_STATUS_ERR_NULL_ARGUMENT, "gather_rows: NULL ctx");
    EXPECT(engram_gather_rows(ctx, MM_LAYER, NT, NULL, ni, 0, MM_ROWS, 0, MM_H, out, on, F, NULL),
           ENGRAM_STATUS_ERR_NULL_ARGUMENT, "gather_rows: NULL row_ids");
    EXPECT(engram_gather_rows(ctx, MM_LAYER, NT, g_ids, ni, 0, MM_ROWS, 0, MM_H, NULL, on, F, NULL),
           ENGRAM_STATUS_ERR_NULL_ARGUMENT, "gather_rows: NULL out");
    EXPECT(engram_gather_rows(ctx, MM_LAYER, NT, g_ids, ni - 1, 0, MM_ROWS, 0, MM_H, out, on, F, NULL),
           ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "gather_rows: row_ids_len for another token count");
    EXPECT(engram_gather_rows(ctx, MM_LAYER, NT, g_ids, ni, 0, MM_ROWS, 0, MM_H, out, on - 1, F, NULL),
           ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "gather_rows: out_len one short");
    EXPECT(engram_gather_rows(ctx, MM_LAYER, NT, g_ids, ni, 0, MM_ROWS, 0, MM_H, out, on, 99, NULL),
           ENGRAM_STATUS_ERR_UNSUPPORTED, "gather_rows: out_type 99");
    EXPECT(engram_gather_rows(ctx, MM_LAYER, NT, g_ids, ni, 5, 5, 0, MM_H, out, on, F, NULL),
           ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "gather_rows: empty row range");
    EXPECT(engram_gather_rows(ctx, MM_LAYER, NT, g_ids, ni, 9, 4, 0, MM_H, out, on, F, NULL),
           ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "gather_rows: reversed row range");
    EXPECT(engram_gather_rows(ctx, MM_LAYER, NT, g_ids, ni, 0, MM_ROWS + 1, 0, MM_H, out, on, F, NULL),
           ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "gather_rows: row range past the table");
    EXPECT(engram_gather_rows(ctx, MM_LAYER, NT, g_ids, ni, 0, MM_ROWS, 1, 1, out, on, F, NULL),
           ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "gather_rows: empty head range");
    EXPECT(engram_gather_rows(ctx, MM_LAYER, NT, g_ids, ni, 0, MM_ROWS, 0, MM_H + 1, out, on, F, NULL),
           ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "gather_rows: head range past H");
    EXPECT(engram_gather_rows(ctx, 77, NT, g_ids, ni, 0, MM_ROWS, 0, MM_H, out, on, F, NULL),
           ENGRAM_STATUS_ERR_UNKNOWN_LAYER, "gather_rows: unknown layer");
    /* Rank 1 of 3 holds rows [6, 12). */
    EXPECT(engram_gather_rows(sh, MM_LAYER, NT, g_ids, ni, 0, MM_ROWS, 0, MM_H, out, on, F, NULL),
           ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "gather_rows: a shard asked for rows it does not hold");
    EXPECT(engram_gather_rows(sh, MM_LAYER, NT, g_ids, ni, 6, 13, 0, MM_H, out, on, F, NULL),
           ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "gather_rows: a shard asked for one row past its part");
    int64_t bad[NT * MM_C];
    memcpy(bad, g_ids, sizeof bad);
    bad[1] = MM_ROWS;
    EXPECT(engram_gather_rows(ctx, MM_LAYER, NT, bad, ni, 0, MM_ROWS, 0, MM_H, out, on, F, NULL),
           ENGRAM_STATUS_ERR_INVALID_ROW_ID, "gather_rows: a row id past the table");
    int untouched = 1;
    for (size_t i = 0; i < on; i++) untouched &= out[i] == 42.0f;
    check(untouched, "gather_rows: nothing written on any error");

    uint64_t b = 1, e = 1;
    EXPECT(engram_shard_held(sh, MM_LAYER, &b, &e, NULL, NULL), ST, "shard_held");
    check(b == 6 && e == 12, "rank 1 of 3 holds rows [6, 12) of 18 (got [%llu, %llu))", (unsigned long long)b,
          (unsigned long long)e);
    EXPECT(engram_shard_held(sh, 77, &b, &e, NULL, NULL), ENGRAM_STATUS_ERR_UNKNOWN_LAYER, "shard_held: unknown layer");
    EXPECT(engram_shard_held(NULL, MM_LAYER, &b, &e, NULL, NULL), ENGRAM_STATUS_ERR_NULL_ARGUMENT, "shard_held: NULL ctx");
    EXPECT(engram_context_set_shard(ctx, 0, 0, 0, 1), ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "set_shard: world 0");
    EXPECT(engram_context_set_shard(ctx, 3, 3, 0, 1), ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "set_shard: rank = world");
    EXPECT(engram_context_set_shard(ctx, 0, 1, 2, 1), ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "set_shard: wkv rank past world");
    EXPECT(engram_context_set_shard(NULL, 0, 1, 0, 1), ENGRAM_STATUS_ERR_NULL_ARGUMENT, "set_shard: NULL ctx");

    /* Whole-layer calls on shard contexts. */
    EXPECT(engram_apply(sh, MM_LAYER, g_ids, NT, hw, F, NULL), ENGRAM_STATUS_ERR_INVALID_ARGUMENT,
           "apply on a row shard");
    EXPECT(engram_prefetch(ws, MM_LAYER, g_ids, NT), ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "prefetch on a wkv shard");
    EXPECT(engram_apply_rows(ws, MM_LAYER, NT, g_ids, ni, out, on, F, hw, sizeof hw, F, NULL),
           ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "apply_rows on a wkv shard");

    /* kv_columns. Rank 1 of 2 holds outputs [96, 192). */
    EXPECT(engram_kv_columns(ws, MM_LAYER, NT, g_rows_ref, on, B, 0, 96, kv, NT * 96, B, NULL),
           ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "kv_columns: outputs the shard does not hold");
    EXPECT(engram_kv_columns(ctx, MM_LAYER, NT, g_rows_ref, on, B, 10, 10, kv, 0, B, NULL),
           ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "kv_columns: empty output range");
    EXPECT(engram_kv_columns(ctx, MM_LAYER, NT, g_rows_ref, on, B, 0, MM_K_OUT + 1, kv, NT * (MM_K_OUT + 1), B, NULL),
           ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "kv_columns: output range past D*(hc+1)");
    EXPECT(engram_kv_columns(ctx, MM_LAYER, NT, g_rows_ref, on - 1, B, 0, 96, kv, NT * 96, B, NULL),
           ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "kv_columns: rows_len one short");
    EXPECT(engram_kv_columns(ctx, MM_LAYER, NT, g_rows_ref, on, B, 0, 96, kv, NT * 96 + 1, B, NULL),
           ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "kv_columns: kv_len one long");
    EXPECT(engram_kv_columns(ctx, MM_LAYER, NT, NULL, on, B, 0, 96, kv, NT * 96, B, NULL), ENGRAM_STATUS_ERR_NULL_ARGUMENT,
           "kv_columns: NULL rows");

    /* gate_from_kv and apply_rows: lengths and types. */
    float before[NT * MM_HW];
    memcpy(before, hw, sizeof hw);
    EXPECT(engram_gate_from_kv(ctx, MM_LAYER, NT, g_ids, ni, g_kv_ref, NT * MM_K_OUT, B, hw, sizeof hw - 4, F, NULL),
           ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "gate_from_kv: highway_bytes one value short");
    EXPECT(engram_gate_from_kv(ctx, MM_LAYER, NT, g_ids, ni, g_kv_ref, NT * MM_K_OUT - 1, B, hw, sizeof hw, F, NULL),
           ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "gate_from_kv: kv_len one short");
    EXPECT(engram_gate_from_kv(ctx, MM_LAYER, NT, g_ids, ni, g_kv_ref, NT * MM_K_OUT, 99, hw, sizeof hw, F, NULL),
           ENGRAM_STATUS_ERR_UNSUPPORTED, "gate_from_kv: kv_type 99");
    EXPECT(engram_gate_from_kv(ctx, MM_LAYER, NT, g_ids, ni, g_kv_ref, NT * MM_K_OUT, B, NULL, sizeof hw, F, NULL),
           ENGRAM_STATUS_ERR_NULL_ARGUMENT, "gate_from_kv: NULL highway");
    EXPECT(engram_gate_from_kv(ctx, MM_LAYER, NT, bad, ni, g_kv_ref, NT * MM_K_OUT, B, hw, sizeof hw, F, NULL),
           ENGRAM_STATUS_ERR_INVALID_ROW_ID, "gate_from_kv: a row id past the table");
    EXPECT(engram_apply_rows(ctx, MM_LAYER, NT, g_ids, ni, g_rows_ref, on, B, hw, sizeof hw, ENGRAM_TYPE_Q8_0, NULL),
           ENGRAM_STATUS_ERR_UNSUPPORTED, "apply_rows: highway type q8_0");
    EXPECT(engram_apply_rows(ctx, MM_LAYER, NT, g_ids, ni, g_rows_ref, on + 1, B, hw, sizeof hw, F, NULL),
           ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "apply_rows: rows_len one long");
    check(memcmp(before, hw, sizeof hw) == 0, "gate_from_kv / apply_rows: highway unchanged on every error");

    /* A context whose layer was never set. */
    engram_config c = mm_config(1, 64, 4);
    engram_context *empty = NULL;
    if (engram_create(&c, &empty) == ST) {
        EXPECT(engram_gather_rows(empty, MM_LAYER, NT, g_ids, ni, 0, MM_ROWS, 0, MM_H, out, on, F, NULL),
               ENGRAM_STATUS_ERR_NO_WEIGHTS, "gather_rows: weights never set");
        EXPECT(engram_shard_held(empty, MM_LAYER, &b, &e, NULL, NULL), ENGRAM_STATUS_ERR_NO_WEIGHTS,
               "shard_held: weights never set");
        engram_free(empty);
    }
    engram_free(ctx);
    engram_free(sh);
    engram_free(ws);
}

int main(void) {
    mm_fill_table(g_table, 0);
    mm_fill_wkv(g_wkv, 0);
    mm_fill_qk(g_q, g_k);
    if (!check(reference(), "the reference apply and read_back")) return check_summary("test_split");
    for (uint32_t w = 1; w <= 5; w++) {
        rows_layout(w);
        wkv_layout(w);
    }
    heads_layout();
    bad_input();
    return check_summary("test_split");
}
