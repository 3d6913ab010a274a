/* The ABI's evolution and its read-back call:
 *
 *   - options structs carry struct_size: the exported *_init_sized calls
 *     write only the caller's bytes; a struct_size larger than this library
 *     knows (a newer header) or smaller than the oldest layout it reads is
 *     ENGRAM_STATUS_ERR_STRUCT_SIZE with a message naming both sizes, and
 *     changes nothing;
 *   - engram_read_back: the rows and kv of a call's tokens, and every bad
 *     input (status, message, buffers untouched).
 *
 * A tiny self-contained model: D 8, hc 2, Hd 32 (bf16 table), H 1, N 2
 * (C = 1), one layer (id 5), f32 wkv, q and k.
 */
#include "engram.h"

#include "check.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define A_D 8u
#define A_HC 2u
#define A_HD 32u
#define A_C 1u
#define A_LAYER 5u
#define A_ROWS 23u /* the one prime: 23, offset 0 */
#define A_KIN (A_C * A_HD)
#define A_KOUT (A_D * (A_HC + 1u))
#define A_MAX_TOKENS 4u

static const uint32_t g_layer_ids[1] = {A_LAYER};
static int32_t g_token_map[16];
static const uint64_t g_mult[2] = {3, 5};
static const uint64_t g_primes[1] = {A_ROWS};
static const uint64_t g_offsets[1] = {0};
static uint16_t g_table[A_ROWS * A_HD];
static float g_wkv[A_KOUT * A_KIN];
static float g_q[A_HC * A_D], g_k[A_HC * A_D];

static uint16_t bf16_of(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

static void init_model(void) {
    for (uint32_t i = 0; i < 16; i++) g_token_map[i] = (int32_t)(i % 7u);
    for (uint32_t i = 0; i < A_ROWS * A_HD; i++) g_table[i] = bf16_of((float)((int)(i % 13u) - 6) / 8.0f);
    for (uint32_t i = 0; i < A_KOUT * A_KIN; i++) g_wkv[i] = (float)((int)(i % 11u) - 5) / 16.0f;
    for (uint32_t i = 0; i < A_HC * A_D; i++) {
        g_q[i] = 1.0f + (float)(i % 3u) / 4.0f;
        g_k[i] = 1.0f - (float)(i % 5u) / 8.0f;
    }
}

static engram_config config(void) {
    engram_config c;
    engram_config_init(&c);
    c.hidden_size = A_D;
    c.hc = A_HC;
    c.head_dim = A_HD;
    c.n_heads = 1;
    c.max_ngram = 2;
    c.layer_ids = g_layer_ids;
    c.n_layers = 1;
    c.token_map = g_token_map;
    c.token_map_len = 16;
    c.pad_id = 0;
    c.multipliers = g_mult;
    c.n_multipliers = 2;
    c.primes = g_primes;
    c.n_primes = 1;
    c.offsets = g_offsets;
    c.n_offsets = 1;
    c.max_tokens = A_MAX_TOKENS;
    c.max_seqs = 2;
    c.max_positions = 16;
    return c;
}

static engram_layer_weights weights(void) {
    engram_layer_weights w;
    engram_layer_weights_init(&w);
    w.layer_id = A_LAYER;
    w.table_type = ENGRAM_TYPE_BF16;
    w.table = g_table;
    w.table_rows = A_ROWS;
    w.wkv = g_wkv;
    w.wkv_type = ENGRAM_TYPE_F32;
    w.q = g_q;
    w.k = g_k;
    w.qk_type = ENGRAM_TYPE_F32;
    return w;
}

/* The message of the last failure names `a` and `b` (as decimal numbers). */
static int names_both(size_t a, size_t b) {
    char sa[32], sb[32];
    snprintf(sa, sizeof sa, "%zu", a);
    snprintf(sb, sizeof sb, "%zu", b);
    const char *m = engram_last_error();
    return strstr(m, sa) != NULL && strstr(m, sb) != NULL;
}

/* The checked calls' args structs: `fill(buf, size)` is the struct's
 * `_init_sized`; `full` its size in this header. */
static void apply_args_fill(void *p, size_t n) { engram_apply_args_init_sized((engram_apply_args *)p, n); }
static void read_back_args_fill(void *p, size_t n) {
    engram_read_back_args_init_sized((engram_read_back_args *)p, n);
}
static void cache_stats_fill(void *p, size_t n) { engram_cache_stats_init_sized((engram_cache_stats *)p, n); }

static void check_args_init_sized(const char *name, void (*fill)(void *, size_t), size_t full) {
    unsigned char buf[256];
    if (!check(full + 16 <= sizeof buf, "%s: fits the test's buffer", name)) return;
    size_t ss;
    /* The first 16 bytes only: struct_size says 16, nothing past them is written. */
    memset(buf, 0xCD, sizeof buf);
    fill(buf, 16);
    memcpy(&ss, buf, sizeof ss);
    int untouched = 1;
    for (size_t i = 16; i < sizeof buf; i++) untouched &= buf[i] == 0xCD;
    check(ss == 16 && untouched, "%s(16): struct_size 16 (%zu), nothing past 16 bytes written", name, ss);
    /* Larger than this library's struct: only `full` bytes are written. */
    memset(buf, 0xCD, sizeof buf);
    fill(buf, full + 16);
    memcpy(&ss, buf, sizeof ss);
    untouched = 1;
    for (size_t i = full; i < sizeof buf; i++) untouched &= buf[i] == 0xCD;
    check(ss == full && untouched, "%s(larger): struct_size is the library's %zu (%zu), nothing past it written",
          name, full, ss);
    /* Too small to hold struct_size, and NULL: nothing happens. */
    memset(buf, 0xCD, sizeof buf);
    fill(buf, 4);
    check(buf[0] == 0xCD && buf[3] == 0xCD && buf[4] == 0xCD, "%s(4): nothing written", name);
    fill(NULL, full);
    check(1, "%s(NULL): no crash", name);
}

static void test_init_sized(void) {
    /* A caller whose struct is only the first 16 bytes: nothing past them is written. */
    unsigned char buf[sizeof(engram_config) + 16];
    memset(buf, 0xCD, sizeof buf);
    engram_config_init_sized((engram_config *)(void *)buf, 16);
    size_t ss;
    memcpy(&ss, buf, sizeof ss);
    check(ss == 16, "config_init_sized(16): struct_size says what was written (%zu)", ss);
    int untouched = 1;
    for (size_t i = 16; i < sizeof buf; i++) untouched &= buf[i] == 0xCD;
    check(untouched, "config_init_sized(16): no byte past the caller's 16 is written");
    /* Larger than this library's struct: only sizeof(engram_config) is written. */
    memset(buf, 0xCD, sizeof buf);
    engram_config_init_sized((engram_config *)(void *)buf, sizeof buf);
    memcpy(&ss, buf, sizeof ss);
    check(ss == sizeof(engram_config), "config_init_sized(larger): struct_size is the library's %zu", ss);
    untouched = 1;
    for (size_t i = sizeof(engram_config); i < sizeof buf; i++) untouched &= buf[i] == 0xCD;
    check(untouched, "config_init_sized(larger): nothing past the library's struct is written");
    /* Too small to hold struct_size, and NULL: nothing happens. */
    memset(buf, 0xCD, sizeof buf);
    engram_config_init_sized((engram_config *)(void *)buf, 4);
    check(buf[0] == 0xCD && buf[3] == 0xCD, "config_init_sized(4): nothing written");
    engram_config_init_sized(NULL, sizeof(engram_config));
    engram_layer_weights_init_sized(NULL, sizeof(engram_layer_weights));
    engram_gguf_options_init_sized(NULL, sizeof(engram_gguf_options));
    check(1, "*_init_sized(NULL): no crash");
    /* The inline helpers fill the defaults of this header's structs. */
    engram_config c;
    engram_config_init(&c);
    check(c.struct_size == sizeof c && c.backend == ENGRAM_BACKEND_CPU && c.n_threads == 1 && c.eps == 1e-6f,
          "engram_config_init: struct_size, CPU backend, one thread, eps 1e-6");
    engram_gguf_options o;
    engram_gguf_options_init(&o);
    check(o.struct_size == sizeof o && o.max_tokens == 4096 && o.mmap_tables == 0,
          "engram_gguf_options_init: struct_size and the documented defaults");
    check_args_init_sized("engram_apply_args_init_sized", apply_args_fill, sizeof(engram_apply_args));
    check_args_init_sized("engram_read_back_args_init_sized", read_back_args_fill, sizeof(engram_read_back_args));
    check_args_init_sized("engram_cache_stats_init_sized", cache_stats_fill, sizeof(engram_cache_stats));
    engram_apply_args a;
    engram_apply_args_init(&a);
    engram_read_back_args r;
    engram_read_back_args_init(&r);
    check(a.struct_size == sizeof a && a.row_ids == NULL && a.highway == NULL && r.struct_size == sizeof r,
          "engram_apply_args_init / engram_read_back_args_init: struct_size and NULL buffers");
}

static void test_struct_size(void) {
    engram_context *ctx = (engram_context *)(uintptr_t)0x1;
    engram_config c = config();
    /* A newer header's larger config. */
    c.struct_size = sizeof c + 8;
    int st = (int)engram_create(&c, &ctx);
    check(st == ENGRAM_STATUS_ERR_STRUCT_SIZE, "create: struct_size %zu (larger): ERR_STRUCT_SIZE (got %d)",
          c.struct_size, st);
    check(names_both(sizeof c + 8, sizeof c), "create: the message names both sizes: \"%s\"", engram_last_error());
    check(ctx == (engram_context *)(uintptr_t)0x1, "create: *out untouched");
    /* Smaller than the oldest layout this library reads. */
    c.struct_size = 8;
    st = (int)engram_create(&c, &ctx);
    check(st == ENGRAM_STATUS_ERR_STRUCT_SIZE, "create: struct_size 8: ERR_STRUCT_SIZE (got %d)", st);
    check(names_both(8, sizeof c), "create: the message names both sizes: \"%s\"", engram_last_error());

    c = config();
    ctx = NULL;
    st = (int)engram_create(&c, &ctx);
    if (!check(st == ENGRAM_STATUS_OK && ctx, "create: the tiny model")) {
        note("%d: %s", st, engram_last_error());
        return;
    }
    engram_layer_weights w = weights();
    w.struct_size = sizeof w + 16;
    st = (int)engram_set_layer(ctx, &w);
    check(st == ENGRAM_STATUS_ERR_STRUCT_SIZE, "set_layer: struct_size %zu (larger): ERR_STRUCT_SIZE (got %d)",
          w.struct_size, st);
    check(names_both(sizeof w + 16, sizeof w), "set_layer: the message names both sizes: \"%s\"",
          engram_last_error());
    int64_t ids[2];
    float hw[A_HC * A_D];
    memset(hw, 0, sizeof hw);
    const int32_t tok[1] = {3}, seq[1] = {0}, pos[1] = {0};
    if (check(engram_hash(ctx, tok, seq, pos, 1, ids, 2) == ENGRAM_STATUS_OK, "hash one token")) {
        st = (int)engram_apply(ctx, A_LAYER, ids, 1, hw, ENGRAM_TYPE_F32, NULL);
        check(st == ENGRAM_STATUS_ERR_NO_WEIGHTS, "after the refused set_layer the layer is still unset (got %d)", st);
    }
    engram_free(ctx);

    engram_gguf_options o;
    engram_gguf_options_init(&o);
    o.struct_size = sizeof o + 4;
    ctx = (engram_context *)(uintptr_t)0x1;
    st = (int)engram_create_from_gguf("/nonexistent.gguf", &o, &ctx);
    check(st == ENGRAM_STATUS_ERR_STRUCT_SIZE, "create_from_gguf: struct_size larger: ERR_STRUCT_SIZE (got %d)",
          st);
    check(names_both(sizeof o + 4, sizeof o), "create_from_gguf: the message names both sizes: \"%s\"",
          engram_last_error());
    check(ctx == (engram_context *)(uintptr_t)0x1, "create_from_gguf: *out untouched");
}

/* An uninitialised struct (issue 34): a struct_size no header of ours could
   have had is told apart from a newer header's, and the message names the
   _init call; a plausible newer size still says "newer". */
static int says_uninitialised(const char *init) {
    const char *m = engram_last_error();
    return strstr(m, "uninitialised") != NULL && strstr(m, init) != NULL && strstr(m, "newer") == NULL;
}

static void test_garbage_struct_size(void) {
    const size_t garbage[] = {0, 3, (size_t)0xDEADBEEFDEADBEEFull, (size_t)0xABABABABABABABABull, 1u << 20,
                              sizeof(engram_config) + 1};
    for (size_t i = 0; i < sizeof garbage / sizeof garbage[0]; i++) {
        engram_context *ctx = (engram_context *)(uintptr_t)0x1;
        engram_config c = config();
        c.struct_size = garbage[i];
        int st = (int)engram_create(&c, &ctx);
        check(st == ENGRAM_STATUS_ERR_STRUCT_SIZE && says_uninitialised("engram_config_init()") &&
                  ctx == (engram_context *)(uintptr_t)0x1,
              "create: struct_size %zu: ERR_STRUCT_SIZE, \"looks uninitialised\", names engram_config_init (got %d: "
              "%s)",
              garbage[i], st, engram_last_error());
    }
    engram_config c = config();
    c.struct_size = sizeof c + 8;
    engram_context *ctx = NULL;
    int st = (int)engram_create(&c, &ctx);
    check(st == ENGRAM_STATUS_ERR_STRUCT_SIZE && strstr(engram_last_error(), "newer") != NULL &&
              strstr(engram_last_error(), "uninitialised") == NULL,
          "create: struct_size sizeof + 8 (a newer header): still \"newer\" (got %d: %s)", st, engram_last_error());
    /* Every options struct names its own _init. */
    engram_gguf_options o;
    memset(&o, 0xAB, sizeof o);
    st = (int)engram_create_from_gguf("/nonexistent.gguf", &o, &ctx);
    check(st == ENGRAM_STATUS_ERR_STRUCT_SIZE && says_uninitialised("engram_gguf_options_init()"),
          "create_from_gguf with an uninitialised options struct: names engram_gguf_options_init (got %d: %s)", st,
          engram_last_error());
    engram_safetensors_options so;
    memset(&so, 0xAB, sizeof so);
    st = (int)engram_create_from_safetensors("/nonexistent", &so, &ctx);
    check(st == ENGRAM_STATUS_ERR_STRUCT_SIZE && says_uninitialised("engram_safetensors_options_init()"),
          "create_from_safetensors with an uninitialised options struct: names its init (got %d: %s)", st,
          engram_last_error());
}

/* Run a failing read-back; the buffers must be untouched. */
static void read_back_fails(engram_context *ctx, uint32_t layer, const int64_t *ids, uint32_t n, uint16_t *rows,
                            size_t rows_cap, uint16_t *kv, size_t kv_cap, int want, const char *what) {
    static uint16_t r0[A_MAX_TOKENS * 2 * A_KIN], k0[A_MAX_TOKENS * 2 * A_KOUT];
    size_t rn = rows && rows_cap ? (rows_cap < sizeof r0 / 2 ? rows_cap : sizeof r0 / 2) : 0;
    size_t kn = kv && kv_cap ? (kv_cap < sizeof k0 / 2 ? kv_cap : sizeof k0 / 2) : 0;
    if (rn) memcpy(r0, rows, rn * 2);
    if (kn) memcpy(k0, kv, kn * 2);
    int st = (int)engram_read_back(ctx, layer, ids, n, rows, rows_cap, kv, kv_cap);
    check(st == want, "read_back: %s: status %d (got %d: %s)", what, want, st, engram_last_error());
    check(strlen(engram_last_error()) > 0, "read_back: %s: a message", what);
    check((!rn || memcmp(r0, rows, rn * 2) == 0) && (!kn || memcmp(k0, kv, kn * 2) == 0),
          "read_back: %s: the buffers are untouched", what);
}

static void test_read_back(void) {
    engram_config c = config();
    engram_context *ctx = NULL;
    if (!check(engram_create(&c, &ctx) == ENGRAM_STATUS_OK, "read_back: create")) return;
    const int32_t tok[3] = {3, -1, 9}, seq[3] = {0, 0, 0}, pos[3] = {0, 1, 2};
    int64_t ids[3];
    if (!check(engram_hash(ctx, tok, seq, pos, 3, ids, 3) == ENGRAM_STATUS_OK, "read_back: hash")) {
        engram_free(ctx);
        return;
    }
    uint16_t rows[3 * A_KIN], kv[3 * A_KOUT];
    memset(rows, 0x5A, sizeof rows);
    memset(kv, 0x5A, sizeof kv);
    read_back_fails(ctx, A_LAYER, ids, 3, rows, 3 * A_KIN, kv, 3 * A_KOUT, ENGRAM_STATUS_ERR_NO_WEIGHTS,
                    "layer never set");
    engram_layer_weights w = weights();
    if (!check(engram_set_layer(ctx, &w) == ENGRAM_STATUS_OK, "read_back: set_layer")) {
        engram_free(ctx);
        return;
    }
    int st = (int)engram_read_back(ctx, A_LAYER, ids, 3, rows, 3 * A_KIN, kv, 3 * A_KOUT);
    if (check(st == ENGRAM_STATUS_OK, "read_back: three tokens (one dead): ok (%s)", engram_last_error())) {
        /* Token 0's rows are row ids[0] of the table, bit for bit; the dead
         * token's values are zero; kv is the rows times wkv, rounded to bf16. */
        check(memcmp(rows, g_table + ids[0] * A_HD, A_KIN * 2) == 0, "read_back: token 0's row is the table's row %lld",
              (long long)ids[0]);
        check(memcmp(rows + 2 * A_KIN, g_table + ids[2] * A_HD, A_KIN * 2) == 0, "read_back: token 2's row");
        int zero = 1;
        for (uint32_t i = 0; i < A_KIN; i++) zero &= rows[A_KIN + i] == 0;
        for (uint32_t o = 0; o < A_KOUT; o++) zero &= kv[A_KOUT + o] == 0;
        check(ids[1] == ENGRAM_ROW_ID_DEAD && zero, "read_back: the dead token's rows and kv are zero");
        int kv_ok = 1;
        for (uint32_t o = 0; o < A_KOUT; o++) {
            double s = 0.0;
            for (uint32_t i = 0; i < A_KIN; i++) {
                uint32_t b = (uint32_t)g_table[ids[0] * A_HD + i] << 16;
                float r;
                memcpy(&r, &b, 4);
                s += (double)r * (double)g_wkv[o * A_KIN + i];
            }
            /* every product and partial sum here is a small dyadic number: exact in f32 */
            kv_ok &= kv[o] == bf16_of((float)s);
        }
        check(kv_ok, "read_back: token 0's kv equals bf16(rows . wkv) (exact for these dyadic values)");
    }
    memset(rows, 0x5A, sizeof rows);
    memset(kv, 0x5A, sizeof kv);
    read_back_fails(NULL, A_LAYER, ids, 3, rows, 3 * A_KIN, kv, 3 * A_KOUT, ENGRAM_STATUS_ERR_NULL_ARGUMENT,
                    "NULL ctx");
    read_back_fails(ctx, 6, ids, 3, rows, 3 * A_KIN, kv, 3 * A_KOUT, ENGRAM_STATUS_ERR_UNKNOWN_LAYER,
                    "unknown layer 6");
    read_back_fails(ctx, A_LAYER, NULL, 3, rows, 3 * A_KIN, kv, 3 * A_KOUT, ENGRAM_STATUS_ERR_NULL_ARGUMENT,
                    "NULL row_ids");
    read_back_fails(ctx, A_LAYER, ids, 3, NULL, 3 * A_KIN, kv, 3 * A_KOUT, ENGRAM_STATUS_ERR_NULL_ARGUMENT,
                    "NULL rows");
    read_back_fails(ctx, A_LAYER, ids, 3, rows, 3 * A_KIN, NULL, 3 * A_KOUT, ENGRAM_STATUS_ERR_NULL_ARGUMENT,
                    "NULL kv");
    read_back_fails(ctx, A_LAYER, ids, 3, rows, 3 * A_KIN - 1, kv, 3 * A_KOUT, ENGRAM_STATUS_ERR_INVALID_ARGUMENT,
                    "rows one value short");
    read_back_fails(ctx, A_LAYER, ids, 3, rows, 3 * A_KIN, kv, 3 * A_KOUT - 1, ENGRAM_STATUS_ERR_INVALID_ARGUMENT,
                    "kv one value short");
    read_back_fails(ctx, A_LAYER, (const int64_t *)((const char *)ids + 1), 2, rows, 3 * A_KIN, kv, 3 * A_KOUT,
                    ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "misaligned row_ids");
    read_back_fails(ctx, A_LAYER, (const int64_t *)((const char *)ids), 3, (uint16_t *)((char *)rows + 1),
                    3 * A_KIN - 1, kv, 3 * A_KOUT, ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "misaligned rows");
    {
        int64_t big[(A_MAX_TOKENS + 1) * A_C];
        for (uint32_t i = 0; i < A_MAX_TOKENS + 1; i++) big[i] = ids[0];
        static uint16_t br[(A_MAX_TOKENS + 1) * A_KIN], bk[(A_MAX_TOKENS + 1) * A_KOUT];
        read_back_fails(ctx, A_LAYER, big, A_MAX_TOKENS + 1, br, sizeof br / 2, bk, sizeof bk / 2,
                        ENGRAM_STATUS_ERR_CAPACITY, "max_tokens + 1 tokens");
    }
    {
        int64_t bad[3] = {ids[0], A_ROWS, ids[2]};
        read_back_fails(ctx, A_LAYER, bad, 3, rows, 3 * A_KIN, kv, 3 * A_KOUT, ENGRAM_STATUS_ERR_INVALID_ROW_ID,
                        "a row id past the table");
        bad[1] = -7;
        read_back_fails(ctx, A_LAYER, bad, 3, rows, 3 * A_KIN, kv, 3 * A_KOUT, ENGRAM_STATUS_ERR_INVALID_ROW_ID,
                        "a negative row id");
    }
    st = (int)engram_read_back(ctx, A_LAYER, NULL, 0, NULL, 0, NULL, 0);
    check(st == ENGRAM_STATUS_OK, "read_back: zero tokens with NULL buffers is ok (got %d)", st);
    engram_free(ctx);
}

int main(void) {
    init_model();
    test_init_sized();
    test_struct_size();
    test_garbage_struct_size();
    test_read_back();
    return check_summary("test_abi");
}
