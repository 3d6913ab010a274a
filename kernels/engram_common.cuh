// Shared by the engram CUDA kernels: fixed-width types, bf16/f16 bit
// conversions, and the row formats' per-element dequantisation.
//
// Everything here is plain C++ on bit patterns: it needs no CUDA header (NVRTC
// compiles it with its built-ins only), and it also compiles as host C++ (g++),
// which is how tests/cuda_kernels_host.rs checks the dequantisation bit for bit
// against src/formats.rs on a machine without a GPU.
//
// Rounding: every f32 operation that must round exactly once (the GGUF block
// formulas) goes through ENG_MUL / ENG_SUB, which are __fmul_rn / __fsub_rn on
// the device, so the compiler cannot contract them into an FMA. (The products
// are exact anyway; see src/formats.rs.) Kernels are compiled without
// --ftz, so f32 subnormals (the e8m0 scale 2^-127) are honoured.
#pragma once

#if defined(__CUDACC__)
#define ENG_DEV __device__ __forceinline__
#define ENG_MUL(a, b) __fmul_rn((a), (b))
#define ENG_SUB(a, b) __fsub_rn((a), (b))
#else
#define ENG_DEV static inline
#define ENG_MUL(a, b) ((a) * (b))
#define ENG_SUB(a, b) ((a) - (b))
#endif

typedef unsigned char eng_u8;
typedef signed char eng_i8;
typedef unsigned short eng_u16;
typedef unsigned int eng_u32;
typedef int eng_i32;
typedef long long eng_i64;
typedef unsigned long long eng_u64;

// The constants shared with Rust (type numbers and block sizes, error-latch
// codes, launch shapes) are not defined here: src/cuda/kernels.rs passes them
// as -D options (kernels::defines), so the two sides cannot drift apart.
#if !defined(ENG_F32) || !defined(ENG_FP8_E4M3_E8M0) || !defined(ENG_Q6_K_BLOCK_BYTES) || \
    !defined(ENG_ERR_ROW_RANGE) || !defined(ENG_LATCH_WORDS) || !defined(ENG_GATE_THREADS)
#error "compile the engram kernels with the -D options of src/cuda/kernels.rs defines()"
#endif

// Per-token status written by the gather kernel, read by the gate.
#define ENG_TOKEN_LIVE 0u
#define ENG_TOKEN_DEAD 1u
#define ENG_TOKEN_BAD 2u

ENG_DEV float eng_f32_from_bits(eng_u32 b) {
#if defined(__CUDACC__)
    return __uint_as_float(b);
#else
    union {
        eng_u32 u;
        float f;
    } v;
    v.u = b;
    return v.f;
#endif
}

ENG_DEV eng_u32 eng_bits_from_f32(float f) {
#if defined(__CUDACC__)
    return __float_as_uint(f);
#else
    union {
        eng_u32 u;
        float f;
    } v;
    v.f = f;
    return v.u;
#endif
}

// f32 -> bf16, round to nearest, ties to even; a NaN keeps its sign and top
// mantissa bits and becomes quiet (exactly the `half` crate's from_f32).
ENG_DEV eng_u16 eng_f32_to_bf16(float f) {
    eng_u32 x = eng_bits_from_f32(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
        return (eng_u16)((x >> 16) | 0x0040u);
    }
    const eng_u32 round_bit = 0x00008000u;
    if ((x & round_bit) != 0u && (x & (3u * round_bit - 1u)) != 0u) {
        return (eng_u16)((x >> 16) + 1u);
    }
    return (eng_u16)(x >> 16);
}

ENG_DEV float eng_bf16_to_f32(eng_u16 b) { return eng_f32_from_bits(((eng_u32)b) << 16); }

// f16 bits -> f32, exact (NaNs quiet, as the `half` crate does).
ENG_DEV float eng_f16_to_f32(eng_u16 h) {
    eng_u32 sign = ((eng_u32)(h & 0x8000u)) << 16;
    eng_u32 exp = (h >> 10) & 0x1Fu;
    eng_u32 man = h & 0x3FFu;
    if (exp == 0x1Fu) {
        if (man == 0u) return eng_f32_from_bits(sign | 0x7F800000u);
        return eng_f32_from_bits(sign | 0x7FC00000u | (man << 13));
    }
    if (exp == 0u) {
        if (man == 0u) return eng_f32_from_bits(sign);
        // Subnormal: normalise.
        eng_u32 e = 0u;
        while ((man & 0x400u) == 0u) {
            man <<= 1;
            e++;
        }
        man &= 0x3FFu;
        return eng_f32_from_bits(sign | ((127u - 15u + 1u - e) << 23) | (man << 13));
    }
    return eng_f32_from_bits(sign | ((exp + 127u - 15u) << 23) | (man << 13));
}

ENG_DEV eng_u16 eng_load_u16(const eng_u8 *p) { return (eng_u16)(p[0] | ((eng_u32)p[1] << 8)); }

ENG_DEV float eng_f16_at(const eng_u8 *p) { return eng_f16_to_f32(eng_load_u16(p)); }

// The value of an e4m3 ("fn") code that is not NaN: exact in f32.
ENG_DEV float eng_e4m3_to_f32(eng_u8 c) {
    eng_u32 sign = ((eng_u32)(c & 0x80u)) << 24;
    eng_u32 exp = (c >> 3) & 0xFu;
    eng_u32 man = c & 7u;
    if (exp == 0u) {
        // man * 2^-9, exact.
        float v = ENG_MUL((float)man, eng_f32_from_bits(0x3B000000u)); // 2^-9
        return eng_f32_from_bits(eng_bits_from_f32(v) | sign);
    }
    return eng_f32_from_bits(sign | ((exp - 7u + 127u) << 23) | (man << 20));
}

// 2^(code - 127) for an e8m0 code that is not 255.
ENG_DEV float eng_e8m0_to_f32(eng_u8 code) {
    if (code == 0u) return eng_f32_from_bits(0x00400000u); // 2^-127, subnormal
    return eng_f32_from_bits(((eng_u32)code) << 23);
}

// The value of a block-scaled fp8 weight (ENG_FP8_E4M3_E8M0_BLOCK): e4m3 code
// `code` at column `col` of a row whose block scales are `srow` (one per `bc`
// columns), exact in f32 (and in bf16: the host checks at set_layer).
ENG_DEV float eng_fp8_block_value(eng_u8 code, const eng_u8 *srow, eng_u32 col, eng_u32 bc) {
    return ENG_MUL(eng_e4m3_to_f32(code), eng_e8m0_to_f32(srow[col / bc]));
}

// ---------------------------------------------------------------------------
// Bytes of one row of `hd` values; 0 for an unknown format.
ENG_DEV eng_u32 eng_row_bytes(eng_u32 fmt, eng_u32 hd) {
    switch (fmt) {
    case ENG_F32: return 4u * hd;
    case ENG_F16: return 2u * hd;
    case ENG_BF16: return 2u * hd;
    case ENG_FP8_E4M3_E8M0:
    case ENG_FP8_E4M3_E8M0_SPLIT: return hd + hd / ENG_FP8_SCALE_BLOCK;
    case ENG_Q8_0: return hd / ENG_Q8_0_BLOCK * ENG_Q8_0_BLOCK_BYTES;
    case ENG_Q4_0: return hd / ENG_Q4_0_BLOCK * ENG_Q4_0_BLOCK_BYTES;
    case ENG_Q2_K: return hd / ENG_Q2_K_BLOCK * ENG_Q2_K_BLOCK_BYTES;
    case ENG_Q3_K: return hd / ENG_Q3_K_BLOCK * ENG_Q3_K_BLOCK_BYTES;
    case ENG_Q4_K: return hd / ENG_Q4_K_BLOCK * ENG_Q4_K_BLOCK_BYTES;
    case ENG_Q5_K: return hd / ENG_Q5_K_BLOCK * ENG_Q5_K_BLOCK_BYTES;
    case ENG_Q6_K: return hd / ENG_Q6_K_BLOCK * ENG_Q6_K_BLOCK_BYTES;
    default: return 0u;
    }
}

// ---- GGUF blocks: value `e` of one block (ggml's dequantize_row_* order) ----

ENG_DEV float eng_q8_0(const eng_u8 *b, eng_u32 e) {
    return ENG_MUL((float)(eng_i8)b[ENG_Q8_0_QS + e], eng_f16_at(b + ENG_Q8_0_D));
}

ENG_DEV float eng_q4_0(const eng_u8 *b, eng_u32 e) {
    eng_u32 q = e < 16u ? (b[ENG_Q4_0_QS + e] & 0xFu) : (b[ENG_Q4_0_QS + e - 16u] >> 4);
    return ENG_MUL((float)((eng_i32)q - 8), eng_f16_at(b + ENG_Q4_0_D));
}

// The K-quants in two parts: the (sub-block) scales of value e, computed once
// for a run of values that share them (the GEMV of gemv_q.cu), and the value
// from them. eng_qN_k(b, e) composes the two: one formula, one rounding order.

// q2_K: 16 sub-blocks of 16; x = d * (sc & 15) * q - dmin * (sc >> 4).
ENG_DEV void eng_q2_k_scale(const eng_u8 *b, eng_u32 e, float *dl, float *ml) {
    const eng_u32 sc = b[ENG_Q2_K_SCALES + e / 16u];
    *dl = ENG_MUL(eng_f16_at(b + ENG_Q2_K_D), (float)(sc & 0xFu));
    *ml = ENG_MUL(eng_f16_at(b + ENG_Q2_K_DMIN), (float)(sc >> 4));
}

ENG_DEV float eng_q2_k_at(const eng_u8 *b, eng_u32 e, float dl, float ml) {
    eng_u32 s = e / 16u, l = e % 16u;
    eng_u32 half = s / 8u, group = (s / 2u) % 4u, part = s % 2u;
    eng_u32 qb = b[ENG_Q2_K_QS + 32u * half + 16u * part + l];
    return ENG_SUB(ENG_MUL(dl, (float)((qb >> (2u * group)) & 3u)), ml);
}

ENG_DEV float eng_q2_k(const eng_u8 *b, eng_u32 e) {
    float dl, ml;
    eng_q2_k_scale(b, e, &dl, &ml);
    return eng_q2_k_at(b, e, dl, ml);
}

ENG_DEV eng_i32 eng_q3_k_scale6(const eng_u8 *sc, eng_u32 s) {
    eng_u32 lo = s < 8u ? (sc[s] & 0xFu) : (sc[s - 8u] >> 4);
    eng_u32 hi = (sc[8u + s % 4u] >> (2u * (s / 4u))) & 3u;
    return (eng_i32)(lo | (hi << 4)) - 32;
}

// q3_K: 16 sub-blocks of 16; x = d * (scale - 32) * (q - (hmask ? 0 : 4)).
ENG_DEV float eng_q3_k_scale(const eng_u8 *b, eng_u32 e) {
    return ENG_MUL(eng_f16_at(b + ENG_Q3_K_D), (float)eng_q3_k_scale6(b + ENG_Q3_K_SCALES, e / 16u));
}

ENG_DEV float eng_q3_k_at(const eng_u8 *b, eng_u32 e, float dl) {
    eng_u32 s = e / 16u, l = e % 16u;
    eng_u32 half = s / 8u, group = (s / 2u) % 4u, part = s % 2u;
    eng_u32 qb = b[ENG_Q3_K_QS + 32u * half + 16u * part + l];
    eng_u32 hb = b[ENG_Q3_K_HMASK + 16u * part + l];
    eng_u32 bit = 1u << (4u * half + group);
    eng_i32 v = (eng_i32)((qb >> (2u * group)) & 3u) - ((hb & bit) != 0u ? 0 : 4);
    return ENG_MUL(dl, (float)v);
}

ENG_DEV float eng_q3_k(const eng_u8 *b, eng_u32 e) { return eng_q3_k_at(b, e, eng_q3_k_scale(b, e)); }

// ggml's get_scale_min_k4: the packed 6-bit (scale, min) pair j.
ENG_DEV void eng_scale_min_k4(const eng_u8 *sc, eng_u32 j, eng_u32 *s, eng_u32 *m) {
    if (j < 4u) {
        *s = sc[j] & 63u;
        *m = sc[j + 4u] & 63u;
    } else {
        *s = (sc[j + 4u] & 0xFu) | ((sc[j - 4u] >> 6) << 4);
        *m = (sc[j + 4u] >> 4) | ((sc[j] >> 6) << 4);
    }
}

// q4_K and q5_K: 8 sub-blocks of 32; x = d * sc * q - dmin * m.
ENG_DEV void eng_k4_scale(const eng_u8 *b, eng_u32 e, float *d1, float *m1) {
    eng_u32 sc, m;
    eng_scale_min_k4(b + ENG_Q4_K_SCALES, e / 32u, &sc, &m);
    *d1 = ENG_MUL(eng_f16_at(b + ENG_Q4_K_D), (float)sc);
    *m1 = ENG_MUL(eng_f16_at(b + ENG_Q4_K_DMIN), (float)m);
}

ENG_DEV float eng_q4_k_at(const eng_u8 *b, eng_u32 e, float d1, float m1) {
    eng_u32 s = e / 32u, l = e % 32u;
    eng_u32 qb = b[ENG_Q4_K_QS + 32u * (s / 2u) + l];
    return ENG_SUB(ENG_MUL(d1, (float)((qb >> (4u * (s % 2u))) & 0xFu)), m1);
}

ENG_DEV float eng_q4_k(const eng_u8 *b, eng_u32 e) {
    float d1, m1;
    eng_k4_scale(b, e, &d1, &m1);
    return eng_q4_k_at(b, e, d1, m1);
}

ENG_DEV float eng_q5_k_at(const eng_u8 *b, eng_u32 e, float d1, float m1) {
    eng_u32 s = e / 32u, l = e % 32u;
    eng_u32 qb = b[ENG_Q5_K_QS + 32u * (s / 2u) + l];
    eng_u32 hb = b[ENG_Q5_K_QH + l];
    eng_u32 v = ((qb >> (4u * (s % 2u))) & 0xFu) + ((hb & (1u << s)) != 0u ? 16u : 0u);
    return ENG_SUB(ENG_MUL(d1, (float)v), m1);
}

ENG_DEV float eng_q5_k(const eng_u8 *b, eng_u32 e) {
    float d1, m1;
    eng_k4_scale(b, e, &d1, &m1);
    return eng_q5_k_at(b, e, d1, m1);
}

// q6_K: 16 sub-blocks of 16; x = d * scale * (q - 32).
ENG_DEV float eng_q6_k_scale(const eng_u8 *b, eng_u32 e) {
    return ENG_MUL(eng_f16_at(b + ENG_Q6_K_D), (float)(eng_i8)b[ENG_Q6_K_SCALES + e / 16u]);
}

ENG_DEV float eng_q6_k_at(const eng_u8 *b, eng_u32 e, float sd) {
    eng_u32 s = e / 16u, l = e % 16u;
    eng_u32 half = s / 8u, group = (s / 2u) % 4u, part = s % 2u;
    eng_u32 l0 = 16u * part;
    eng_u32 lb = b[ENG_Q6_K_QL + 64u * half + 32u * (group % 2u) + l0 + l];
    eng_u32 hb = b[ENG_Q6_K_QH + 32u * half + l0 + l];
    eng_u32 shift = 4u * (group / 2u);
    eng_i32 v = (eng_i32)(((lb >> shift) & 0xFu) | (((hb >> (2u * group)) & 3u) << 4)) - 32;
    return ENG_MUL(sd, (float)v);
}

ENG_DEV float eng_q6_k(const eng_u8 *b, eng_u32 e) { return eng_q6_k_at(b, e, eng_q6_k_scale(b, e)); }

// Value `i` of an fp8 row whose e4m3 codes are `codes` and whose e8m0 scales
// (one per ENG_FP8_SCALE_BLOCK values) are `scales`, as bf16 bits, without the
// finiteness check: the packed format passes its row and the row's tail, the
// split format its two arrays' rows. A NaN scale returns ENG_ERR_NAN_SCALE
// (*where = the scale's index), a NaN code ENG_ERR_NAN_CODE (*where = i).
// eng_fp8_bf16_raw on value `i`'s code `c` and its block's scale `sc`, read
// by the caller (the gather reads eight codes at once).
ENG_DEV eng_u32 eng_fp8_code_bf16(eng_u8 c, eng_u8 sc, eng_u32 i, eng_u16 *out, eng_u32 *where) {
    if (sc == 255u) {
        *where = i / ENG_FP8_SCALE_BLOCK;
        return ENG_ERR_NAN_SCALE;
    }
    if ((c & 0x7Fu) == 0x7Fu) {
        *where = i;
        return ENG_ERR_NAN_CODE;
    }
    *out = eng_f32_to_bf16(ENG_MUL(eng_e4m3_to_f32(c), eng_e8m0_to_f32(sc)));
    return 0u;
}

ENG_DEV eng_u32 eng_fp8_bf16_raw(const eng_u8 *codes, const eng_u8 *scales, eng_u32 i, eng_u16 *out,
                                 eng_u32 *where) {
    return eng_fp8_code_bf16(codes[i], scales[i / ENG_FP8_SCALE_BLOCK], i, out, where);
}

// Whether bf16 bits are not finite (the rows' validity rule).
ENG_DEV bool eng_bf16_not_finite(eng_u16 v) { return (v & 0x7F80u) == 0x7F80u; }

// Value `i` of a row of `hd` values in `fmt`, as bf16 bits, without the
// finiteness check (see eng_dequant_bf16). The split fp8 format's row here is
// its codes followed by its scales (the packed row).
ENG_DEV eng_u32 eng_dequant_bf16_raw(eng_u32 fmt, const eng_u8 *row, eng_u32 hd, eng_u32 i, eng_u16 *out,
                                 eng_u32 *where) {
    switch (fmt) {
    case ENG_BF16: *out = eng_load_u16(row + 2u * i); return 0u;
    case ENG_F16: *out = eng_f32_to_bf16(eng_f16_at(row + 2u * i)); return 0u;
    case ENG_F32: {
        const eng_u8 *p = row + 4u * i;
        eng_u32 b = p[0] | ((eng_u32)p[1] << 8) | ((eng_u32)p[2] << 16) | ((eng_u32)p[3] << 24);
        *out = eng_f32_to_bf16(eng_f32_from_bits(b));
        return 0u;
    }
    case ENG_FP8_E4M3_E8M0:
    case ENG_FP8_E4M3_E8M0_SPLIT: return eng_fp8_bf16_raw(row, row + hd, i, out, where);
    case ENG_Q8_0: *out = eng_f32_to_bf16(eng_q8_0(row + (i / ENG_Q8_0_BLOCK) * ENG_Q8_0_BLOCK_BYTES, i % ENG_Q8_0_BLOCK)); return 0u;
    case ENG_Q4_0: *out = eng_f32_to_bf16(eng_q4_0(row + (i / ENG_Q4_0_BLOCK) * ENG_Q4_0_BLOCK_BYTES, i % ENG_Q4_0_BLOCK)); return 0u;
    case ENG_Q2_K: *out = eng_f32_to_bf16(eng_q2_k(row + (i / ENG_Q2_K_BLOCK) * ENG_Q2_K_BLOCK_BYTES, i % ENG_Q2_K_BLOCK)); return 0u;
    case ENG_Q3_K: *out = eng_f32_to_bf16(eng_q3_k(row + (i / ENG_Q3_K_BLOCK) * ENG_Q3_K_BLOCK_BYTES, i % ENG_Q3_K_BLOCK)); return 0u;
    case ENG_Q4_K: *out = eng_f32_to_bf16(eng_q4_k(row + (i / ENG_Q4_K_BLOCK) * ENG_Q4_K_BLOCK_BYTES, i % ENG_Q4_K_BLOCK)); return 0u;
    case ENG_Q5_K: *out = eng_f32_to_bf16(eng_q5_k(row + (i / ENG_Q5_K_BLOCK) * ENG_Q5_K_BLOCK_BYTES, i % ENG_Q5_K_BLOCK)); return 0u;
    case ENG_Q6_K: *out = eng_f32_to_bf16(eng_q6_k(row + (i / ENG_Q6_K_BLOCK) * ENG_Q6_K_BLOCK_BYTES, i % ENG_Q6_K_BLOCK)); return 0u;
    default: *out = 0xFFFFu; return 0u;
    }
}

// Value `i` of a row of `hd` values in `fmt`, as bf16 bits: exactly
// src/formats dequant_row_bf16. Returns 0 on success; for fp8, a NaN scale
// returns ENG_ERR_NAN_SCALE (*where = the scale's index) and a NaN code
// ENG_ERR_NAN_CODE (*where = i); a value that is not finite in bf16 (an
// overflowing scale, a NaN or infinite GGUF scale, a stored NaN or infinity)
// returns ENG_ERR_NON_FINITE (*where = i), so no NaN bits ever leave a row.
// An unknown format returns 0xFFFF bits (never reached: the host checks formats).
ENG_DEV eng_u32 eng_dequant_bf16(eng_u32 fmt, const eng_u8 *row, eng_u32 hd, eng_u32 i, eng_u16 *out,
                                 eng_u32 *where) {
    const eng_u32 code = eng_dequant_bf16_raw(fmt, row, hd, i, out, where);
    if (code != 0u) return code;
    if (eng_bf16_not_finite(*out)) {
        *where = i;
        return ENG_ERR_NON_FINITE;
    }
    return 0u;
}

// Value `i` of a split fp8 row (`codes`: its e4m3 codes; `scales`: its e8m0
// scales), as bf16 bits: exactly eng_dequant_bf16 on the packed row `codes ++
// scales` (src/formats fp8_split_bf16), errors and their positions included.
ENG_DEV eng_u32 eng_dequant_fp8_split_bf16(const eng_u8 *codes, const eng_u8 *scales, eng_u32 i, eng_u16 *out,
                                           eng_u32 *where) {
    const eng_u32 code = eng_fp8_bf16_raw(codes, scales, i, out, where);
    if (code != 0u) return code;
    if (eng_bf16_not_finite(*out)) {
        *where = i;
        return ENG_ERR_NON_FINITE;
    }
    return 0u;
}
