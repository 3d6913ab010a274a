/*
 * The tiny golden model through the C ABI: create -> set_layer (both layers)
 * -> hash -> apply -> free, for every regime of tests/golden/data/tiny.json,
 * compared with the Python reference (gen.py). The JSON is converted to a plain
 * whitespace format by tests/golden/c_fixture.py; argv[1] is that file.
 *
 * What is checked, per regime and call:
 *   - hash row ids: exactly equal to the golden;
 *   - apply, per layer, on its own fresh copy of the call's highway input
 *     (value("{regime}.{call}.highway", i, 1.0, 0.0)), f32 and bf16 highways:
 *     within the bounds below; dead tokens bit-identical to the input.
 * plus the filler self-check, rollback's straight_ids, and that a
 * multi-threaded context gives bit-identical results to a single-threaded one.
 *
 * Bounds. The Rust tests hold the tight bounds derived from the reference's
 * rounding (kv accumulated exactly in float64 then rounded, vs the library's
 * f32 accumulation); here the bounds are deliberately loose but principled:
 *   f32 highway:  |out - ref| <= 2^-6 * (1 + |ref|)
 *   bf16 highway: |out - ref| <= 2 * ulp_bf16(ref) + 2^-6
 * Why these hold for a correct library: out = x + gate * value with
 * 0 < gate < 1. The library accumulates kv in f32, the reference exactly (in
 * float64) before the same bf16 rounding, so the library's value can land one
 * bf16 ulp away where the f32 sum sits next to a rounding boundary (at most
 * 2^-7 * |value|, and |value| <= 3 in this model: < 2^-6), or 1-2 ulps where
 * the sum cancels, i.e. where |value| and its ulp are small anyway; the keys
 * move the same way and move the gate by far less. So |out - ref| stays well
 * below 2^-6 for f32 (plus f32 rounding, ~2^-24 * |ref|), and bf16 adds one
 * final rounding of the output (1 ulp of ref; 2 allowed). In practice the
 * worst error is a few thousandths of the f32 bound (printed at the end).
 * Why they still catch a wrong formula: the engram term gate * value is large
 * here (median |value| ~0.3, up to 3), so each of these mutations, replayed
 * in Python on the golden's own kv and highway input, breaks the bound in
 * every one of the 32 (call, layer) pairs: gate fixed at 0.5, a missing sqrt,
 * a missing sigmoid, a missing 1/sqrt(D), a missing rstd(x) or rstd(key), the
 * next stream's key, the first kv slice as the value; q instead of q*k breaks
 * it in 24 of 32, and even a gate off by just +0.01 in 9 of 32. The test
 * prints the largest error it saw as a fraction of the bound so a shrinking
 * margin is visible.
 */
#include "engram.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "filler.h"

/* ------------------------------------------------------------------------ */
/* Fixture reader: records "name count v1 ... v_count", in a fixed order.     */

typedef struct {
    FILE *f;
    const char *path;
} fixture;

static void fx_die(const fixture *fx, const char *what, const char *key) {
    fprintf(stderr, "FAIL fixture %s: %s (record \"%s\")\n", fx->path, what, key);
    printf("FAIL fixture %s: %s (record \"%s\")\n", fx->path, what, key);
    exit(2);
}

static void fx_word_raw(fixture *fx, char *buf, size_t cap, const char *key) {
    char fmt[16];
    snprintf(fmt, sizeof fmt, "%%%zus", cap - 1);
    if (fscanf(fx->f, fmt, buf) != 1) fx_die(fx, "unexpected end of file", key);
}

/* Read record `key`; returns its count and (if vals) a malloc'd u64 array
 * (negative decimal values come back as their two's complement bits). */
static size_t fx_ints(fixture *fx, const char *key, uint64_t **vals) {
    char name[128], tok[64];
    fx_word_raw(fx, name, sizeof name, key);
    if (strcmp(name, key) != 0) fx_die(fx, "unexpected record name", key);
    fx_word_raw(fx, tok, sizeof tok, key);
    char *end = NULL;
    size_t n = (size_t)strtoull(tok, &end, 10);
    if (*end) fx_die(fx, "bad count", key);
    uint64_t *v = (uint64_t *)filler_alloc((n ? n : 1) * sizeof(uint64_t));
    for (size_t i = 0; i < n; i++) {
        fx_word_raw(fx, tok, sizeof tok, key);
        end = NULL;
        if (tok[0] == '-') {
            v[i] = (uint64_t)strtoll(tok, &end, 10);
        } else {
            v[i] = (uint64_t)strtoull(tok, &end, 10);
        }
        if (*end) fx_die(fx, "bad integer", key);
    }
    if (vals) {
        *vals = v;
    } else {
        free(v);
    }
    return n;
}

static uint64_t fx_int(fixture *fx, const char *key) {
    uint64_t *v;
    if (fx_ints(fx, key, &v) != 1) fx_die(fx, "expected one value", key);
    uint64_t x = v[0];
    free(v);
    return x;
}

static void fx_word(fixture *fx, const char *key, char *buf, size_t cap) {
    char name[128], tok[32];
    fx_word_raw(fx, name, sizeof name, key);
    if (strcmp(name, key) != 0) fx_die(fx, "unexpected record name", key);
    fx_word_raw(fx, tok, sizeof tok, key);
    if (strcmp(tok, "1") != 0) fx_die(fx, "expected one word", key);
    fx_word_raw(fx, buf, cap, key);
}

/* ------------------------------------------------------------------------ */
/* The model                                                                  */

typedef struct {
    uint32_t d, hc, hd, h, n, c, n_layers;
    float eps;
    uint32_t layer_ids[8];
    int32_t *token_map;
    size_t token_map_len;
    int64_t pad_id;
    uint64_t *multipliers, *primes, *offsets;
    size_t n_mult, n_primes, n_offsets;
    uint64_t rows[8];
    uint32_t table_format[8], wkv_dtype[8], qk_dtype[8];
    /* Weights, built once from the filler. */
    void *table[8], *wkv[8], *q[8], *k[8];
} model;

static void to_u32(const uint64_t *v, size_t n, uint32_t *out) {
    for (size_t i = 0; i < n; i++) out[i] = (uint32_t)v[i];
}

static void read_model(fixture *fx, model *m) {
    uint64_t *v;
    size_t n;
    if (fx_int(fx, "engram_c_fixture") != 1) fx_die(fx, "unknown fixture version", "engram_c_fixture");
    m->d = (uint32_t)fx_int(fx, "D");
    m->hc = (uint32_t)fx_int(fx, "hc");
    m->hd = (uint32_t)fx_int(fx, "Hd");
    m->h = (uint32_t)fx_int(fx, "H");
    m->n = (uint32_t)fx_int(fx, "N");
    m->c = (uint32_t)fx_int(fx, "C");
    (void)fx_int(fx, "vocab");
    (void)fx_int(fx, "pad_token_id");
    m->pad_id = (int64_t)fx_int(fx, "pad_id");
    m->eps = f32_from_bits((uint32_t)fx_int(fx, "eps_f32"));
    n = fx_ints(fx, "layer_ids", &v);
    if (n == 0 || n > 8) fx_die(fx, "bad layer count", "layer_ids");
    m->n_layers = (uint32_t)n;
    to_u32(v, n, m->layer_ids);
    free(v);
    n = fx_ints(fx, "token_map", &v);
    m->token_map_len = n;
    m->token_map = (int32_t *)filler_alloc(n * sizeof(int32_t));
    for (size_t i = 0; i < n; i++) m->token_map[i] = (int32_t)(int64_t)v[i];
    free(v);
    m->n_mult = fx_ints(fx, "multipliers", &m->multipliers);
    m->n_primes = fx_ints(fx, "primes", &m->primes);
    m->n_offsets = fx_ints(fx, "offsets", &m->offsets);
    if (fx_ints(fx, "rows", &v) != m->n_layers) fx_die(fx, "bad count", "rows");
    memcpy(m->rows, v, m->n_layers * sizeof(uint64_t));
    free(v);
    if (fx_ints(fx, "table_format", &v) != m->n_layers) fx_die(fx, "bad count", "table_format");
    to_u32(v, m->n_layers, m->table_format);
    free(v);
    if (fx_ints(fx, "wkv_dtype", &v) != m->n_layers) fx_die(fx, "bad count", "wkv_dtype");
    to_u32(v, m->n_layers, m->wkv_dtype);
    free(v);
    if (fx_ints(fx, "qk_dtype", &v) != m->n_layers) fx_die(fx, "bad count", "qk_dtype");
    to_u32(v, m->n_layers, m->qk_dtype);
    free(v);
}

/* The filler's own self-check against the values gen.py wrote. */
static void check_filler(fixture *fx) {
    char name[64];
    uint64_t *b, *u, *val;
    fx_word(fx, "check_name", name, sizeof name);
    size_t nb = fx_ints(fx, "check_bits", &b);
    size_t nu = fx_ints(fx, "check_unit_f32", &u);
    float scale = f32_from_bits((uint32_t)fx_int(fx, "check_value_scale_f32"));
    float offset = f32_from_bits((uint32_t)fx_int(fx, "check_value_offset_f32"));
    size_t nv = fx_ints(fx, "check_value_f32", &val);
    int ok = nb == 4 && nu == 4 && nv == 4;
    for (size_t i = 0; ok && i < 4; i++) {
        if (bits(name, i) != b[i]) ok = 0;
        if (f32_bits(unit(name, i)) != (uint32_t)u[i]) ok = 0;
        if (f32_bits(value(name, i, scale, offset)) != (uint32_t)val[i]) ok = 0;
    }
    check(ok, "filler: bits/unit/value(\"%s\", 0..4) match the golden's filler_check", name);
    /* bf16 round-to-nearest-even corner cases. */
    check(bf16(1.0f) == 0x3f80 && bf16(f32_from_bits(0x3f808000u)) == 0x3f80 &&
              bf16(f32_from_bits(0x3f818000u)) == 0x3f82 &&
              bf16(f32_from_bits(0x3f808001u)) == 0x3f81 &&
              bf16(f32_from_bits(0x7f7fffffu)) == 0x7f80 && (bf16(NAN) & 0x7fff) > 0x7f80,
          "filler: bf16() rounds to nearest, ties to even");
    free(b);
    free(u);
    free(val);
}

static void build_weights(model *m) {
    size_t kv_out = (size_t)m->d * (m->hc + 1), kv_in = (size_t)m->c * m->hd;
    for (uint32_t l = 0; l < m->n_layers; l++) {
        char name[128];
        uint32_t lid = m->layer_ids[l];
        table_name(name, sizeof name, lid);
        switch (m->table_format[l]) {
        case ENGRAM_TYPE_FP8_E4M3_E8M0:
            m->table[l] = build_table_fp8(name, m->rows[l], m->hd);
            break;
        case ENGRAM_TYPE_BF16:
            m->table[l] = build_table_bf16(name, m->rows[l], m->hd);
            break;
        case ENGRAM_TYPE_F32:
            m->table[l] = build_table_f32(name, m->rows[l], m->hd);
            break;
        default:
            fprintf(stderr, "unknown table format %u\n", m->table_format[l]);
            exit(2);
        }
        int wb = m->wkv_dtype[l] == ENGRAM_TYPE_BF16, qb = m->qk_dtype[l] == ENGRAM_TYPE_BF16;
        m->wkv[l] = build_wkv(lid, kv_out, kv_in, wb);
        m->q[l] = build_qk(lid, "q", m->hc, m->d, qb);
        m->k[l] = build_qk(lid, "k", m->hc, m->d, qb);
    }
}

static void free_model(model *m) {
    for (uint32_t l = 0; l < m->n_layers; l++) {
        free(m->table[l]);
        free(m->wkv[l]);
        free(m->q[l]);
        free(m->k[l]);
    }
    free(m->token_map);
    free(m->multipliers);
    free(m->primes);
    free(m->offsets);
}

#define MAX_TOKENS 16

static engram_context *make_ctx(const model *m, uint32_t n_threads, const char *what) {
    engram_config cfg;
    engram_config_init(&cfg);
    cfg.backend = ENGRAM_BACKEND_CPU;
    cfg.hidden_size = m->d;
    cfg.hc = m->hc;
    cfg.head_dim = m->hd;
    cfg.n_heads = m->h;
    cfg.max_ngram = m->n;
    cfg.eps = m->eps;
    cfg.layer_ids = m->layer_ids;
    cfg.n_layers = m->n_layers;
    cfg.token_map = m->token_map;
    cfg.token_map_len = m->token_map_len;
    cfg.pad_id = m->pad_id;
    cfg.multipliers = m->multipliers;
    cfg.n_multipliers = m->n_mult;
    cfg.primes = m->primes;
    cfg.n_primes = m->n_primes;
    cfg.offsets = m->offsets;
    cfg.n_offsets = m->n_offsets;
    cfg.max_tokens = MAX_TOKENS;
    cfg.max_seqs = 2;
    cfg.max_positions = 64;
    cfg.n_threads = n_threads;
    engram_context *ctx = NULL;
    int st = (int)engram_create(&cfg, &ctx);
    if (!check(st == ENGRAM_STATUS_OK && ctx != NULL, "%s: engram_create (n_threads %u)", what,
               n_threads)) {
        note("status %d (%s): %s", st, engram_status_str(st), engram_last_error());
        return NULL;
    }
    check(engram_row_ids_per_token(ctx) == (size_t)m->n_layers * m->c,
          "%s: engram_row_ids_per_token = n_layers * C = %u", what, m->n_layers * m->c);
    for (uint32_t l = 0; l < m->n_layers; l++) {
        engram_layer_weights w;
        engram_layer_weights_init(&w);
        w.layer_id = m->layer_ids[l];
        w.table_type = m->table_format[l];
        w.table = m->table[l];
        w.table_rows = m->rows[l];
        w.wkv = m->wkv[l];
        w.wkv_type = m->wkv_dtype[l];
        w.q = m->q[l];
        w.k = m->k[l];
        w.qk_type = m->qk_dtype[l];
        st = (int)engram_set_layer(ctx, &w);
        if (!check(st == ENGRAM_STATUS_OK, "%s: engram_set_layer layer %u (table %u, wkv %u, qk %u)",
                   what, m->layer_ids[l], m->table_format[l], m->wkv_dtype[l], m->qk_dtype[l])) {
            note("status %d (%s): %s", st, engram_status_str(st), engram_last_error());
        }
    }
    return ctx;
}

/* ------------------------------------------------------------------------ */
/* Bounds                                                                     */

static double bf16_ulp(float ref) {
    uint32_t e = (f32_bits(ref) >> 23) & 0xffu;
    if (e == 0) e = 1; /* zero or subnormal: the smallest normal's ulp */
    return ldexp(1.0, (int)e - 127 - 7);
}

static double bound_f32(float ref) { return ldexp(1.0, -6) * (1.0 + fabs((double)ref)); }

static double bound_bf16(float ref) { return 2.0 * bf16_ulp(ref) + ldexp(1.0, -6); }

/* Largest |out - ref| / bound seen, over the whole run, per highway type. */
static double g_worst_f32 = 0.0, g_worst_bf16 = 0.0;
/* Count of outputs that differ from the reference at all (information only). */
static size_t g_inexact_f32 = 0, g_inexact_bf16 = 0, g_compared_f32 = 0, g_compared_bf16 = 0;

/* ------------------------------------------------------------------------ */
/* One regime                                                                 */

typedef struct {
    char highway_name[128];
    uint32_t n;
    int32_t tokens[MAX_TOKENS], seq_ids[MAX_TOKENS], pos[MAX_TOKENS];
    int dead[MAX_TOKENS];
    int64_t *ids;            /* [n, n_layers, C] */
    uint32_t *out_f32[8];    /* per layer [n, hc, D] */
    uint16_t *out_bf16[8];
    uint16_t *rows[8];       /* per layer [n, C*Hd], bf16 bits (zero for a dead token) */
    uint16_t *kv[8];         /* per layer [n, D*(hc+1)], bf16 bits (zero for a dead token) */
} call_data;

static void read_i32s(fixture *fx, const char *key, uint32_t n, int32_t *out) {
    uint64_t *v;
    if (fx_ints(fx, key, &v) != n) fx_die(fx, "bad count", key);
    for (uint32_t i = 0; i < n; i++) out[i] = (int32_t)(int64_t)v[i];
    free(v);
}

static void read_call(fixture *fx, const model *m, call_data *c) {
    uint64_t *v;
    fx_word(fx, "highway_name", c->highway_name, sizeof c->highway_name);
    size_t n = fx_ints(fx, "tokens", &v);
    if (n == 0 || n > MAX_TOKENS) fx_die(fx, "bad token count", "tokens");
    c->n = (uint32_t)n;
    for (size_t i = 0; i < n; i++) c->tokens[i] = (int32_t)(int64_t)v[i];
    free(v);
    read_i32s(fx, "seq_ids", c->n, c->seq_ids);
    read_i32s(fx, "pos", c->n, c->pos);
    int32_t dead[MAX_TOKENS];
    read_i32s(fx, "dead", c->n, dead);
    for (uint32_t i = 0; i < c->n; i++) c->dead[i] = dead[i] != 0;
    size_t per = (size_t)m->n_layers * m->c, hw = (size_t)c->n * m->hc * m->d;
    if (fx_ints(fx, "ids", &v) != c->n * per) fx_die(fx, "bad count", "ids");
    c->ids = (int64_t *)v;
    for (uint32_t l = 0; l < m->n_layers; l++) {
        if (fx_int(fx, "layer_id") != m->layer_ids[l]) fx_die(fx, "unexpected layer", "layer_id");
        if (fx_ints(fx, "highway_out_f32", &v) != hw) fx_die(fx, "bad count", "highway_out_f32");
        c->out_f32[l] = (uint32_t *)filler_alloc(hw * sizeof(uint32_t));
        to_u32(v, hw, c->out_f32[l]);
        free(v);
        if (fx_ints(fx, "highway_out_bf16", &v) != hw) fx_die(fx, "bad count", "highway_out_bf16");
        c->out_bf16[l] = (uint16_t *)filler_alloc(hw * sizeof(uint16_t));
        for (size_t i = 0; i < hw; i++) c->out_bf16[l][i] = (uint16_t)v[i];
        free(v);
        size_t nr = (size_t)c->n * m->c * m->hd, nk = (size_t)c->n * m->d * (m->hc + 1);
        if (fx_ints(fx, "rows_bf16", &v) != nr) fx_die(fx, "bad count", "rows_bf16");
        c->rows[l] = (uint16_t *)filler_alloc(nr * sizeof(uint16_t));
        for (size_t i = 0; i < nr; i++) c->rows[l][i] = (uint16_t)v[i];
        free(v);
        if (fx_ints(fx, "kv_bf16", &v) != nk) fx_die(fx, "bad count", "kv_bf16");
        c->kv[l] = (uint16_t *)filler_alloc(nk * sizeof(uint16_t));
        for (size_t i = 0; i < nk; i++) c->kv[l][i] = (uint16_t)v[i];
        free(v);
    }
}

static void free_call(const model *m, call_data *c) {
    free(c->ids);
    for (uint32_t l = 0; l < m->n_layers; l++) {
        free(c->out_f32[l]);
        free(c->out_bf16[l]);
        free(c->rows[l]);
        free(c->kv[l]);
    }
}

/* Results of one regime run, kept to compare thread counts bit for bit. */
typedef struct {
    size_t len;
    unsigned char *bytes;
} blob;

static void blob_add(blob *b, const void *p, size_t n) {
    unsigned char *nb = (unsigned char *)realloc(b->bytes, b->len + n);
    if (!nb) abort();
    memcpy(nb + b->len, p, n);
    b->bytes = nb;
    b->len += n;
}

/* Value i of layer l's wkv (bf16 or f32, as the model stores it). */
static double wkv_at(const model *m, uint32_t l, size_t i) {
    if (m->wkv_dtype[l] == ENGRAM_TYPE_F32) return (double)((const float *)m->wkv[l])[i];
    return (double)bf16_to_f32(((const uint16_t *)m->wkv[l])[i]);
}

/* engram_read_back for layer l: the gathered rows equal the golden's bit for
 * bit, a dead token's rows and kv are zero, and each kv value is within
 * (K+2) * 2^-24 * sum|row * w| + 1 bf16 ulp of the golden's (the library and
 * the golden sum the K = C*Hd products in different orders, f32 and f64, and
 * both round the sum to bf16; the same bound as tests/common/bounds.rs). */
static void check_read_back(engram_context *ctx, const model *m, const call_data *c, uint32_t l,
                            const int64_t *ids, const char *what) {
    uint32_t lid = m->layer_ids[l];
    size_t k_in = (size_t)m->c * m->hd, k_out = (size_t)m->d * (m->hc + 1);
    uint16_t *rows = (uint16_t *)filler_alloc(c->n * k_in * sizeof(uint16_t));
    uint16_t *kv = (uint16_t *)filler_alloc(c->n * k_out * sizeof(uint16_t));
    memset(rows, 0xAB, c->n * k_in * sizeof(uint16_t));
    memset(kv, 0xAB, c->n * k_out * sizeof(uint16_t));
    int st = (int)engram_read_back(ctx, lid, ids, c->n, rows, c->n * k_in, kv, c->n * k_out);
    if (!check(st == ENGRAM_STATUS_OK, "%s layer %u: engram_read_back", what, lid)) {
        note("status %d (%s): %s", st, engram_status_str(st), engram_last_error());
        free(rows);
        free(kv);
        return;
    }
    size_t rows_bad = 0, kv_bad = 0, dead_bad = 0, live = 0;
    double worst = 0.0;
    for (uint32_t t = 0; t < c->n; t++) {
        const uint16_t *rt = rows + t * k_in, *kt = kv + t * k_out;
        if (c->dead[t]) {
            for (size_t i = 0; i < k_in; i++) dead_bad += rt[i] != 0;
            for (size_t o = 0; o < k_out; o++) dead_bad += kt[o] != 0;
            continue;
        }
        const uint16_t *want_r = c->rows[l] + t * k_in, *want_k = c->kv[l] + t * k_out;
        rows_bad += memcmp(rt, want_r, k_in * sizeof(uint16_t)) != 0;
        for (size_t o = 0; o < k_out; o++) {
            double mag = 0.0;
            for (size_t i = 0; i < k_in; i++) mag += fabs((double)bf16_to_f32(want_r[i]) * wkv_at(m, l, o * k_in + i));
            float ref = bf16_to_f32(want_k[o]);
            double b = (double)(k_in + 2) * ldexp(1.0, -24) * mag + bf16_ulp(ref);
            double err = fabs((double)bf16_to_f32(kt[o]) - (double)ref);
            if (!(err <= b)) kv_bad++;
            if (b > 0 && err / b > worst) worst = err / b;
        }
        live++;
    }
    check(rows_bad == 0, "%s layer %u: read-back rows equal the golden bit for bit (%zu live tokens)", what,
          lid, live);
    check(kv_bad == 0, "%s layer %u: read-back kv within (K+2)*2^-24*sum|r*w| + 1 bf16 ulp (worst %.3g of the bound)",
          what, lid, worst);
    check(dead_bad == 0, "%s layer %u: read-back values of dead tokens are zero", what, lid);
    free(rows);
    free(kv);
}

/* Apply layer l to a fresh copy of the call's highway input in f32 and bf16
 * and compare with the golden. */
static void check_apply(engram_context *ctx, const model *m, const call_data *c, uint32_t l,
                        const int64_t *ids, const char *what, blob *results) {
    size_t per_tok = (size_t)m->hc * m->d, hw = (size_t)c->n * per_tok;
    uint32_t lid = m->layer_ids[l];
    float *in = (float *)build_values(c->highway_name, hw, 1.0, 0.0, 0);

    /* f32 highway */
    float *x = (float *)filler_alloc(hw * sizeof(float));
    memcpy(x, in, hw * sizeof(float));
    int st = (int)engram_apply(ctx, lid, ids, c->n, x, ENGRAM_TYPE_F32, NULL);
    if (check(st == ENGRAM_STATUS_OK, "%s layer %u: engram_apply (f32 highway)", what, lid)) {
        size_t bad = 0, first = (size_t)-1, dead_bad = 0, live = 0;
        double worst = 0.0;
        for (uint32_t t = 0; t < c->n; t++) {
            for (size_t j = 0; j < per_tok; j++) {
                size_t i = t * per_tok + j;
                if (c->dead[t]) {
                    if (f32_bits(x[i]) != f32_bits(in[i])) dead_bad++;
                    continue;
                }
                live++;
                float ref = f32_from_bits(c->out_f32[l][i]);
                double err = fabs((double)x[i] - (double)ref), b = bound_f32(ref);
                if (!(err <= b)) {
                    if (!bad) first = i;
                    bad++;
                }
                if (err / b > worst || err != err) worst = err / b;
                if (f32_bits(x[i]) != c->out_f32[l][i]) g_inexact_f32++;
                g_compared_f32++;
            }
        }
        if (worst > g_worst_f32) g_worst_f32 = worst;
        if (!check(bad == 0, "%s layer %u: f32 highway within 2^-6*(1+|ref|) (%zu live values, worst %.3g of the bound)",
                   what, lid, live, worst)) {
            note("%zu values out of bound; first at %zu: got %.9g (0x%08x), want %.9g (0x%08x), input %.9g",
                 bad, first, (double)x[first], f32_bits(x[first]),
                 (double)f32_from_bits(c->out_f32[l][first]), c->out_f32[l][first], (double)in[first]);
        }
        int any_dead = 0;
        for (uint32_t t = 0; t < c->n; t++) any_dead |= c->dead[t];
        if (any_dead) {
            check(dead_bad == 0, "%s layer %u: dead tokens' f32 highway bit-identical to the input", what, lid);
        }
        blob_add(results, x, hw * sizeof(float));
    } else {
        note("status %d (%s): %s", st, engram_status_str(st), engram_last_error());
    }
    free(x);

    /* bf16 highway: the input is bf16(x_f32) */
    uint16_t *xb = (uint16_t *)filler_alloc(hw * sizeof(uint16_t));
    uint16_t *inb = (uint16_t *)filler_alloc(hw * sizeof(uint16_t));
    for (size_t i = 0; i < hw; i++) inb[i] = xb[i] = bf16(in[i]);
    st = (int)engram_apply(ctx, lid, ids, c->n, xb, ENGRAM_TYPE_BF16, NULL);
    if (check(st == ENGRAM_STATUS_OK, "%s layer %u: engram_apply (bf16 highway)", what, lid)) {
        size_t bad = 0, first = (size_t)-1, dead_bad = 0, live = 0;
        double worst = 0.0;
        for (uint32_t t = 0; t < c->n; t++) {
            for (size_t j = 0; j < per_tok; j++) {
                size_t i = t * per_tok + j;
                if (c->dead[t]) {
                    if (xb[i] != inb[i] || xb[i] != c->out_bf16[l][i]) dead_bad++;
                    continue;
                }
                live++;
                float ref = bf16_to_f32(c->out_bf16[l][i]);
                double err = fabs((double)bf16_to_f32(xb[i]) - (double)ref), b = bound_bf16(ref);
                if (!(err <= b)) {
                    if (!bad) first = i;
                    bad++;
                }
                if (err / b > worst || err != err) worst = err / b;
                if (xb[i] != c->out_bf16[l][i]) g_inexact_bf16++;
                g_compared_bf16++;
            }
        }
        if (worst > g_worst_bf16) g_worst_bf16 = worst;
        if (!check(bad == 0, "%s layer %u: bf16 highway within 2 bf16 ulps + 2^-6 (%zu live values, worst %.3g of the bound)",
                   what, lid, live, worst)) {
            note("%zu values out of bound; first at %zu: got 0x%04x (%.6g), want 0x%04x (%.6g), input 0x%04x",
                 bad, first, xb[first], (double)bf16_to_f32(xb[first]), c->out_bf16[l][first],
                 (double)bf16_to_f32(c->out_bf16[l][first]), inb[first]);
        }
        int any_dead = 0;
        for (uint32_t t = 0; t < c->n; t++) any_dead |= c->dead[t];
        if (any_dead) {
            check(dead_bad == 0,
                  "%s layer %u: dead tokens' bf16 highway bit-identical to the input (and the golden)",
                  what, lid);
        }
        blob_add(results, xb, hw * sizeof(uint16_t));
    } else {
        note("status %d (%s): %s", st, engram_status_str(st), engram_last_error());
    }
    free(xb);
    free(inb);
    free(in);
}

typedef struct {
    char name[64];
    uint32_t n_calls;
    call_data calls[16];
    int32_t straight_tokens[MAX_TOKENS];
    uint32_t n_straight;
    int64_t *straight_ids;
} regime;

static void read_regime(fixture *fx, const model *m, regime *r) {
    fx_word(fx, "regime", r->name, sizeof r->name);
    uint64_t nc = fx_int(fx, "n_calls");
    if (nc == 0 || nc > 16) fx_die(fx, "bad call count", "n_calls");
    r->n_calls = (uint32_t)nc;
    for (uint32_t i = 0; i < r->n_calls; i++) read_call(fx, m, &r->calls[i]);
    uint64_t *v;
    size_t ns = fx_ints(fx, "straight_tokens", &v);
    if (ns > MAX_TOKENS) fx_die(fx, "too many tokens", "straight_tokens");
    r->n_straight = (uint32_t)ns;
    for (size_t i = 0; i < ns; i++) r->straight_tokens[i] = (int32_t)(int64_t)v[i];
    free(v);
    size_t ni = fx_ints(fx, "straight_ids", &v);
    if (ni != ns * m->n_layers * m->c) fx_die(fx, "bad count", "straight_ids");
    r->straight_ids = (int64_t *)v;
}

static void free_regime(const model *m, regime *r) {
    for (uint32_t i = 0; i < r->n_calls; i++) free_call(m, &r->calls[i]);
    free(r->straight_ids);
}

/* Run a regime from an empty history; results collects every output. */
static void run_regime(const model *m, const regime *r, uint32_t n_threads, blob *results) {
    char what[160];
    snprintf(what, sizeof what, "%s", r->name);
    engram_context *ctx = make_ctx(m, n_threads, what);
    if (!ctx) return;
    size_t per = (size_t)m->n_layers * m->c;
    for (uint32_t ci = 0; ci < r->n_calls; ci++) {
        const call_data *c = &r->calls[ci];
        snprintf(what, sizeof what, "%s call %u (%u tokens, n_threads %u)", r->name, ci, c->n, n_threads);
        size_t cap = (size_t)c->n * per;
        int64_t *ids = (int64_t *)filler_alloc(cap * sizeof(int64_t));
        for (size_t i = 0; i < cap; i++) ids[i] = INT64_MIN; /* sentinel */
        int st = (int)engram_hash(ctx, c->tokens, c->seq_ids, c->pos, c->n, ids, cap);
        if (check(st == ENGRAM_STATUS_OK, "%s: engram_hash", what)) {
            size_t bad = 0, first = 0;
            for (size_t i = 0; i < cap; i++) {
                if (ids[i] != c->ids[i]) {
                    if (!bad) first = i;
                    bad++;
                }
            }
            if (!check(bad == 0, "%s: hash ids equal the golden exactly (%zu ids)", what, cap)) {
                note("%zu ids differ; first at %zu (token %zu, layer %zu, column %zu): got %lld, want %lld",
                     bad, first, first / per, (first % per) / m->c, first % m->c,
                     (long long)ids[first], (long long)c->ids[first]);
            }
            size_t dead_ok = 1;
            for (uint32_t t = 0; t < c->n; t++) {
                for (size_t j = 0; j < per; j++) {
                    int is_dead = ids[t * per + j] == ENGRAM_ROW_ID_DEAD;
                    if (is_dead != c->dead[t]) dead_ok = 0;
                }
            }
            check(dead_ok, "%s: exactly the dead tokens get ENGRAM_ROW_ID_DEAD in every column", what);
            blob_add(results, ids, cap * sizeof(int64_t));
            for (uint32_t l = 0; l < m->n_layers; l++) {
                check_read_back(ctx, m, c, l, ids, what);
                check_apply(ctx, m, c, l, ids, what, results);
            }
        } else {
            note("status %d (%s): %s", st, engram_status_str(st), engram_last_error());
        }
        free(ids);
    }
    if (r->n_straight) {
        /* rollback: the straight tokens hashed as one fresh sequence (seq 1,
         * never touched by this regime) give straight_ids. */
        int32_t seq[MAX_TOKENS], pos[MAX_TOKENS];
        for (uint32_t i = 0; i < r->n_straight; i++) {
            seq[i] = 1;
            pos[i] = (int32_t)i;
        }
        size_t cap = (size_t)r->n_straight * per;
        int64_t *ids = (int64_t *)filler_alloc(cap * sizeof(int64_t));
        int st = (int)engram_hash(ctx, r->straight_tokens, seq, pos, r->n_straight, ids, cap);
        check(st == ENGRAM_STATUS_OK && memcmp(ids, r->straight_ids, cap * sizeof(int64_t)) == 0,
              "%s: the straight tokens hashed as a fresh sequence give straight_ids (n_threads %u)",
              r->name, n_threads);
        free(ids);
    }
    engram_free(ctx);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s tests/golden/data/c_fixture.txt\n", argv[0]);
        printf("FAIL test_golden: no fixture path given\n");
        return 2;
    }
    fixture fx;
    fx.path = argv[1];
    fx.f = fopen(argv[1], "r");
    if (!fx.f) {
        printf("FAIL test_golden: cannot open fixture %s\n", argv[1]);
        return 2;
    }
    model m;
    memset(&m, 0, sizeof m);
    read_model(&fx, &m);
    check(m.c == (m.n - 1) * m.h && m.n_mult == (size_t)m.n_layers * m.n &&
              m.n_primes == (size_t)m.n_layers * m.c && m.n_offsets == m.n_primes,
          "fixture: model geometry is consistent (C = (N-1)*H, table lengths)");
    check_filler(&fx);
    build_weights(&m);

    uint64_t n_regimes = fx_int(&fx, "n_regimes");
    for (uint64_t ri = 0; ri < n_regimes; ri++) {
        regime *r = (regime *)calloc(1, sizeof(regime));
        if (!r) abort();
        read_regime(&fx, &m, r);
        blob one, many;
        memset(&one, 0, sizeof one);
        memset(&many, 0, sizeof many);
        run_regime(&m, r, 1, &one);
        /* The same regime with 3 threads must give the same bits: each
         * projection output is one thread's sum in a fixed order. */
        run_regime(&m, r, 3, &many);
        check(one.len > 0 && one.len == many.len && memcmp(one.bytes, many.bytes, one.len) == 0,
              "%s: n_threads 3 gives bit-identical ids and highways to n_threads 1", r->name);
        free(one.bytes);
        free(many.bytes);
        free_regime(&m, r);
        free(r);
    }
    {
        char end[16];
        int ok = fscanf(fx.f, "%15s", end) == 1 && strcmp(end, "end") == 0;
        check(ok, "fixture: read through to the end record");
    }
    fclose(fx.f);
    printf("# worst error as a fraction of the bound: f32 %.4g, bf16 %.4g\n", g_worst_f32, g_worst_bf16);
    printf("# outputs not bit-equal to the golden: f32 %zu of %zu, bf16 %zu of %zu\n", g_inexact_f32,
           g_compared_f32, g_inexact_bf16, g_compared_bf16);
    free_model(&m);
    return check_summary("test_golden");
}
