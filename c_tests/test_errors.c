/*
 * Every bad-input path of every exported function: the right status, a
 * non-empty engram_last_error() message that this call set (the message is
 * first set to a "canary" by another failing call, and must have changed), and
 * nothing observable changed:
 *   - engram_create: *out left as it was;
 *   - engram_hash: the output buffer untouched (sentinel-filled), and the
 *     history untouched: a following valid "probe" batch gives the same ids as
 *     on a context that never saw the bad call, and a position the bad batch
 *     would have created is still missing;
 *   - engram_set_layer: a layer that was set still gives the same apply output,
 *     a layer that was not set still gives ENGRAM_STATUS_ERR_NO_WEIGHTS;
 *   - engram_apply: the highway bytes untouched, and the context still gives
 *     the reference output;
 *   - engram_seq_copy / engram_seq_drop: the history untouched (probe);
 * plus the happy paths of seq_copy / seq_drop, NULL-tolerant functions, and
 * engram_status_str for every status and unknown values.
 *
 * Small handmade configuration (it need not match the golden): D = 8, hc = 2,
 * Hd = 32, H = 2, N = 3 (C = 4), layers 10 (bf16 table, f32 wkv/q/k) and
 * 20 (fp8 table, bf16 wkv/q/k).
 */
/* setenv, unsetenv (ENGRAM_CPU_KERNEL) under -std=c11. */
#define _POSIX_C_SOURCE 200112L
#include "engram.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "filler.h"

/* ------------------------------------------------------------------------ */
/* The small model                                                            */

#define E_D 8u
#define E_HC 2u
#define E_HD 32u
#define E_H 2u
#define E_N 3u
#define E_C ((E_N - 1) * E_H)
#define E_LAYERS 2u
#define E_PER (E_LAYERS * E_C)          /* row ids per token: 8 */
#define E_KV_IN (E_C * E_HD)            /* 128 */
#define E_KV_OUT (E_D * (E_HC + 1))     /* 24 */
#define E_HW (E_HC * E_D)               /* highway values per token: 16 */
#define E_VOCAB 16u
#define E_MAX_TOKENS 8u
#define E_MAX_SEQS 3u
#define E_MAX_POS 32u
#define L_A 10u /* bf16 table, f32 weights */
#define L_B 20u /* fp8 table, bf16 weights */
#define ROWS_A 60u  /* sum of layer A's primes: 11+13+17+19 */
#define ROWS_B 120u /* 23+29+31+37 */
#define FP8_ROW_BYTES (E_HD + E_HD / 32u)

static const uint32_t g_layer_ids[E_LAYERS] = {L_A, L_B};
static int32_t g_token_map[E_VOCAB];
static const uint64_t g_multipliers[E_LAYERS * E_N] = {
    UINT64_C(0x1f3a5c7e9b2d4f61), UINT64_C(0x0123456789abcdef), UINT64_C(0x7edcba9876543211),
    UINT64_C(0x2468ace013579bdf), UINT64_C(0x5555555555555555), UINT64_C(0xfedcba9876543211) /* negative as i64 */,
};
static const uint64_t g_primes[E_LAYERS * E_C] = {11, 13, 17, 19, 23, 29, 31, 37};
static const uint64_t g_offsets[E_LAYERS * E_C] = {0, 11, 24, 41, 0, 23, 52, 83};

/* Layer weights. */
static uint16_t *g_table_a;     /* bf16 [ROWS_A, Hd] */
static uint8_t *g_table_b;      /* fp8 [ROWS_B, Hd + Hd/32] */
static float *g_wkv_a, *g_q_a, *g_k_a;
static uint16_t *g_wkv_b, *g_q_b, *g_k_b;
static float *g_wkv_a2; /* other values, to test replacing a layer */

static void init_model(void) {
    for (uint32_t i = 0; i < E_VOCAB; i++) g_token_map[i] = (int32_t)((i * 5u + 1u) % 13u);
    g_token_map[3] = -1;
    g_token_map[9] = -1;
    g_table_a = build_table_bf16("err.table_a", ROWS_A, E_HD);
    g_table_b = build_table_fp8("err.table_b", ROWS_B, E_HD);
    g_wkv_a = (float *)build_values("err.wkv_a", E_KV_OUT * E_KV_IN, 0.0625, 0.0, 0);
    g_q_a = (float *)build_values("err.q_a", E_HC * E_D, 0.125, 1.0, 0);
    g_k_a = (float *)build_values("err.k_a", E_HC * E_D, 0.125, 1.0, 0);
    g_wkv_b = (uint16_t *)build_values("err.wkv_b", E_KV_OUT * E_KV_IN, 0.0625, 0.0, 1);
    g_q_b = (uint16_t *)build_values("err.q_b", E_HC * E_D, 0.125, 1.0, 1);
    g_k_b = (uint16_t *)build_values("err.k_b", E_HC * E_D, 0.125, 1.0, 1);
    g_wkv_a2 = (float *)build_values("err.wkv_a2", E_KV_OUT * E_KV_IN, 0.0625, 0.0, 0);
}

static void free_model(void) {
    free(g_table_a);
    free(g_table_b);
    free(g_wkv_a);
    free(g_q_a);
    free(g_k_a);
    free(g_wkv_b);
    free(g_q_b);
    free(g_k_b);
    free(g_wkv_a2);
}

static engram_config base_config(void) {
    engram_config c;
    engram_config_init(&c);
    c.backend = ENGRAM_BACKEND_CPU;
    c.hidden_size = E_D;
    c.hc = E_HC;
    c.head_dim = E_HD;
    c.n_heads = E_H;
    c.max_ngram = E_N;
    c.eps = 1e-6f;
    c.layer_ids = g_layer_ids;
    c.n_layers = E_LAYERS;
    c.token_map = g_token_map;
    c.token_map_len = E_VOCAB;
    c.pad_id = 0;
    c.multipliers = g_multipliers;
    c.n_multipliers = E_LAYERS * E_N;
    c.primes = g_primes;
    c.n_primes = E_LAYERS * E_C;
    c.offsets = g_offsets;
    c.n_offsets = E_LAYERS * E_C;
    c.max_tokens = E_MAX_TOKENS;
    c.max_seqs = E_MAX_SEQS;
    c.max_positions = E_MAX_POS;
    c.n_threads = 1;
    return c;
}

static engram_layer_weights weights_a(void) {
    engram_layer_weights w;
    engram_layer_weights_init(&w);
    w.layer_id = L_A;
    w.table_type = ENGRAM_TYPE_BF16;
    w.table = g_table_a;
    w.table_rows = ROWS_A;
    w.wkv = g_wkv_a;
    w.wkv_type = ENGRAM_TYPE_F32;
    w.q = g_q_a;
    w.k = g_k_a;
    w.qk_type = ENGRAM_TYPE_F32;
    return w;
}

static engram_layer_weights weights_b(void) {
    engram_layer_weights w;
    engram_layer_weights_init(&w);
    w.layer_id = L_B;
    w.table_type = ENGRAM_TYPE_FP8_E4M3_E8M0;
    w.table = g_table_b;
    w.table_rows = ROWS_B;
    w.wkv = g_wkv_b;
    w.wkv_type = ENGRAM_TYPE_BF16;
    w.q = g_q_b;
    w.k = g_k_b;
    w.qk_type = ENGRAM_TYPE_BF16;
    return w;
}

/* Setup failures are reported and abort the test: nothing after them is meaningful. */
static void must(int st, const char *what) {
    if (st != ENGRAM_STATUS_OK) {
        printf("FAIL setup: %s returned %d (%s): %s\n", what, st, engram_status_str(st),
               engram_last_error());
        exit(1);
    }
}

/* The baseline history every "fresh" context starts with. */
#define N_BASE 6
static const int32_t base_tok[N_BASE] = {1, 2, 4, 5, 6, 7};
static const int32_t base_seq[N_BASE] = {0, 0, 0, 0, 1, 1};
static const int32_t base_pos[N_BASE] = {0, 1, 2, 3, 0, 1};

/* The probe: continues seq 0 at pos 4, 5 and seq 1 at pos 2 (look-backs reach
 * the baseline's pos 2, 3 of seq 0 and pos 0, 1 of seq 1). */
#define N_PROBE 3
static const int32_t probe_tok[N_PROBE] = {8, 10, 11};
static const int32_t probe_seq[N_PROBE] = {0, 0, 1};
static const int32_t probe_pos[N_PROBE] = {4, 5, 2};
static int64_t g_probe_ref[N_PROBE * E_PER];

/* Poison: valid tokens that every bad batch starts with. Each one changes a
 * compressed id the probe looks back to, or creates seq 2 pos 0, so any
 * partial commit of a failed batch shows up in the probe. */
#define N_POISON 3
static const int32_t poison_tok[N_POISON] = {2, 0, 12};
static const int32_t poison_seq[N_POISON] = {0, 1, 2};
static const int32_t poison_pos[N_POISON] = {3, 1, 0};

enum { SET_NONE = 0, SET_A = 1, SET_B = 2, SET_BOTH = 3 };

static engram_context *fresh_ctx(int set) {
    engram_config c = base_config();
    engram_context *ctx = NULL;
    must((int)engram_create(&c, &ctx), "engram_create");
    if (set & SET_A) {
        engram_layer_weights w = weights_a();
        must((int)engram_set_layer(ctx, &w), "engram_set_layer A");
    }
    if (set & SET_B) {
        engram_layer_weights w = weights_b();
        must((int)engram_set_layer(ctx, &w), "engram_set_layer B");
    }
    int64_t ids[N_BASE * E_PER];
    must((int)engram_hash(ctx, base_tok, base_seq, base_pos, N_BASE, ids, N_BASE * E_PER),
         "baseline engram_hash");
    return ctx;
}

/* ------------------------------------------------------------------------ */
/* The canary message and status checks                                       */

static engram_context *g_canary_ctx;
static char g_canary_msg[512];

/* Set engram_last_error() to a known message (seq_drop of an absent sequence). */
CHECK_DEPRECATED_BEGIN /* the deprecated aliases, on purpose */
static void set_canary(void) {
    int st = (int)engram_seq_drop(g_canary_ctx, 424242);
    if (st != ENGRAM_STATUS_ERR_INVALID_SEQUENCE) {
        printf("FAIL setup: canary seq_drop returned %d\n", st);
        exit(1);
    }
    snprintf(g_canary_msg, sizeof g_canary_msg, "%s", engram_last_error());
}
CHECK_DEPRECATED_END

static char g_last_msg[1024];

/* Check a status and that this call left a non-empty message of its own. */
static int expect_status(int got, int want, const char *what) {
    const char *m = engram_last_error();
    snprintf(g_last_msg, sizeof g_last_msg, "%s", m ? m : "(null)");
    int ok = check(got == want, "%s: status %s (%d)", what, engram_status_str(want), want);
    if (!ok) note("got %d (%s): %s", got, engram_status_str(got), g_last_msg);
    if (want != ENGRAM_STATUS_OK) {
        int msg_ok = m != NULL && m[0] != '\0' && strcmp(m, g_canary_msg) != 0;
        if (!check(msg_ok, "%s: engram_last_error() set: \"%s\"", what, g_last_msg)) ok = 0;
    }
    return ok;
}

static int msg_has(const char *needle) { return strstr(g_last_msg, needle) != NULL; }

/* ------------------------------------------------------------------------ */
/* History probe                                                              */

/* The probe on ctx must give the reference ids, and seq 2 pos 1 must still be
 * missing its look-back (pos 0 of seq 2 was never hashed). */
static void check_history_untouched(engram_context *ctx, const char *what) {
    int64_t ids[N_PROBE * E_PER];
    int st = (int)engram_hash(ctx, probe_tok, probe_seq, probe_pos, N_PROBE, ids, N_PROBE * E_PER);
    check(st == ENGRAM_STATUS_OK && memcmp(ids, g_probe_ref, sizeof ids) == 0,
          "%s: history untouched (probe ids equal those of an untouched context)", what);
    int32_t t = 1, s = 2, p = 1;
    st = (int)engram_hash(ctx, &t, &s, &p, 1, ids, E_PER);
    check(st == ENGRAM_STATUS_ERR_MISSING_HISTORY,
          "%s: history untouched (seq 2 pos 0 still never hashed)", what);
}

/* ------------------------------------------------------------------------ */
/* engram_create                                                              */

static int g_out_sentinel_target;
#define OUT_SENTINEL ((engram_context *)(void *)&g_out_sentinel_target)

static void create_fails(const engram_config *cfg, int want, const char *what) {
    engram_context *out = OUT_SENTINEL;
    set_canary();
    int st = (int)engram_create(cfg, &out);
    expect_status(st, want, what);
    check(out == OUT_SENTINEL, "%s: *out untouched", what);
    if (out != OUT_SENTINEL && st == ENGRAM_STATUS_OK) engram_free(out);
}

static void test_create(void) {
    engram_config c;
    char what[160];

    /* The happy path first, so that the failures below are failures of one field. */
    c = base_config();
    engram_context *ctx = NULL;
    int st = (int)engram_create(&c, &ctx);
    check(st == ENGRAM_STATUS_OK && ctx != NULL, "create: the base config is valid");
    check(engram_row_ids_per_token(ctx) == E_PER, "create: engram_row_ids_per_token = n_layers*C = %u",
          E_PER);
    engram_free(ctx);

    set_canary();
    st = (int)engram_create(NULL, &ctx);
    expect_status(st, ENGRAM_STATUS_ERR_NULL_ARGUMENT, "create: NULL cfg");
    create_fails(NULL, ENGRAM_STATUS_ERR_NULL_ARGUMENT, "create: NULL cfg (out sentinel)");
    c = base_config();
    set_canary();
    st = (int)engram_create(&c, NULL);
    expect_status(st, ENGRAM_STATUS_ERR_NULL_ARGUMENT, "create: NULL out");

    /* (sizeof - 8 is the 0.1 layout, which is read: see test_device_hash.c.) */
    const size_t sizes[] = {0, sizeof(engram_config) - 4, sizeof(engram_config) + 8, 1};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        c = base_config();
        c.struct_size = sizes[i];
        snprintf(what, sizeof what, "create: struct_size %zu (want %zu)", sizes[i], sizeof(engram_config));
        create_fails(&c, ENGRAM_STATUS_ERR_STRUCT_SIZE, what);
    }

    c = base_config(); c.hidden_size = 0; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: D = 0");
    c = base_config(); c.hc = 0; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: hc = 0");
    c = base_config(); c.head_dim = 0; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: Hd = 0");
    c = base_config(); c.n_heads = 0; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: n_heads = 0");
    c = base_config(); c.max_ngram = 1; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: max_ngram = 1");
    c = base_config(); c.max_ngram = 0; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: max_ngram = 0");

    /* ENGRAM_CPU_KERNEL names the CPU kernel at create (docs/cpu.md): a name
     * that is not a kernel is refused, naming the variable; a kernel every
     * CPU runs is used. This test is single-threaded, so the variable is set
     * while no other thread reads the environment. */
    setenv("ENGRAM_CPU_KERNEL", "avx9", 1);
    c = base_config();
    create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: ENGRAM_CPU_KERNEL=avx9");
    check(msg_has("ENGRAM_CPU_KERNEL=avx9: not a kernel"), "create: the message names the variable (%s)",
          g_last_msg);
    setenv("ENGRAM_CPU_KERNEL", "portable", 1);
    ctx = NULL;
    st = (int)engram_create(&c, &ctx);
    check(st == ENGRAM_STATUS_OK && ctx != NULL, "create: ENGRAM_CPU_KERNEL=portable is a kernel");
    engram_free(ctx);
    unsetenv("ENGRAM_CPU_KERNEL");
    c = base_config(); c.hidden_size = (1u << 20) + 1; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: D = 2^20+1 (out of range)");
    c = base_config(); c.hc = 65; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: hc = 65 (out of range)");
    c = base_config(); c.n_heads = 1025; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: n_heads = 1025 (out of range)");

    c = base_config(); c.n_layers = 0; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: zero layers");
    c = base_config(); c.n_layers = 0; c.layer_ids = NULL; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: zero layers, NULL layer_ids");
    {
        static const uint32_t dup[2] = {L_A, L_A};
        c = base_config(); c.layer_ids = dup;
        create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: duplicate layer id");
    }

    c = base_config(); c.n_multipliers = E_LAYERS * E_N - 1; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: multipliers one short");
    {
        static uint64_t longer[E_LAYERS * E_N + 1];
        memcpy(longer, g_multipliers, sizeof g_multipliers);
        longer[E_LAYERS * E_N] = 3;
        c = base_config(); c.multipliers = longer; c.n_multipliers = E_LAYERS * E_N + 1;
        create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: multipliers one long");
    }
    {
        /* The spec's multipliers are odd: an even one (zero included) is refused. */
        static const uint64_t even_at[3] = {0, 4, E_LAYERS * E_N - 1};
        static const uint64_t even_value[3] = {0, 2, UINT64_C(0xfffffffffffffffe) /* -2 */};
        for (int i = 0; i < 3; i++) {
            uint64_t m[E_LAYERS * E_N];
            memcpy(m, g_multipliers, sizeof m);
            m[even_at[i]] = even_value[i];
            c = base_config(); c.multipliers = m;
            snprintf(what, sizeof what, "create: multipliers[%d] = %lld (even)", (int)even_at[i],
                     (long long)(int64_t)even_value[i]);
            create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, what);
            char idx[32];
            snprintf(idx, sizeof idx, "multipliers[%d]", (int)even_at[i]);
            check(msg_has(idx) && msg_has("even"), "%s: the message names %s and says even", what, idx);
        }
    }
    c = base_config(); c.n_primes = E_LAYERS * E_C - 1; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: primes one short");
    c = base_config(); c.n_offsets = E_LAYERS * E_C - 1; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: offsets one short");
    c = base_config(); c.n_primes = 4; c.n_offsets = 4; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: primes/offsets for one layer only");

    {
        uint64_t p[E_LAYERS * E_C], o[E_LAYERS * E_C];
        memcpy(p, g_primes, sizeof p);
        p[5] = 0;
        c = base_config(); c.primes = p;
        create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: a prime of 0");
        memcpy(p, g_primes, sizeof p);
        p[2] = (uint64_t)INT64_MAX + 1u;
        c = base_config(); c.primes = p;
        create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: a prime of INT64_MAX + 1");
        p[2] = UINT64_MAX;
        create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: a prime of UINT64_MAX");
        memcpy(o, g_offsets, sizeof o);
        o[3] = (uint64_t)INT64_MAX - 5u; /* + prime 19 > INT64_MAX */
        c = base_config(); c.offsets = o;
        create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: offset + prime above INT64_MAX");
        o[3] = UINT64_MAX - 3u; /* + 19 wraps u64 */
        create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: offset + prime wrapping u64");
        memcpy(o, g_offsets, sizeof o);
        o[3] = (uint64_t)INT64_MAX - 19u; /* exactly INT64_MAX: allowed at create */
        c = base_config(); c.offsets = o;
        engram_context *big = NULL;
        st = (int)engram_create(&c, &big);
        check(st == ENGRAM_STATUS_OK, "create: offset + prime == INT64_MAX is accepted");
        engram_free(big);
    }

    c = base_config(); c.layer_ids = NULL; create_fails(&c, ENGRAM_STATUS_ERR_NULL_ARGUMENT, "create: NULL layer_ids, n_layers 2");
    c = base_config(); c.token_map = NULL; create_fails(&c, ENGRAM_STATUS_ERR_NULL_ARGUMENT, "create: NULL token_map, len 16");
    c = base_config(); c.multipliers = NULL; create_fails(&c, ENGRAM_STATUS_ERR_NULL_ARGUMENT, "create: NULL multipliers");
    c = base_config(); c.primes = NULL; create_fails(&c, ENGRAM_STATUS_ERR_NULL_ARGUMENT, "create: NULL primes");
    c = base_config(); c.offsets = NULL; create_fails(&c, ENGRAM_STATUS_ERR_NULL_ARGUMENT, "create: NULL offsets");
    c = base_config(); c.token_map_len = 0; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: empty token_map");
    {
        int32_t tm[E_VOCAB];
        memcpy(tm, g_token_map, sizeof tm);
        tm[7] = -2;
        c = base_config(); c.token_map = tm;
        create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: token_map entry -2");
    }
    c = base_config(); c.pad_id = -1; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: pad_id -1");
    c = base_config(); c.pad_id = (int64_t)INT32_MAX + 1; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: pad_id 2^31");

    /* ENGRAM_BACKEND_CUDA depends on the machine (driver or not): c_tests/test_cuda_errors.c. */
    c = base_config(); c.backend = 0; create_fails(&c, ENGRAM_STATUS_ERR_UNSUPPORTED, "create: backend 0 (unknown)");
    c = base_config(); c.backend = 12345; create_fails(&c, ENGRAM_STATUS_ERR_UNSUPPORTED, "create: backend 12345 (unknown)");

    c = base_config(); c.eps = -1.0f; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: eps -1");
    c = base_config(); c.eps = f32_from_bits(0x7fc00000u); create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: eps NaN");
    c = base_config(); c.eps = f32_from_bits(0x7f800000u); create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: eps +inf");

    c = base_config(); c.max_tokens = 0; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: max_tokens 0");
    c = base_config(); c.max_seqs = 0; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: max_seqs 0");
    c = base_config(); c.max_positions = 0; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: max_positions 0");
    c = base_config(); c.max_positions = 0x80000000u; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: max_positions 2^31");
    c = base_config(); c.max_seqs = (1u << 24) + 1; create_fails(&c, ENGRAM_STATUS_ERR_INVALID_CONFIG, "create: max_seqs 2^24+1");

    {
        /* A misaligned u64 array. */
        uint64_t buf[E_LAYERS * E_N + 1];
        unsigned char *raw = (unsigned char *)buf + 4;
        memcpy(raw, g_multipliers, sizeof g_multipliers);
        c = base_config(); c.multipliers = (const uint64_t *)(void *)raw;
        create_fails(&c, ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "create: misaligned multipliers");
    }

    /* Non-default but valid: the CPU backend ignores the device ordinal. */
    c = base_config();
    c.device = 7;
    c.n_threads = 0;
    ctx = NULL;
    st = (int)engram_create(&c, &ctx);
    check(st == ENGRAM_STATUS_OK, "create: CPU backend ignores device = 7; n_threads 0 is accepted");
    engram_free(ctx);
}

/* ------------------------------------------------------------------------ */
/* engram_set_layer                                                           */

#define N_APPLY N_PROBE
static float g_hw_in[N_APPLY * E_HW];     /* highway input for apply checks */
static float g_apply_ref_a[N_APPLY * E_HW];
static float g_apply_ref_b[N_APPLY * E_HW];

/* On ctx: layer A (if set) applied to g_hw_in with g_probe_ref gives g_apply_ref_a;
 * layer B: set -> g_apply_ref_b, unset -> NO_WEIGHTS. */
static void check_layers_untouched(engram_context *ctx, int set, const char *what) {
    float hw[N_APPLY * E_HW];
    memcpy(hw, g_hw_in, sizeof hw);
    int st = (int)engram_apply(ctx, L_A, g_probe_ref, N_APPLY, hw, ENGRAM_TYPE_F32, NULL);
    if (set & SET_A) {
        check(st == ENGRAM_STATUS_OK && memcmp(hw, g_apply_ref_a, sizeof hw) == 0,
              "%s: layer %u still applies its old weights", what, L_A);
    } else {
        check(st == ENGRAM_STATUS_ERR_NO_WEIGHTS, "%s: layer %u still has no weights", what, L_A);
    }
    memcpy(hw, g_hw_in, sizeof hw);
    st = (int)engram_apply(ctx, L_B, g_probe_ref, N_APPLY, hw, ENGRAM_TYPE_F32, NULL);
    if (set & SET_B) {
        check(st == ENGRAM_STATUS_OK && memcmp(hw, g_apply_ref_b, sizeof hw) == 0,
              "%s: layer %u still applies its old weights", what, L_B);
    } else {
        check(st == ENGRAM_STATUS_ERR_NO_WEIGHTS, "%s: layer %u still has no weights", what, L_B);
    }
}

/* Run a bad set_layer on a context with only layer A set (so the call either
 * tries to replace A's weights, or to set B's for the first time). */
static void set_layer_fails(const engram_layer_weights *w, int want, const char *what) {
    engram_context *ctx = fresh_ctx(SET_A);
    set_canary();
    int st = (int)engram_set_layer(ctx, w);
    expect_status(st, want, what);
    check_layers_untouched(ctx, SET_A, what);
    engram_free(ctx);
}

/* The same bad weights, aimed at layer A (set) and at layer B (unset). */
static void set_layer_fails_both(engram_layer_weights w, int want, const char *what) {
    char buf[200];
    w.layer_id = L_A;
    snprintf(buf, sizeof buf, "set_layer %u (replacing): %s", L_A, what);
    set_layer_fails(&w, want, buf);
    w.layer_id = L_B;
    snprintf(buf, sizeof buf, "set_layer %u (first set): %s", L_B, what);
    set_layer_fails(&w, want, buf);
}

static void test_set_layer(void) {
    engram_layer_weights w;
    char what[160];

    /* References for the observability checks. */
    {
        engram_context *ctx = fresh_ctx(SET_BOTH);
        memcpy(g_apply_ref_a, g_hw_in, sizeof g_hw_in);
        memcpy(g_apply_ref_b, g_hw_in, sizeof g_hw_in);
        must((int)engram_apply(ctx, L_A, g_probe_ref, N_APPLY, g_apply_ref_a, ENGRAM_TYPE_F32, NULL),
             "reference apply A");
        must((int)engram_apply(ctx, L_B, g_probe_ref, N_APPLY, g_apply_ref_b, ENGRAM_TYPE_F32, NULL),
             "reference apply B");
        check(memcmp(g_apply_ref_a, g_hw_in, sizeof g_hw_in) != 0 &&
                  memcmp(g_apply_ref_b, g_hw_in, sizeof g_hw_in) != 0 &&
                  memcmp(g_apply_ref_a, g_apply_ref_b, sizeof g_hw_in) != 0,
              "set_layer: references: both layers change the highway, differently");
        engram_free(ctx);
    }

    {
        engram_context *ctx = fresh_ctx(SET_A);
        w = weights_a();
        set_canary();
        expect_status((int)engram_set_layer(NULL, &w), ENGRAM_STATUS_ERR_NULL_ARGUMENT, "set_layer: NULL ctx");
        set_canary();
        expect_status((int)engram_set_layer(ctx, NULL), ENGRAM_STATUS_ERR_NULL_ARGUMENT, "set_layer: NULL weights");
        check_layers_untouched(ctx, SET_A, "set_layer: NULL weights");
        engram_free(ctx);
    }

    /* Below the oldest layout read (0.2's, which ends before table_scales), and above this header's. */
    const size_t sizes[] = {0, offsetof(engram_layer_weights, table_scales) - 8, sizeof(engram_layer_weights) + 8};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        w = weights_a();
        w.struct_size = sizes[i];
        snprintf(what, sizeof what, "struct_size %zu (want %zu)", sizes[i], sizeof(engram_layer_weights));
        set_layer_fails_both(w, ENGRAM_STATUS_ERR_STRUCT_SIZE, what);
    }

    w = weights_a(); w.layer_id = 11;
    set_layer_fails(&w, ENGRAM_STATUS_ERR_UNKNOWN_LAYER, "set_layer: unknown layer 11");
    w = weights_a(); w.layer_id = 0;
    set_layer_fails(&w, ENGRAM_STATUS_ERR_UNKNOWN_LAYER, "set_layer: unknown layer 0");

    /* Formats this build does not read. (Only Q2_K and unknown numbers: the
     * block formats are being added one by one, and a format that becomes
     * supported must not fail this test.) */
    const uint32_t bad_formats[] = {ENGRAM_TYPE_Q2_K, 12345u, 999u};
    for (size_t i = 0; i < sizeof bad_formats / sizeof bad_formats[0]; i++) {
        w = weights_a(); w.table_type = bad_formats[i];
        snprintf(what, sizeof what, "table format %u", bad_formats[i]);
        set_layer_fails_both(w, ENGRAM_STATUS_ERR_UNSUPPORTED, what);
    }

    w = weights_a(); w.table = NULL;
    set_layer_fails_both(w, ENGRAM_STATUS_ERR_NULL_ARGUMENT, "NULL table");
    w = weights_a(); w.wkv = NULL;
    set_layer_fails_both(w, ENGRAM_STATUS_ERR_NULL_ARGUMENT, "NULL wkv");
    w = weights_a(); w.q = NULL;
    set_layer_fails_both(w, ENGRAM_STATUS_ERR_NULL_ARGUMENT, "NULL q");
    w = weights_a(); w.k = NULL;
    set_layer_fails_both(w, ENGRAM_STATUS_ERR_NULL_ARGUMENT, "NULL k");

    /* The hash offsets + primes reach row ROWS_A - 1 (A) / ROWS_B - 1 (B). */
    w = weights_a(); w.table_rows = ROWS_A - 1;
    set_layer_fails(&w, ENGRAM_STATUS_ERR_INVALID_CONFIG, "set_layer 10: table_rows one short of offsets+primes");
    w = weights_b(); w.table_rows = ROWS_B - 1;
    set_layer_fails(&w, ENGRAM_STATUS_ERR_INVALID_CONFIG, "set_layer 20: table_rows one short of offsets+primes");
    w = weights_a(); w.table_rows = 0;
    set_layer_fails(&w, ENGRAM_STATUS_ERR_INVALID_CONFIG, "set_layer 10: table_rows 0");
    w = weights_a(); w.table_rows = UINT64_MAX;
    set_layer_fails_both(w, ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "table_rows UINT64_MAX (byte size overflows)");

    /* Weight dtypes are f32 or bf16 (f16 is left out: it may be added). */
    const uint32_t bad_dtypes[] = {ENGRAM_TYPE_Q2_K, ENGRAM_TYPE_FP8_E4M3_E8M0, 12345u};
    for (size_t i = 0; i < sizeof bad_dtypes / sizeof bad_dtypes[0]; i++) {
        w = weights_a(); w.wkv_type = bad_dtypes[i];
        snprintf(what, sizeof what, "wkv dtype %u", bad_dtypes[i]);
        set_layer_fails_both(w, ENGRAM_STATUS_ERR_UNSUPPORTED, what);
        w = weights_a(); w.qk_type = bad_dtypes[i];
        snprintf(what, sizeof what, "q/k dtype %u", bad_dtypes[i]);
        set_layer_fails_both(w, ENGRAM_STATUS_ERR_UNSUPPORTED, what);
    }

    {
        /* Misaligned weights: an f32 wkv 1 and 2 bytes off, a bf16 wkv 1 byte off, q 2 bytes off. */
        size_t nf = (size_t)E_KV_OUT * E_KV_IN;
        unsigned char *buf = (unsigned char *)filler_alloc(nf * sizeof(float) + 16);
        memcpy(buf + 1, g_wkv_a, nf * sizeof(float));
        w = weights_a(); w.wkv = buf + 1;
        set_layer_fails_both(w, ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "f32 wkv misaligned by 1 byte");
        memcpy(buf + 2, g_wkv_a, nf * sizeof(float));
        w = weights_a(); w.wkv = buf + 2;
        set_layer_fails_both(w, ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "f32 wkv misaligned by 2 bytes");
        memcpy(buf + 1, g_wkv_b, nf * sizeof(uint16_t));
        w = weights_b(); w.wkv = buf + 1;
        set_layer_fails(&w, ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "set_layer 20: bf16 wkv misaligned by 1 byte");
        memcpy(buf + 2, g_q_a, E_HC * E_D * sizeof(float));
        w = weights_a(); w.q = buf + 2;
        set_layer_fails_both(w, ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "f32 q misaligned by 2 bytes");
        free(buf);
    }

    {
        /* fp8 rows need Hd % 32 == 0: a context with Hd = 16. */
        engram_config c = base_config();
        c.head_dim = 16;
        engram_context *ctx = NULL;
        must((int)engram_create(&c, &ctx), "engram_create Hd 16");
        w = weights_b();
        w.table_rows = ROWS_B;
        set_canary();
        expect_status((int)engram_set_layer(ctx, &w), ENGRAM_STATUS_ERR_UNSUPPORTED,
                      "set_layer: fp8 table with Hd = 16 (not a multiple of 32)");
        engram_free(ctx);
    }

    {
        /* Happy paths: a bf16 table at an odd address is fine (rows are bytes);
         * replacing a layer's weights takes effect; setting them back restores. */
        engram_context *ctx = fresh_ctx(SET_A);
        size_t tb = (size_t)ROWS_A * E_HD * sizeof(uint16_t);
        unsigned char *odd = (unsigned char *)filler_alloc(tb + 1);
        memcpy(odd + 1, g_table_a, tb);
        w = weights_a(); w.table = odd + 1;
        int st = (int)engram_set_layer(ctx, &w);
        check(st == ENGRAM_STATUS_OK, "set_layer: a bf16 table at an odd address is accepted");
        check_layers_untouched(ctx, SET_A, "set_layer: odd-address table gives the same output");
        w = weights_a(); w.wkv = g_wkv_a2;
        st = (int)engram_set_layer(ctx, &w);
        float hw[N_APPLY * E_HW];
        memcpy(hw, g_hw_in, sizeof hw);
        int st2 = (int)engram_apply(ctx, L_A, g_probe_ref, N_APPLY, hw, ENGRAM_TYPE_F32, NULL);
        check(st == ENGRAM_STATUS_OK && st2 == ENGRAM_STATUS_OK && memcmp(hw, g_apply_ref_a, sizeof hw) != 0,
              "set_layer: replacing a layer's wkv changes its output");
        w = weights_a();
        st = (int)engram_set_layer(ctx, &w);
        check(st == ENGRAM_STATUS_OK, "set_layer: setting the old weights again");
        check_layers_untouched(ctx, SET_A, "set_layer: old weights restored");
        engram_free(ctx);
        free(odd);
    }
}

/* ------------------------------------------------------------------------ */
/* engram_hash                                                                */

#define HASH_MAX 12 /* up to max_tokens + a few */
#define SENTINEL INT64_C(0x5a5a5a5a5a5a5a5a)

/* A batch: the poison tokens, then `extra` tokens (the bad ones). */
typedef struct {
    int32_t tok[HASH_MAX], seq[HASH_MAX], pos[HASH_MAX];
    uint32_t n;
} batch;

static batch poisoned(void) {
    batch b;
    memset(&b, 0, sizeof b);
    for (uint32_t i = 0; i < N_POISON; i++) {
        b.tok[i] = poison_tok[i];
        b.seq[i] = poison_seq[i];
        b.pos[i] = poison_pos[i];
    }
    b.n = N_POISON;
    return b;
}

static void add(batch *b, int32_t tok, int32_t seq, int32_t pos) {
    b->tok[b->n] = tok;
    b->seq[b->n] = seq;
    b->pos[b->n] = pos;
    b->n++;
}

/* Run a bad hash on a fresh context with explicit pointers (NULL allowed). */
static void hash_fails_ptr(const int32_t *tok, const int32_t *seq, const int32_t *pos, uint32_t n,
                           int64_t *out, size_t cap, int want, const char *what) {
    engram_context *ctx = fresh_ctx(SET_NONE);
    int64_t buf[HASH_MAX * E_PER + 8];
    for (size_t i = 0; i < sizeof buf / sizeof buf[0]; i++) buf[i] = SENTINEL;
    int64_t *o = out == (int64_t *)1 ? buf : out; /* (int64_t*)1: use the sentinel buffer */
    set_canary();
    int st = (int)engram_hash(ctx, tok, seq, pos, n, o, cap);
    expect_status(st, want, what);
    int untouched = 1;
    for (size_t i = 0; i < sizeof buf / sizeof buf[0]; i++) untouched &= buf[i] == SENTINEL;
    check(untouched, "%s: output buffer untouched", what);
    check_history_untouched(ctx, what);
    engram_free(ctx);
}

#define USE_BUF ((int64_t *)1)

static void hash_fails(const batch *b, int want, const char *what) {
    hash_fails_ptr(b->tok, b->seq, b->pos, b->n, USE_BUF, (size_t)b->n * E_PER, want, what);
}

static void test_hash(void) {
    batch b;
    char what[160];

    /* The poison really changes what the probe sees (else the probe proves nothing). */
    check(g_token_map[poison_tok[0]] != g_token_map[base_tok[3]] &&
              g_token_map[poison_tok[1]] != g_token_map[base_tok[5]],
          "hash: the poison tokens' compressed ids differ from the baseline's");
    {
        engram_context *ctx = fresh_ctx(SET_NONE);
        b = poisoned();
        int64_t ids[HASH_MAX * E_PER], probe[N_PROBE * E_PER];
        int st = (int)engram_hash(ctx, b.tok, b.seq, b.pos, b.n, ids, (size_t)b.n * E_PER);
        int st2 = (int)engram_hash(ctx, probe_tok, probe_seq, probe_pos, N_PROBE, probe, N_PROBE * E_PER);
        check(st == ENGRAM_STATUS_OK && st2 == ENGRAM_STATUS_OK && memcmp(probe, g_probe_ref, sizeof probe) != 0,
              "hash: a committed poison batch does change the probe's ids");
        engram_free(ctx);
    }

    /* NULL pointers. */
    {
        int64_t out[HASH_MAX * E_PER];
        engram_context *ctx = fresh_ctx(SET_NONE);
        set_canary();
        expect_status((int)engram_hash(NULL, probe_tok, probe_seq, probe_pos, N_PROBE, out, N_PROBE * E_PER),
                      ENGRAM_STATUS_ERR_NULL_ARGUMENT, "hash: NULL ctx");
        /* NULL arrays with n_tokens == 0 are accepted and change nothing. */
        int st = (int)engram_hash(ctx, NULL, NULL, NULL, 0, NULL, 0);
        check(st == ENGRAM_STATUS_OK, "hash: NULL arrays with n_tokens 0 are accepted");
        st = (int)engram_hash(ctx, probe_tok, probe_seq, probe_pos, 0, out, 0);
        check(st == ENGRAM_STATUS_OK, "hash: n_tokens 0, row_ids_cap 0 is accepted");
        check_history_untouched(ctx, "hash: n_tokens 0");
        engram_free(ctx);
    }
    b = poisoned(); add(&b, 8, 0, 4);
    hash_fails_ptr(NULL, b.seq, b.pos, b.n, USE_BUF, b.n * E_PER, ENGRAM_STATUS_ERR_NULL_ARGUMENT, "hash: NULL tokens");
    hash_fails_ptr(b.tok, NULL, b.pos, b.n, USE_BUF, b.n * E_PER, ENGRAM_STATUS_ERR_NULL_ARGUMENT, "hash: NULL seq_ids");
    hash_fails_ptr(b.tok, b.seq, NULL, b.n, USE_BUF, b.n * E_PER, ENGRAM_STATUS_ERR_NULL_ARGUMENT, "hash: NULL pos");
    hash_fails_ptr(b.tok, b.seq, b.pos, b.n, NULL, b.n * E_PER, ENGRAM_STATUS_ERR_NULL_ARGUMENT, "hash: NULL row_ids");
    hash_fails_ptr(b.tok, b.seq, b.pos, b.n, USE_BUF, b.n * E_PER - 1, ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "hash: row_ids_cap one short");
    hash_fails_ptr(b.tok, b.seq, b.pos, b.n, USE_BUF, 0, ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "hash: row_ids_cap 0");
    {
        /* Misaligned arrays. */
        int32_t raw[HASH_MAX + 1];
        unsigned char *p = (unsigned char *)raw + 2;
        memcpy(p, b.tok, b.n * sizeof(int32_t));
        hash_fails_ptr((const int32_t *)(void *)p, b.seq, b.pos, b.n, USE_BUF, b.n * E_PER,
                       ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "hash: tokens misaligned by 2 bytes");
        int64_t rawo[HASH_MAX * E_PER + 1];
        hash_fails_ptr(b.tok, b.seq, b.pos, b.n, (int64_t *)(void *)((unsigned char *)rawo + 4), b.n * E_PER,
                       ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "hash: row_ids misaligned by 4 bytes");
    }

    /* Tokens. */
    const int32_t bad_tokens[] = {-2, -100, INT32_MIN, (int32_t)E_VOCAB, (int32_t)E_VOCAB + 1, INT32_MAX};
    for (size_t i = 0; i < sizeof bad_tokens / sizeof bad_tokens[0]; i++) {
        b = poisoned(); add(&b, bad_tokens[i], 0, 4);
        snprintf(what, sizeof what, "hash: token id %d (token_map_len %u)", bad_tokens[i], E_VOCAB);
        hash_fails(&b, ENGRAM_STATUS_ERR_INVALID_TOKEN, what);
    }

    /* Missing history: seq 1 has pos 0..1; pos 3 looks back to pos 2. */
    b = poisoned(); add(&b, 8, 1, 3);
    hash_fails(&b, ENGRAM_STATUS_ERR_MISSING_HISTORY, "hash: seq 1 pos 3, pos 2 never hashed");
    check(msg_has("sequence 1") && msg_has("position 3") && msg_has("position 2"),
          "hash: the missing-history message names the sequence, the position and the look-back: \"%s\"",
          g_last_msg);
    /* Seq 2 was never hashed at all (the poison's seq 2 pos 0 is in this batch but
     * pos 1 is not): pos 2 looks back to pos 1. */
    b = poisoned(); add(&b, 8, 2, 2);
    hash_fails(&b, ENGRAM_STATUS_ERR_MISSING_HISTORY, "hash: seq 2 pos 2, pos 1 never hashed");
    check(msg_has("sequence 2") && msg_has("position 2") && msg_has("position 1"),
          "hash: the missing-history message names sequence 2, position 2 and position 1: \"%s\"", g_last_msg);

    /* The same (seq, pos) twice in one batch. */
    b = poisoned(); add(&b, 8, 0, 4); add(&b, 10, 0, 4);
    hash_fails(&b, ENGRAM_STATUS_ERR_INVALID_SEQUENCE, "hash: seq 0 pos 4 twice in one batch");
    b = poisoned(); add(&b, 8, 0, 3);
    hash_fails(&b, ENGRAM_STATUS_ERR_INVALID_SEQUENCE, "hash: seq 0 pos 3 twice (with the poison's)");

    /* Sequence and position ranges. */
    const int32_t bad_seqs[] = {-1, (int32_t)E_MAX_SEQS, INT32_MAX, INT32_MIN};
    for (size_t i = 0; i < sizeof bad_seqs / sizeof bad_seqs[0]; i++) {
        b = poisoned(); add(&b, 8, bad_seqs[i], 0);
        snprintf(what, sizeof what, "hash: seq id %d (max_seqs %u)", bad_seqs[i], E_MAX_SEQS);
        hash_fails(&b, ENGRAM_STATUS_ERR_INVALID_SEQUENCE, what);
    }
    const int32_t bad_pos[] = {-1, (int32_t)E_MAX_POS, INT32_MAX, INT32_MIN};
    for (size_t i = 0; i < sizeof bad_pos / sizeof bad_pos[0]; i++) {
        b = poisoned(); add(&b, 8, 0, bad_pos[i]);
        snprintf(what, sizeof what, "hash: position %d (max_positions %u)", bad_pos[i], E_MAX_POS);
        hash_fails(&b, ENGRAM_STATUS_ERR_INVALID_SEQUENCE, what);
    }

    /* More tokens than max_tokens (all valid otherwise). */
    b = poisoned();
    for (int32_t p = 4; b.n < E_MAX_TOKENS + 1; p++) add(&b, 1, 0, p);
    snprintf(what, sizeof what, "hash: %u tokens (max_tokens %u)", b.n, E_MAX_TOKENS);
    hash_fails(&b, ENGRAM_STATUS_ERR_CAPACITY, what);
    {
        /* Exactly max_tokens is fine. */
        engram_context *ctx = fresh_ctx(SET_NONE);
        b.n = E_MAX_TOKENS;
        int64_t out[HASH_MAX * E_PER];
        int st = (int)engram_hash(ctx, b.tok, b.seq, b.pos, b.n, out, (size_t)b.n * E_PER);
        check(st == ENGRAM_STATUS_OK, "hash: exactly max_tokens (%u) tokens are accepted", E_MAX_TOKENS);
        engram_free(ctx);
    }

    /* Happy paths around the error paths. */
    {
        engram_context *ctx = fresh_ctx(SET_NONE);
        /* A batch's tokens see each other whatever their order: seq 1 pos 3 before pos 2. */
        int32_t t[2] = {8, 10}, s[2] = {1, 1}, p[2] = {3, 2};
        int64_t out[2 * E_PER];
        int st = (int)engram_hash(ctx, t, s, p, 2, out, 2 * E_PER);
        check(st == ENGRAM_STATUS_OK, "hash: seq 1 pos 3 and pos 2 in one batch, out of order, are accepted");
        /* A dead token (ENGRAM_TOKEN_DEAD or a -1 map entry) gets -1 everywhere. */
        int32_t td[2] = {ENGRAM_TOKEN_DEAD, 3}, sd[2] = {0, 0}, pd[2] = {4, 5};
        for (size_t i = 0; i < 2 * E_PER; i++) out[i] = SENTINEL;
        st = (int)engram_hash(ctx, td, sd, pd, 2, out, 2 * E_PER);
        int all_dead = 1;
        for (size_t i = 0; i < 2 * E_PER; i++) all_dead &= out[i] == ENGRAM_ROW_ID_DEAD;
        check(st == ENGRAM_STATUS_OK && all_dead,
              "hash: ENGRAM_TOKEN_DEAD and a token mapped to -1 give ENGRAM_ROW_ID_DEAD in every column");
        /* A larger capacity than needed is fine and only n*per elements are written. */
        int64_t big[3 * E_PER];
        for (size_t i = 0; i < 3 * E_PER; i++) big[i] = SENTINEL;
        int32_t t1 = 1, s1 = 0, p1 = 6;
        st = (int)engram_hash(ctx, &t1, &s1, &p1, 1, big, 3 * E_PER);
        int tail = 1;
        for (size_t i = E_PER; i < 3 * E_PER; i++) tail &= big[i] == SENTINEL;
        check(st == ENGRAM_STATUS_OK && tail && big[0] != SENTINEL,
              "hash: row_ids_cap larger than needed: only n * row_ids_per_token elements are written");
        engram_free(ctx);
    }
}

/* ------------------------------------------------------------------------ */
/* engram_apply                                                               */

/* Run a bad apply on ctx; the highway (`hw`, `bytes` long) must be untouched,
 * and ctx must still give the reference outputs. */
static void apply_fails_on(engram_context *ctx, int set, uint32_t layer, const int64_t *ids, uint32_t n,
                           void *hw, size_t bytes, uint32_t type, int want, const char *what) {
    unsigned char *before = (unsigned char *)filler_alloc(bytes ? bytes : 1);
    if (hw) memcpy(before, hw, bytes);
    set_canary();
    int st = (int)engram_apply(ctx, layer, ids, n, hw, type, NULL);
    expect_status(st, want, what);
    if (hw) check(memcmp(before, hw, bytes) == 0, "%s: highway bytes untouched", what);
    if (ctx) check_layers_untouched(ctx, set, what);
    free(before);
}

static void apply_fails(uint32_t layer, const int64_t *ids, uint32_t n, void *hw, size_t bytes,
                        uint32_t type, int want, const char *what) {
    engram_context *ctx = fresh_ctx(SET_BOTH);
    apply_fails_on(ctx, SET_BOTH, layer, ids, n, hw, bytes, type, want, what);
    engram_free(ctx);
}

#define APPLY_MAX (E_MAX_TOKENS + 1)

static void test_apply(void) {
    float hw[APPLY_MAX * E_HW];
    int64_t ids[APPLY_MAX * E_PER];
    char what[160];
    for (size_t i = 0; i < APPLY_MAX * E_HW; i++) hw[i] = g_hw_in[i % (N_APPLY * E_HW)];
    memcpy(ids, g_probe_ref, sizeof g_probe_ref);

    apply_fails_on(NULL, SET_NONE, L_A, ids, N_APPLY, hw, sizeof hw, ENGRAM_TYPE_F32,
                   ENGRAM_STATUS_ERR_NULL_ARGUMENT, "apply: NULL ctx");
    apply_fails(L_A, NULL, N_APPLY, hw, sizeof hw, ENGRAM_TYPE_F32, ENGRAM_STATUS_ERR_NULL_ARGUMENT,
                "apply: NULL row_ids");
    apply_fails(L_A, ids, N_APPLY, NULL, 0, ENGRAM_TYPE_F32, ENGRAM_STATUS_ERR_NULL_ARGUMENT,
                "apply: NULL highway");
    {
        engram_context *ctx = fresh_ctx(SET_BOTH);
        int st = (int)engram_apply(ctx, L_A, NULL, 0, NULL, ENGRAM_TYPE_F32, NULL);
        check(st == ENGRAM_STATUS_OK, "apply: NULL row_ids and highway with n_tokens 0 are accepted");
        engram_free(ctx);
    }
    apply_fails(11, ids, N_APPLY, hw, sizeof hw, ENGRAM_TYPE_F32, ENGRAM_STATUS_ERR_UNKNOWN_LAYER,
                "apply: unknown layer 11");
    apply_fails(0, ids, N_APPLY, hw, sizeof hw, ENGRAM_TYPE_F32, ENGRAM_STATUS_ERR_UNKNOWN_LAYER,
                "apply: unknown layer 0");

    {
        /* max_tokens + 1 tokens (valid ids). */
        for (uint32_t t = 0; t < APPLY_MAX; t++) memcpy(ids + t * E_PER, g_probe_ref, E_PER * sizeof(int64_t));
        snprintf(what, sizeof what, "apply: %u tokens (max_tokens %u)", APPLY_MAX, E_MAX_TOKENS);
        apply_fails(L_A, ids, APPLY_MAX, hw, sizeof hw, ENGRAM_TYPE_F32, ENGRAM_STATUS_ERR_CAPACITY, what);
        memcpy(ids, g_probe_ref, sizeof g_probe_ref);
    }

    /* The highway is f32 or bf16 (f16 is left out: it may be added). */
    const uint32_t bad_hw[] = {ENGRAM_TYPE_Q8_0, ENGRAM_TYPE_FP8_E4M3_E8M0, 12345u};
    for (size_t i = 0; i < sizeof bad_hw / sizeof bad_hw[0]; i++) {
        snprintf(what, sizeof what, "apply: highway type %u", bad_hw[i]);
        apply_fails(L_A, ids, N_APPLY, hw, N_APPLY * E_HW * sizeof(float), bad_hw[i],
                    ENGRAM_STATUS_ERR_UNSUPPORTED, what);
    }

    {
        /* Misaligned highway (f32 by 2 bytes, bf16 by 1 byte) and row ids (by 4 bytes). */
        unsigned char raw[N_APPLY * E_HW * sizeof(float) + 8];
        memcpy(raw + 2, g_hw_in, N_APPLY * E_HW * sizeof(float));
        apply_fails(L_A, ids, N_APPLY, raw + 2, N_APPLY * E_HW * sizeof(float), ENGRAM_TYPE_F32,
                    ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "apply: f32 highway misaligned by 2 bytes");
        apply_fails(L_A, ids, N_APPLY, raw + 1, N_APPLY * E_HW * sizeof(uint16_t), ENGRAM_TYPE_BF16,
                    ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "apply: bf16 highway misaligned by 1 byte");
        int64_t rawi[N_APPLY * E_PER + 1];
        unsigned char *pi = (unsigned char *)rawi + 4;
        memcpy(pi, g_probe_ref, sizeof g_probe_ref);
        apply_fails(L_A, (const int64_t *)(void *)pi, N_APPLY, hw, N_APPLY * E_HW * sizeof(float),
                    ENGRAM_TYPE_F32, ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "apply: row_ids misaligned by 4 bytes");
    }

    {
        /* Apply before set_layer. */
        engram_context *ctx = fresh_ctx(SET_A);
        apply_fails_on(ctx, SET_A, L_B, ids, N_APPLY, hw, N_APPLY * E_HW * sizeof(float), ENGRAM_TYPE_F32,
                       ENGRAM_STATUS_ERR_NO_WEIGHTS, "apply: layer 20 before its set_layer");
        engram_free(ctx);
        ctx = fresh_ctx(SET_NONE);
        apply_fails_on(ctx, SET_NONE, L_A, ids, N_APPLY, hw, N_APPLY * E_HW * sizeof(float), ENGRAM_TYPE_BF16,
                       ENGRAM_STATUS_ERR_NO_WEIGHTS, "apply: layer 10 before any set_layer (bf16 highway)");
        engram_free(ctx);
    }

    /* Bad row ids. Layer A's ids are columns 0..3 of each token, layer B's 4..7;
     * the bad id goes into the last token so that earlier tokens are valid. */
    {
        struct {
            uint32_t layer;
            size_t col; /* within the token's E_PER ids */
            int64_t id;
            const char *desc;
        } cases[] = {
            {L_A, 1, ROWS_A, "row id == table_rows"},
            {L_A, 3, INT64_MAX, "row id INT64_MAX"},
            {L_A, 0, -2, "row id -2"},
            {L_A, 2, INT64_MIN, "row id INT64_MIN"},
            {L_B, 4 + 2, ROWS_B, "row id == table_rows"},
            {L_B, 4 + 0, -7, "row id -7"},
            {L_A, 0, ENGRAM_ROW_ID_DEAD, "ids only partly -1 (column 0 dead)"},
            {L_A, 3, ENGRAM_ROW_ID_DEAD, "ids only partly -1 (column 3 dead)"},
            {L_B, 4 + 1, ENGRAM_ROW_ID_DEAD, "ids only partly -1 (column 1 dead)"},
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            memcpy(ids, g_probe_ref, sizeof g_probe_ref);
            ids[(N_APPLY - 1) * E_PER + cases[i].col] = cases[i].id;
            snprintf(what, sizeof what, "apply: layer %u, %s", cases[i].layer, cases[i].desc);
            apply_fails(cases[i].layer, ids, N_APPLY, hw, N_APPLY * E_HW * sizeof(float), ENGRAM_TYPE_F32,
                        ENGRAM_STATUS_ERR_INVALID_ROW_ID, what);
            apply_fails(cases[i].layer, ids, N_APPLY, hw, N_APPLY * E_HW * sizeof(uint16_t), ENGRAM_TYPE_BF16,
                        ENGRAM_STATUS_ERR_INVALID_ROW_ID, what);
        }
        memcpy(ids, g_probe_ref, sizeof g_probe_ref);
        /* A bad id in the *other* layer's columns does not concern this layer. */
        ids[(N_APPLY - 1) * E_PER + 4] = ROWS_B + 5;
        engram_context *ctx = fresh_ctx(SET_BOTH);
        float x[N_APPLY * E_HW];
        memcpy(x, g_hw_in, sizeof x);
        int st = (int)engram_apply(ctx, L_A, ids, N_APPLY, x, ENGRAM_TYPE_F32, NULL);
        check(st == ENGRAM_STATUS_OK && memcmp(x, g_apply_ref_a, sizeof x) == 0,
              "apply: layer 10 ignores layer 20's columns of the row ids");
        /* A token whose ids for this layer are all -1 is dead: left untouched. */
        memcpy(ids, g_probe_ref, sizeof g_probe_ref);
        for (size_t c = 0; c < E_C; c++) ids[1 * E_PER + c] = ENGRAM_ROW_ID_DEAD;
        memcpy(x, g_hw_in, sizeof x);
        st = (int)engram_apply(ctx, L_A, ids, N_APPLY, x, ENGRAM_TYPE_F32, NULL);
        check(st == ENGRAM_STATUS_OK && memcmp(x + E_HW, g_hw_in + E_HW, E_HW * sizeof(float)) == 0 &&
                  memcmp(x, g_apply_ref_a, E_HW * sizeof(float)) == 0 &&
                  memcmp(x + 2 * E_HW, g_apply_ref_a + 2 * E_HW, E_HW * sizeof(float)) == 0,
              "apply: a token whose layer ids are all -1 is left bit-identical, the others applied");
        engram_free(ctx);
        memcpy(ids, g_probe_ref, sizeof g_probe_ref);
    }

    /* Invalid data in a gathered fp8 row: e8m0 scale 255, e4m3 codes 0x7F /
     * 0xFF (NaN), and scales of 247 and above, which make a code's value
     * overflow to infinity (a row that is not finite once dequantised). */
    {
        size_t tb = (size_t)ROWS_B * FP8_ROW_BYTES;
        uint8_t *bad = (uint8_t *)filler_alloc(tb);
        int64_t row = g_probe_ref[(N_APPLY - 1) * E_PER + 4 + 2]; /* last token, layer B column 2 */
        struct {
            size_t byte; /* within the row */
            uint8_t code;
            size_t byte2; /* a second byte, or (size_t)-1 */
            uint8_t code2;
            const char *desc;
        } cases[] = {
            {E_HD + 0, 255, (size_t)-1, 0, "e8m0 scale code 255 (NaN)"},
            {5, 0x7F, (size_t)-1, 0, "e4m3 code 0x7F (NaN)"},
            {31, 0xFF, (size_t)-1, 0, "e4m3 code 0xFF (-NaN)"},
            {E_HD + 0, 247, 7, 0x7E, "e8m0 scale code 247 over e4m3 448 (overflows to +inf)"},
            {E_HD + 0, 254, 0, 0xFE, "e8m0 scale code 254 over e4m3 -448 (overflows to -inf)"},
        };
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            memcpy(bad, g_table_b, tb);
            bad[(size_t)row * FP8_ROW_BYTES + cases[i].byte] = cases[i].code;
            if (cases[i].byte2 != (size_t)-1) bad[(size_t)row * FP8_ROW_BYTES + cases[i].byte2] = cases[i].code2;
            engram_context *ctx = fresh_ctx(SET_A);
            engram_layer_weights w = weights_b();
            w.table = bad;
            int st = (int)engram_set_layer(ctx, &w);
            snprintf(what, sizeof what, "apply: layer 20, row %lld has an %s", (long long)row, cases[i].desc);
            check(st == ENGRAM_STATUS_OK, "%s: set_layer accepts it (rows are checked when gathered)", what);
            float x[N_APPLY * E_HW];
            memcpy(x, g_hw_in, sizeof x);
            set_canary();
            st = (int)engram_apply(ctx, L_B, ids, N_APPLY, x, ENGRAM_TYPE_F32, NULL);
            expect_status(st, ENGRAM_STATUS_ERR_INVALID_DATA, what);
            char rowtxt[64];
            snprintf(rowtxt, sizeof rowtxt, "row %lld", (long long)row);
            check(msg_has(rowtxt), "%s: the message names the row: \"%s\"", what, g_last_msg);
            check(memcmp(x, g_hw_in, sizeof x) == 0, "%s: f32 highway untouched (tokens before it too)", what);
            uint16_t xb[N_APPLY * E_HW], xb0[N_APPLY * E_HW];
            for (size_t j = 0; j < N_APPLY * E_HW; j++) xb[j] = xb0[j] = bf16(g_hw_in[j]);
            set_canary();
            st = (int)engram_apply(ctx, L_B, ids, N_APPLY, xb, ENGRAM_TYPE_BF16, NULL);
            expect_status(st, ENGRAM_STATUS_ERR_INVALID_DATA, what);
            check(memcmp(xb, xb0, sizeof xb) == 0, "%s: bf16 highway untouched", what);
            /* The row is never gathered when its token is dead for this layer. */
            int64_t ids2[N_APPLY * E_PER];
            memcpy(ids2, ids, sizeof ids2);
            for (size_t c = 0; c < E_C; c++) ids2[(N_APPLY - 1) * E_PER + 4 + c] = ENGRAM_ROW_ID_DEAD;
            st = (int)engram_apply(ctx, L_B, ids2, N_APPLY, x, ENGRAM_TYPE_F32, NULL);
            check(st == ENGRAM_STATUS_OK, "%s: fine when that token is dead", what);
            engram_free(ctx);
        }
        free(bad);
    }
}

/* ------------------------------------------------------------------------ */
/* engram_seq_copy / engram_seq_drop                                          */

CHECK_DEPRECATED_BEGIN /* the deprecated aliases, on purpose */
static void test_seq(void) {
    char what[160];
    set_canary();
    expect_status((int)engram_seq_copy(NULL, 0, 1), ENGRAM_STATUS_ERR_NULL_ARGUMENT, "seq_copy: NULL ctx");
    set_canary();
    expect_status((int)engram_seq_drop(NULL, 0), ENGRAM_STATUS_ERR_NULL_ARGUMENT, "seq_drop: NULL ctx");

    const int32_t bad[] = {-1, (int32_t)E_MAX_SEQS, INT32_MAX, INT32_MIN};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct {
            int32_t src, dst;
        } pairs[] = {{bad[i], 1}, {0, bad[i]}, {bad[i], 0}, {1, bad[i]}, {bad[i], bad[i]}};
        for (size_t j = 0; j < sizeof pairs / sizeof pairs[0]; j++) {
            engram_context *ctx = fresh_ctx(SET_NONE);
            snprintf(what, sizeof what, "seq_copy(src %d, dst %d)", pairs[j].src, pairs[j].dst);
            set_canary();
            expect_status((int)engram_seq_copy(ctx, pairs[j].src, pairs[j].dst), ENGRAM_STATUS_ERR_INVALID_SEQUENCE,
                          what);
            check_history_untouched(ctx, what);
            engram_free(ctx);
        }
        engram_context *ctx = fresh_ctx(SET_NONE);
        snprintf(what, sizeof what, "seq_drop(%d)", bad[i]);
        set_canary();
        expect_status((int)engram_seq_drop(ctx, bad[i]), ENGRAM_STATUS_ERR_INVALID_SEQUENCE, what);
        check_history_untouched(ctx, what);
        engram_free(ctx);
    }

    int64_t out[8 * E_PER], ref0[E_PER];
    memcpy(ref0, g_probe_ref, sizeof ref0); /* seq 0 pos 4 token 8 on the baseline */
    {
        /* copy 0 -> 2 (seq 2 first gets a different history, which the copy replaces). */
        engram_context *ctx = fresh_ctx(SET_NONE);
        int32_t t[4] = {13, 14, 15, 13}, s[4] = {2, 2, 2, 2}, p[4] = {0, 1, 2, 3};
        int st = (int)engram_hash(ctx, t, s, p, 4, out, 4 * E_PER);
        int st2 = (int)engram_seq_copy(ctx, 0, 2);
        check(st == ENGRAM_STATUS_OK && st2 == ENGRAM_STATUS_OK, "seq_copy(0, 2): OK");
        int32_t t1 = probe_tok[0], s1 = 2, p1 = probe_pos[0];
        st = (int)engram_hash(ctx, &t1, &s1, &p1, 1, out, E_PER);
        check(st == ENGRAM_STATUS_OK && memcmp(out, ref0, sizeof ref0) == 0,
              "seq_copy(0, 2): hashing seq 2 continues from seq 0's history");
        s1 = 0;
        st = (int)engram_hash(ctx, &t1, &s1, &p1, 1, out, E_PER);
        check(st == ENGRAM_STATUS_OK && memcmp(out, ref0, sizeof ref0) == 0,
              "seq_copy(0, 2): seq 0 itself is unchanged");
        /* The copy is a snapshot: overwriting seq 0 pos 3 now does not affect seq 2. */
        int32_t tp = poison_tok[0], sp = 0, pp = 3;
        st = (int)engram_hash(ctx, &tp, &sp, &pp, 1, out, E_PER);
        s1 = 2;
        st2 = (int)engram_hash(ctx, &t1, &s1, &p1, 1, out, E_PER);
        check(st == ENGRAM_STATUS_OK && st2 == ENGRAM_STATUS_OK && memcmp(out, ref0, sizeof ref0) == 0,
              "seq_copy(0, 2): a later change to seq 0 does not reach seq 2");
        st = (int)engram_seq_copy(ctx, 1, 1);
        check(st == ENGRAM_STATUS_OK, "seq_copy(1, 1): copying a sequence onto itself is a no-op");
        engram_free(ctx);
    }
    {
        /* copy 1 -> 0 replaces seq 0's longer history: pos 4 now misses pos 3. */
        engram_context *ctx = fresh_ctx(SET_NONE);
        int st = (int)engram_seq_copy(ctx, 1, 0);
        int32_t t1 = 8, s1 = 0, p1 = 4;
        int st2 = (int)engram_hash(ctx, &t1, &s1, &p1, 1, out, E_PER);
        check(st == ENGRAM_STATUS_OK && st2 == ENGRAM_STATUS_ERR_MISSING_HISTORY,
              "seq_copy(1, 0): replaces seq 0's history (seq 0 pos 4 now misses pos 3)");
        /* copy from a never-used sequence empties dst. */
        st = (int)engram_seq_copy(ctx, 2, 1);
        s1 = 1; p1 = 1;
        st2 = (int)engram_hash(ctx, &t1, &s1, &p1, 1, out, E_PER);
        check(st == ENGRAM_STATUS_OK && st2 == ENGRAM_STATUS_ERR_MISSING_HISTORY,
              "seq_copy(2, 1) from an empty sequence empties seq 1");
        engram_free(ctx);
    }
    {
        engram_context *ctx = fresh_ctx(SET_NONE);
        int st = (int)engram_seq_drop(ctx, 0);
        check(st == ENGRAM_STATUS_OK, "seq_drop(0): OK");
        int32_t t1 = probe_tok[0], s1 = 0, p1 = probe_pos[0];
        set_canary();
        st = (int)engram_hash(ctx, &t1, &s1, &p1, 1, out, E_PER);
        expect_status(st, ENGRAM_STATUS_ERR_MISSING_HISTORY, "seq_drop(0), then a look-back into seq 0");
        /* Seq 1 is untouched by the drop. */
        int32_t t2 = probe_tok[2], s2 = 1, p2 = probe_pos[2];
        st = (int)engram_hash(ctx, &t2, &s2, &p2, 1, out, E_PER);
        check(st == ENGRAM_STATUS_OK && memcmp(out, g_probe_ref + 2 * E_PER, E_PER * sizeof(int64_t)) == 0,
              "seq_drop(0): seq 1 keeps its history");
        /* Seq 0 starts over from position 0 like a new sequence. */
        int64_t fresh_ids[E_PER];
        int32_t t0 = base_tok[0], s0 = 0, p0 = 0;
        st = (int)engram_hash(ctx, &t0, &s0, &p0, 1, out, E_PER);
        engram_context *c2 = fresh_ctx(SET_NONE);
        int32_t s9 = 2;
        int st2 = (int)engram_hash(c2, &t0, &s9, &p0, 1, fresh_ids, E_PER);
        check(st == ENGRAM_STATUS_OK && st2 == ENGRAM_STATUS_OK && memcmp(out, fresh_ids, sizeof fresh_ids) == 0,
              "seq_drop(0): seq 0 restarts at position 0 like a never-used sequence");
        st = (int)engram_seq_drop(ctx, 2);
        check(st == ENGRAM_STATUS_OK, "seq_drop(2) of a never-used sequence: OK");
        engram_free(c2);
        engram_free(ctx);
    }
}
CHECK_DEPRECATED_END

/* ------------------------------------------------------------------------ */
/* NULL-tolerant functions, status strings                                    */

static void test_misc(void) {
    engram_config_init(NULL);
    engram_layer_weights_init(NULL);
    engram_free(NULL);
    check(1, "engram_config_init(NULL), engram_layer_weights_init(NULL), engram_free(NULL) are no-ops");
    check(engram_row_ids_per_token(NULL) == 0, "engram_row_ids_per_token(NULL) is 0");

    engram_config c;
    memset(&c, 0xAB, sizeof c);
    engram_config_init(&c);
    check(c.struct_size == sizeof(engram_config) && c.backend == ENGRAM_BACKEND_CPU && c.eps == 1e-6f &&
              c.n_threads == 1 && c.hidden_size == 0 && c.layer_ids == NULL && c.token_map == NULL &&
              c.max_tokens == 0 && c.pad_id == 0,
          "engram_config_init: struct_size, CPU backend, eps 1e-6, one thread, zero elsewhere");
    engram_layer_weights w;
    memset(&w, 0xAB, sizeof w);
    engram_layer_weights_init(&w);
    check(w.struct_size == sizeof(engram_layer_weights) && w.layer_id == 0 && w.table == NULL &&
              w.table_rows == 0 && w.wkv == NULL && w.q == NULL && w.k == NULL,
          "engram_layer_weights_init: struct_size set, zero elsewhere");

    static const int known[] = {
        ENGRAM_STATUS_OK,
        ENGRAM_STATUS_ERR_NULL_ARGUMENT,
        ENGRAM_STATUS_ERR_STRUCT_SIZE,
        ENGRAM_STATUS_ERR_INVALID_CONFIG,
        ENGRAM_STATUS_ERR_INVALID_TOKEN,
        ENGRAM_STATUS_ERR_MISSING_HISTORY,
        ENGRAM_STATUS_ERR_UNKNOWN_LAYER,
        ENGRAM_STATUS_ERR_CAPACITY,
        ENGRAM_STATUS_ERR_UNSUPPORTED,
        ENGRAM_STATUS_ERR_INVALID_DATA,
        ENGRAM_STATUS_ERR_NO_WEIGHTS,
        ENGRAM_STATUS_ERR_INVALID_ROW_ID,
        ENGRAM_STATUS_ERR_INVALID_SEQUENCE,
        ENGRAM_STATUS_ERR_INVALID_ARGUMENT,
        ENGRAM_STATUS_ERR_DEVICE,
        ENGRAM_STATUS_ERR_IO,
        ENGRAM_STATUS_ERR_FORMAT,
        ENGRAM_STATUS_ERR_INTERNAL,
    };
    static const int32_t unknown[] = {-1, 1, 2, 7000, 7017, 7098, 7100, 12345, INT32_MIN, INT32_MAX};
    const size_t nk = sizeof known / sizeof known[0], nu = sizeof unknown / sizeof unknown[0];
    const char *u0 = engram_status_str(unknown[0]);
    check(u0 != NULL && u0[0] != '\0', "engram_status_str(-1): a non-empty text \"%s\"", u0 ? u0 : "(null)");
    for (size_t i = 1; i < nu; i++) {
        const char *s = engram_status_str(unknown[i]);
        check(s != NULL && u0 != NULL && strcmp(s, u0) == 0, "engram_status_str(%d) (unknown): \"%s\"",
              unknown[i], s ? s : "(null)");
    }
    for (size_t i = 0; i < nk; i++) {
        const char *s = engram_status_str(known[i]);
        int ok = s != NULL && s[0] != '\0' && u0 != NULL && strcmp(s, u0) != 0;
        for (size_t j = 0; ok && j < i; j++) ok = strcmp(s, engram_status_str(known[j])) != 0;
        ok = ok && engram_status_str(known[i]) == s; /* static: the same pointer again */
        check(ok, "engram_status_str(%d): \"%s\" (non-empty, distinct, static)", known[i], s ? s : "(null)");
    }
    check(ENGRAM_STATUS_ERR_NULL_ARGUMENT > 1000 && ENGRAM_STATUS_ERR_INTERNAL > 1000,
          "error codes sit above a nonzero base");
}

int main(void) {
    init_model();
    {
        engram_config c = base_config();
        must((int)engram_create(&c, &g_canary_ctx), "canary engram_create");
    }
    /* The reference probe: a context that never saw a bad call. */
    {
        engram_context *ctx = fresh_ctx(SET_NONE);
        must((int)engram_hash(ctx, probe_tok, probe_seq, probe_pos, N_PROBE, g_probe_ref, N_PROBE * E_PER),
             "reference probe");
        engram_free(ctx);
        int live = 1;
        for (size_t i = 0; i < N_PROBE * E_PER; i++) live &= g_probe_ref[i] >= 0;
        check(live, "setup: the probe's tokens are all live");
    }
    float *hw = (float *)build_values("err.highway", N_APPLY * E_HW, 1.0, 0.0, 0);
    memcpy(g_hw_in, hw, sizeof g_hw_in);
    free(hw);

    test_misc();
    test_create();
    test_set_layer();
    test_hash();
    test_apply();
    test_seq();

    engram_free(g_canary_ctx);
    free_model();
    return check_summary("test_errors");
}
