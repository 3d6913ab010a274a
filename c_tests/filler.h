/*
 * The golden's deterministic filler and the tiny model's weights, in C.
 *
 * This is a transcription of tests/golden/README.md ("The filler" and "The tiny
 * model"); gen.py (Python) and tests/common/mod.rs (Rust) implement the same
 * thing. All integer arithmetic is on uint64_t, wrapping (unsigned overflow is
 * defined in C and C++).
 *
 * Header-only (every function is static inline) and valid as C11 and as C++17.
 */
#ifndef ENGRAM_C_TESTS_FILLER_H
#define ENGRAM_C_TESTS_FILLER_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FILLER_PREFIX "engram-golden-v1:"

static inline uint64_t fnv1a64_bytes(uint64_t h, const unsigned char *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        h ^= (uint64_t)p[i];
        h *= UINT64_C(0x100000001b3);
    }
    return h;
}

/* fnv1a64 of a byte string. */
static inline uint64_t fnv1a64(const void *bytes, size_t n) {
    return fnv1a64_bytes(UINT64_C(0xcbf29ce484222325), (const unsigned char *)bytes, n);
}

static inline uint64_t mix64(uint64_t z) {
    z += UINT64_C(0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

/* fnv1a64(utf8("engram-golden-v1:" + name)): the per-name part of bits(), to
 * hash a name once and draw many values from it. */
static inline uint64_t filler_name_hash(const char *name) {
    uint64_t h = fnv1a64(FILLER_PREFIX, strlen(FILLER_PREFIX));
    return fnv1a64_bytes(h, (const unsigned char *)name, strlen(name));
}

static inline uint64_t bits_h(uint64_t name_hash, uint64_t i) { return mix64(name_hash ^ mix64(i)); }

/* bits(name, i) = mix64(fnv1a64(utf8("engram-golden-v1:" + name)) ^ mix64(i)) */
static inline uint64_t bits(const char *name, uint64_t i) { return bits_h(filler_name_hash(name), i); }

/* unit = f32((bits >> 40) - 2^23) / 2^23: exact, in [-1, 1). */
static inline float unit_h(uint64_t name_hash, uint64_t i) {
    int32_t v = (int32_t)(bits_h(name_hash, i) >> 40) - (int32_t)(1 << 23);
    return (float)v / 8388608.0f;
}

static inline float unit(const char *name, uint64_t i) { return unit_h(filler_name_hash(name), i); }

/* value = f32(offset) + f32(scale) * unit: two f32 operations, no FMA. The
 * product goes through a volatile so that no compiler contracts it into an FMA
 * (with a power-of-two scale it is exact anyway; only the add rounds). */
static inline float value_h(uint64_t name_hash, uint64_t i, double scale, double offset) {
    volatile float prod = (float)scale * unit_h(name_hash, i);
    float p = prod;
    return (float)offset + p;
}

static inline float value(const char *name, uint64_t i, double scale, double offset) {
    return value_h(filler_name_hash(name), i, scale, offset);
}

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* bf16(x): round to nearest, ties to even; a NaN stays a (quiet) NaN. */
static inline uint16_t bf16(float x) {
    uint32_t u = f32_bits(x);
    if ((u & UINT32_C(0x7fffffff)) > UINT32_C(0x7f800000)) {
        return (uint16_t)((u >> 16) | 0x0040u);
    }
    u += UINT32_C(0x7fff) + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint16_t b) { return f32_from_bits((uint32_t)b << 16); }

/* ------------------------------------------------------------------------ */
/* The tiny model (README "The tiny model").                                 */

#define TINY_D 64
#define TINY_HC 4
#define TINY_HD 64
#define TINY_H 2
#define TINY_N 3
#define TINY_C ((TINY_N - 1) * TINY_H)
#define TINY_KV_IN (TINY_C * TINY_HD)            /* 256 */
#define TINY_KV_OUT (TINY_D * (TINY_HC + 1))     /* 320 */

static inline void *filler_alloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "filler: out of memory (%zu bytes)\n", n);
        abort();
    }
    return p;
}

/* fp8 table (ENGRAM_TYPE_FP8_E4M3_E8M0): per row `hd` e4m3 codes
 * `bits(name, r*hd + d) & 0xBF`, then `hd/32` e8m0 scale codes
 * `125 + bits(name + ".scale", r*(hd/32) + b) % 5`. Returns rows*(hd + hd/32) bytes. */
static inline uint8_t *build_table_fp8(const char *name, uint64_t rows, uint32_t hd) {
    char sname[256];
    snprintf(sname, sizeof sname, "%s.scale", name);
    uint64_t h = filler_name_hash(name), hs = filler_name_hash(sname);
    uint32_t nb = hd / 32, rb = hd + nb;
    uint8_t *t = (uint8_t *)filler_alloc((size_t)rows * rb);
    for (uint64_t r = 0; r < rows; r++) {
        uint8_t *row = t + r * rb;
        for (uint32_t d = 0; d < hd; d++) {
            row[d] = (uint8_t)(bits_h(h, r * hd + d) & 0xBFu);
        }
        for (uint32_t b = 0; b < nb; b++) {
            row[hd + b] = (uint8_t)(125u + bits_h(hs, r * nb + b) % 5u);
        }
    }
    return t;
}

/* bf16 table: bf16(value(name, r*hd + d, 1.0, 0.0)). */
static inline uint16_t *build_table_bf16(const char *name, uint64_t rows, uint32_t hd) {
    uint64_t h = filler_name_hash(name);
    uint16_t *t = (uint16_t *)filler_alloc((size_t)rows * hd * sizeof(uint16_t));
    for (uint64_t i = 0; i < rows * hd; i++) t[i] = bf16(value_h(h, i, 1.0, 0.0));
    return t;
}

/* f32 table: value(name, r*hd + d, 1.0, 0.0). */
static inline float *build_table_f32(const char *name, uint64_t rows, uint32_t hd) {
    uint64_t h = filler_name_hash(name);
    float *t = (float *)filler_alloc((size_t)rows * hd * sizeof(float));
    for (uint64_t i = 0; i < rows * hd; i++) t[i] = value_h(h, i, 1.0, 0.0);
    return t;
}

/* n values value(name, i, scale, offset), as f32 (as_bf16 = 0) or rounded to
 * bf16 (as_bf16 = 1). Returns a malloc'd float[n] or uint16_t[n]. */
static inline void *build_values(const char *name, size_t n, double scale, double offset, int as_bf16) {
    uint64_t h = filler_name_hash(name);
    if (as_bf16) {
        uint16_t *v = (uint16_t *)filler_alloc(n * sizeof(uint16_t));
        for (size_t i = 0; i < n; i++) v[i] = bf16(value_h(h, i, scale, offset));
        return v;
    }
    float *v = (float *)filler_alloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = value_h(h, i, scale, offset);
    return v;
}

/* wkv [D*(hc+1), C*Hd] row-major of layer `lid`: value("layers.{lid}.engram.wkv",
 * o*(C*Hd) + i, 2^-4, 0.0). kv_out = D*(hc+1), kv_in = C*Hd. */
static inline void *build_wkv(uint32_t lid, size_t kv_out, size_t kv_in, int as_bf16) {
    char name[128];
    snprintf(name, sizeof name, "layers.%u.engram.wkv", (unsigned)lid);
    return build_values(name, kv_out * kv_in, 0.0625, 0.0, as_bf16);
}

/* q or k [hc, D] of layer `lid` (which = "q" or "k"):
 * value("layers.{lid}.engram.{which}", s*D + d, 2^-3, 1.0). */
static inline void *build_qk(uint32_t lid, const char *which, size_t hc, size_t d, int as_bf16) {
    char name[128];
    snprintf(name, sizeof name, "layers.%u.engram.%s", (unsigned)lid, which);
    return build_values(name, hc * d, 0.125, 1.0, as_bf16);
}

/* The table name of layer `lid`: "layers.{lid}.engram.table". */
static inline void table_name(char *buf, size_t cap, uint32_t lid) {
    snprintf(buf, cap, "layers.%u.engram.table", (unsigned)lid);
}

#endif /* ENGRAM_C_TESTS_FILLER_H */
