/*
 * The checked calls (issue 34): engram_apply_checked,
 * engram_apply_device_ids_checked and engram_read_back_checked take the
 * length of every buffer and the highway's type and token stride. A correct
 * call gives what the unchecked call gives; every mismatch (row ids of
 * another length, a highway that overflows or is short, a strided highway, a
 * bf16 highway labelled f32 and the reverse, output buffers of the wrong
 * length, an args struct without struct_size) is refused with
 * ERR_INVALID_ARGUMENT (ERR_STRUCT_SIZE, ERR_NULL_ARGUMENT) naming expected
 * and given, and nothing is written. engram_hash_device_checked takes its
 * output's capacity, as engram_hash does.
 */
#include "engram.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "mini_model.h"

#define N 4

static uint16_t g_table[MM_ROWS * MM_HD];
static float g_wkv[MM_K_OUT * MM_K_IN], g_q[MM_HW], g_k[MM_HW];

/* The last error holds both numbers. */
static int names(size_t expected, size_t given) {
    char e[64], g[64];
    snprintf(e, sizeof e, "expected %zu", expected);
    snprintf(g, sizeof g, "is %zu", given);
    const char *m = engram_last_error();
    return strstr(m, e) != NULL && strstr(m, g) != NULL;
}

int main(void) {
    engram_config cfg = mm_config(1, 16, 2);
    engram_context *ctx = NULL;
    if (!check(engram_create(&cfg, &ctx) == ENGRAM_STATUS_OK, "create the mini model")) return 1;
    mm_fill_table(g_table, 0);
    mm_fill_wkv(g_wkv, 0);
    mm_fill_qk(g_q, g_k);
    engram_layer_weights w = mm_weights(g_table, g_wkv, g_q, g_k);
    check(engram_set_layer(ctx, &w) == ENGRAM_STATUS_OK, "set the layer");

    int32_t tok[N] = {1, 2, 3, 4}, seq[N] = {0, 0, 0, 0}, pos[N] = {0, 1, 2, 3};
    int64_t ids[N * MM_C];
    check(engram_hash(ctx, tok, seq, pos, N, ids, N * MM_C) == ENGRAM_STATUS_OK, "hash");

    /* The unchecked result, and the checked call's. */
    float want[N * MM_HW], hw[N * MM_HW + 8], before[N * MM_HW + 8];
    mm_fill_highway(want, N);
    check(engram_apply(ctx, MM_LAYER, ids, N, want, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_OK, "unchecked apply");
    engram_apply_args a;
    engram_apply_args_init(&a);
    check(a.struct_size == sizeof a && a.row_ids == NULL && a.highway_bytes == 0, "engram_apply_args_init");
    a.layer_id = MM_LAYER;
    a.n_tokens = N;
    a.row_ids = ids;
    a.row_ids_len = N * MM_C;
    a.highway = hw;
    a.highway_type = ENGRAM_TYPE_F32;
    a.highway_token_stride = MM_HW * sizeof(float);
    a.highway_bytes = N * MM_HW * sizeof(float);
    mm_fill_highway(hw, N);
    int st = (int)engram_apply_checked(ctx, &a);
    check(st == ENGRAM_STATUS_OK && memcmp(hw, want, sizeof want) == 0,
          "apply_checked with every length right: OK, the unchecked call's result (got %d: %s)", st,
          engram_last_error());

    /* Each mismatch: refused, naming expected and given, highway untouched. */
    struct {
        const char *what;
        size_t row_ids_len, stride, bytes;
        uint32_t type;
        size_t expected, given;
    } bad[] = {
        {"row_ids_len one short", N * MM_C - 1, MM_HW * 4, N * MM_HW * 4, ENGRAM_TYPE_F32, N * MM_C, N * MM_C - 1},
        {"row_ids_len one long", N * MM_C + 1, MM_HW * 4, N * MM_HW * 4, ENGRAM_TYPE_F32, N * MM_C, N * MM_C + 1},
        {"highway_bytes overflowing (one more token)", N * MM_C, MM_HW * 4, (N + 1) * MM_HW * 4, ENGRAM_TYPE_F32,
         N * MM_HW * 4, (N + 1) * MM_HW * 4},
        {"highway_bytes short by one float", N * MM_C, MM_HW * 4, N * MM_HW * 4 - 4, ENGRAM_TYPE_F32, N * MM_HW * 4,
         N * MM_HW * 4 - 4},
        {"a strided highway (one float of padding per token)", N * MM_C, MM_HW * 4 + 4, N * (MM_HW * 4 + 4),
         ENGRAM_TYPE_F32, MM_HW * 4, MM_HW * 4 + 4},
        {"token stride 0", N * MM_C, 0, N * MM_HW * 4, ENGRAM_TYPE_F32, MM_HW * 4, 0},
        {"a bf16 highway labelled f32", N * MM_C, MM_HW * 2, N * MM_HW * 2, ENGRAM_TYPE_F32, MM_HW * 4, MM_HW * 2},
        {"an f32 highway labelled bf16", N * MM_C, MM_HW * 4, N * MM_HW * 4, ENGRAM_TYPE_BF16, MM_HW * 2, MM_HW * 4},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        engram_apply_args b = a;
        b.row_ids_len = bad[i].row_ids_len;
        b.highway_token_stride = bad[i].stride;
        b.highway_bytes = bad[i].bytes;
        b.highway_type = bad[i].type;
        mm_fill_highway(hw, N);
        memcpy(before, hw, sizeof hw);
        st = (int)engram_apply_checked(ctx, &b);
        check(st == ENGRAM_STATUS_ERR_INVALID_ARGUMENT && names(bad[i].expected, bad[i].given) &&
                  memcmp(hw, before, sizeof hw) == 0,
              "apply_checked, %s: ERR_INVALID_ARGUMENT naming expected %zu and given %zu, highway untouched "
              "(got %d: %s)",
              bad[i].what, bad[i].expected, bad[i].given, st, engram_last_error());
        st = (int)engram_apply_device_ids_checked(ctx, &b);
        check(st == ENGRAM_STATUS_ERR_INVALID_ARGUMENT && names(bad[i].expected, bad[i].given),
              "apply_device_ids_checked, %s: ERR_INVALID_ARGUMENT before anything else (got %d: %s)", bad[i].what,
              st, engram_last_error());
    }
    {
        engram_apply_args b = a;
        b.highway_type = 7; /* not a highway type */
        st = (int)engram_apply_checked(ctx, &b);
        check(st == ENGRAM_STATUS_ERR_UNSUPPORTED, "apply_checked with a non-highway type: ERR_UNSUPPORTED (got %d)",
              st);
        b = a;
        b.struct_size = 0;
        st = (int)engram_apply_checked(ctx, &b);
        check(st == ENGRAM_STATUS_ERR_STRUCT_SIZE, "apply_checked, struct_size 0: ERR_STRUCT_SIZE (got %d)", st);
        st = (int)engram_apply_checked(ctx, NULL);
        check(st == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "apply_checked(NULL args): ERR_NULL_ARGUMENT (got %d)", st);
        st = (int)engram_apply_checked(NULL, &a);
        check(st == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "apply_checked(NULL ctx): ERR_NULL_ARGUMENT (got %d)", st);
        st = (int)engram_apply_device_ids_checked(ctx, &a);
        check(st == ENGRAM_STATUS_ERR_UNSUPPORTED,
              "apply_device_ids_checked with every length right on the CPU: ERR_UNSUPPORTED (got %d)", st);
    }

    /* The device hash with its output's capacity (CPU context: the capacity
       is checked first, then the backend refuses). */
    {
        char want_msg[96];
        snprintf(want_msg, sizeof want_msg, "row_ids_cap is %d, expected at least %d", N * MM_C - 1, N * MM_C);
        st = (int)engram_hash_device_checked(ctx, tok, seq, pos, N, ids, N * MM_C - 1, NULL);
        check(st == ENGRAM_STATUS_ERR_INVALID_ARGUMENT && strstr(engram_last_error(), want_msg) != NULL,
              "hash_device_checked, row_ids_cap one short: ERR_INVALID_ARGUMENT naming both (got %d: %s)", st,
              engram_last_error());
        st = (int)engram_hash_device_checked(ctx, tok, seq, pos, N, ids, N * MM_C, NULL);
        check(st == ENGRAM_STATUS_ERR_UNSUPPORTED,
              "hash_device_checked with the capacity right on a CPU context: ERR_UNSUPPORTED (got %d)", st);
        st = (int)engram_hash_device_checked(NULL, tok, seq, pos, N, ids, N * MM_C, NULL);
        check(st == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "hash_device_checked(NULL ctx): ERR_NULL_ARGUMENT (got %d)", st);
    }

    /* read back */
    uint16_t rows_want[N * MM_K_IN], kv_want[N * MM_K_OUT], rows[N * MM_K_IN + 4], kv[N * MM_K_OUT + 4];
    check(engram_read_back(ctx, MM_LAYER, ids, N, rows_want, N * MM_K_IN, kv_want, N * MM_K_OUT) ==
              ENGRAM_STATUS_OK,
          "unchecked read_back");
    engram_read_back_args r;
    engram_read_back_args_init(&r);
    check(r.struct_size == sizeof r && r.rows == NULL, "engram_read_back_args_init");
    r.layer_id = MM_LAYER;
    r.n_tokens = N;
    r.row_ids = ids;
    r.row_ids_len = N * MM_C;
    r.rows = rows;
    r.rows_len = N * MM_K_IN;
    r.kv = kv;
    r.kv_len = N * MM_K_OUT;
    memset(rows, 0, sizeof rows);
    memset(kv, 0, sizeof kv);
    st = (int)engram_read_back_checked(ctx, &r);
    check(st == ENGRAM_STATUS_OK && memcmp(rows, rows_want, sizeof rows_want) == 0 &&
              memcmp(kv, kv_want, sizeof kv_want) == 0,
          "read_back_checked with every length right: the unchecked call's rows and kv (got %d: %s)", st,
          engram_last_error());
    struct {
        const char *what;
        size_t row_ids_len, rows_len, kv_len, expected, given;
    } rb[] = {
        {"row_ids_len one short", N * MM_C - 1, N * MM_K_IN, N * MM_K_OUT, N * MM_C, N * MM_C - 1},
        {"rows_len one short", N * MM_C, N * MM_K_IN - 1, N * MM_K_OUT, N * MM_K_IN, N * MM_K_IN - 1},
        {"rows_len longer", N * MM_C, N * MM_K_IN + 4, N * MM_K_OUT, N * MM_K_IN, N * MM_K_IN + 4},
        {"kv_len one short", N * MM_C, N * MM_K_IN, N * MM_K_OUT - 1, N * MM_K_OUT, N * MM_K_OUT - 1},
        {"kv_len longer", N * MM_C, N * MM_K_IN, N * MM_K_OUT + 4, N * MM_K_OUT, N * MM_K_OUT + 4},
    };
    for (size_t i = 0; i < sizeof rb / sizeof rb[0]; i++) {
        engram_read_back_args b = r;
        b.row_ids_len = rb[i].row_ids_len;
        b.rows_len = rb[i].rows_len;
        b.kv_len = rb[i].kv_len;
        memset(rows, 0xAB, sizeof rows);
        memset(kv, 0xAB, sizeof kv);
        st = (int)engram_read_back_checked(ctx, &b);
        int untouched = 1;
        for (size_t j = 0; j < sizeof rows / sizeof rows[0]; j++) untouched &= rows[j] == 0xABAB;
        for (size_t j = 0; j < sizeof kv / sizeof kv[0]; j++) untouched &= kv[j] == 0xABAB;
        check(st == ENGRAM_STATUS_ERR_INVALID_ARGUMENT && names(rb[i].expected, rb[i].given) && untouched,
              "read_back_checked, %s: ERR_INVALID_ARGUMENT naming expected %zu and given %zu, nothing written "
              "(got %d: %s)",
              rb[i].what, rb[i].expected, rb[i].given, st, engram_last_error());
    }
    st = (int)engram_read_back_checked(ctx, NULL);
    check(st == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "read_back_checked(NULL args): ERR_NULL_ARGUMENT (got %d)", st);

    engram_free(ctx);
    return check_summary("test_checked");
}
