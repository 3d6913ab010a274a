// The device functions of gate.cu (its kernels are described there): the
// gate of one (token, stream) pair, eng_gate_stream, and what it needs;
// decode.cu uses them too.
#pragma once
#include "engram_common.cuh"
#include "latch.cuh"

static_assert(ENG_GATE_THREADS % 32 == 0 && ENG_GATE_THREADS >= 32 && ENG_GATE_THREADS <= 1024,
              "the gate's reduction takes whole warps (ENG_GATE_THREADS, src/cuda/kernels.rs)");


template <typename T> __device__ __forceinline__ float eng_load(const T *p, eng_u64 i);
template <> __device__ __forceinline__ float eng_load<float>(const float *p, eng_u64 i) { return p[i]; }
template <> __device__ __forceinline__ float eng_load<eng_u16>(const eng_u16 *p, eng_u64 i) {
    return eng_bf16_to_f32(p[i]);
}

// A load of memory this kernel reads only (COH false: kv and the flags of the
// gate kernel, written by earlier kernels), or through L2 (COH true: the
// decode kernel's gate, where other blocks of the same launch wrote them).
template <bool COH, typename T> __device__ __forceinline__ T eng_ld(const T *p) {
    if constexpr (COH) {
        return __ldcg(p);
    } else {
        return *p;
    }
}
template <bool COH, typename T> __device__ __forceinline__ T eng_ld16(const T *p) {
    if constexpr (COH) {
        return __ldcg(p);
    } else {
        return __ldg(p);
    }
}

// kv values are bf16 values: an f32 kv is rounded here.
template <bool COH> __device__ __forceinline__ float eng_load_kv(const float *p, eng_u64 i) {
    return eng_bf16_to_f32(eng_f32_to_bf16(eng_ld<COH>(p + i)));
}
template <bool COH> __device__ __forceinline__ float eng_load_kv(const eng_u16 *p, eng_u64 i) {
    return eng_bf16_to_f32(eng_ld<COH>(p + i));
}

__device__ __forceinline__ void eng_store(float *p, eng_u64 i, float v) { p[i] = v; }
__device__ __forceinline__ void eng_store(eng_u16 *p, eng_u64 i, float v) { p[i] = eng_f32_to_bf16(v); }

// The smallest x.x, key.key and |x.qk.key| the f32 sums are trusted at
// (2^-60), as src/cpu/gate.rs SAFE_SUM_MIN.
#define ENG_SAFE_SUM_MIN 0x1p-60f

// Whether the f32 sums and their dot can be trusted (src/cpu/gate.rs
// f32_sums_hold): each sum in [2^-60, FLT_MAX] (no overflow, no underflow
// that matters), the dot finite and not zero. False for any NaN.
__device__ __forceinline__ bool eng_sum_ok(float v) { return v >= ENG_SAFE_SUM_MIN && v <= 3.40282347e38f; }
__device__ __forceinline__ bool eng_f32_sums_hold(float hh, float kk, float dt, float dot) {
    return eng_sum_ok(hh) && eng_sum_ok(kk) && eng_sum_ok(fabsf(dt)) && fabsf(dot) <= 3.40282347e38f &&
           dot != 0.f;
}

// sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))) with sign(0) = 0; NaN for a NaN dot.
__device__ __forceinline__ float eng_gate_of(float dot) {
    float sign;
    if (dot > 0.f) {
        sign = 1.f;
    } else if (dot < 0.f) {
        sign = -1.f;
    } else if (dot == 0.f) {
        sign = 0.f;
    } else {
        sign = dot; // NaN
    }
    const float g = sign * sqrtf(fmaxf(fabsf(dot), 1e-6f));
    return 1.0f / (1.0f + expf(-g));
}

// The order of the sums (the same since the gate was one 256-thread block
// per stream, so its bits are unchanged): element j goes to partial sum
// j % ENG_GATE_PARTS, added in order of j; each run of 32 partial sums is
// summed by an xor butterfly (16, 8, 4, 2, 1 apart), and the 8 results in
// order, from 0. Now one warp does a whole (token, stream): lane L keeps
// partial sums 8L .. 8L + 7, whose elements it reads 8 at a time (16-byte
// loads where the arrays allow); the butterfly's first two steps (16 and 8
// apart: 2 and 1 lanes apart here) go through shuffles, the last three stay
// in the lane.
#define ENG_GATE_VEC 8u
#define ENG_GATE_PARTS 256u
static_assert(ENG_GATE_PARTS == 32u * ENG_GATE_VEC, "a warp's lanes hold the partial sums, 8 each");

// 8 values from 16-byte aligned memory: the highway through L2 (ld.global.cg:
// it is written by this kernel), kv and q*k read-only (ld.global.nc); kv
// values are bf16 values (an f32 kv is rounded as it is read).
__device__ __forceinline__ void eng_load8(const float *p, float *v) {
    const float4 a = __ldcg((const float4 *)p), b = __ldcg((const float4 *)p + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
__device__ __forceinline__ void eng_load8(const eng_u16 *p, float *v) {
    const uint4 a = __ldcg((const uint4 *)p);
    const eng_u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = eng_bf16_to_f32((eng_u16)(w[i / 2] >> (16 * (i % 2))));
}
__device__ __forceinline__ void eng_load8_ro(const float *p, float *v) {
    const float4 a = __ldg((const float4 *)p), b = __ldg((const float4 *)p + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}
template <bool COH> __device__ __forceinline__ void eng_load8_kv(const float *p, float *v) {
    const float4 a = eng_ld16<COH>((const float4 *)p), b = eng_ld16<COH>((const float4 *)p + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = eng_bf16_to_f32(eng_f32_to_bf16(v[i]));
}
template <bool COH> __device__ __forceinline__ void eng_load8_kv(const eng_u16 *p, float *v) {
    const uint4 a = eng_ld16<COH>((const uint4 *)p);
    const eng_u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = eng_bf16_to_f32((eng_u16)(w[i / 2] >> (16 * (i % 2))));
}
__device__ __forceinline__ void eng_store8(float *p, const float *v) {
    __stcg((float4 *)p, make_float4(v[0], v[1], v[2], v[3]));
    __stcg((float4 *)p + 1, make_float4(v[4], v[5], v[6], v[7]));
}
__device__ __forceinline__ void eng_store8(eng_u16 *p, const float *v) {
    eng_u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = eng_f32_to_bf16(v[2 * i]) | ((eng_u32)eng_f32_to_bf16(v[2 * i + 1]) << 16);
    __stcg((uint4 *)p, make_uint4(w[0], w[1], w[2], w[3]));
}

// The sum, in the order above, of the partial sums each lane holds (`v`: its
// 8): the same value in every lane.
template <typename F> __device__ __forceinline__ F eng_gate_sum(F *v) {
    // Butterfly steps 16 and 8 apart: lanes 2 and 1 apart.
#pragma unroll
    for (int o = 2; o > 0; o >>= 1)
#pragma unroll
        for (int r = 0; r < 8; r++) v[r] += __shfl_xor_sync(0xFFFFFFFFu, v[r], o);
    // Steps 4, 2, 1 apart: within the lane.
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) {
        F n[8];
#pragma unroll
        for (int r = 0; r < 8; r++) n[r] = v[r] + v[r ^ o];
#pragma unroll
        for (int r = 0; r < 8; r++) v[r] = n[r];
    }
    // Each run of 32 partial sums now in lanes 4w .. 4w + 3: summed in order.
    F acc = (F)0;
#pragma unroll
    for (int w = 0; w < 8; w++) acc += __shfl_sync(0xFFFFFFFFu, v[0], 4 * w);
    return acc;
}

// The gate of (token, stream) pair b (token b / hc, stream b % hc), by the
// warp whose lane this is. COH: kv and the flags are read through L2 (the
// decode kernel, whose other blocks wrote them in the same launch).
template <bool COH, typename HW, typename KV>
__device__ __forceinline__ void eng_gate_stream(eng_u64 b, eng_u32 lane, HW *highway, const KV *__restrict__ kv,
                                                const float *__restrict__ qk, const eng_u32 *__restrict__ flags,
                                                eng_u32 cols, eng_u32 hc, eng_u32 d, float eps, float inv_sqrt_d) {
    const eng_u32 t = (eng_u32)(b / hc), s = (eng_u32)(b % hc);
    // The token's C row flags (written by the gather): any that is not LIVE
    // (dead, bad id, bad row) leaves the token alone.
    int skip = 0;
    for (eng_u32 k = lane; k < cols; k += 32u) skip |= eng_ld<COH>(flags + (eng_u64)t * cols + k) != ENG_TOKEN_LIVE;
    if (__any_sync(0xFFFFFFFFu, skip)) return;
    const eng_u64 xo = ((eng_u64)t * hc + s) * d;
    const eng_u64 ko = (eng_u64)t * (hc + 1u) * d + (eng_u64)s * d;
    const eng_u64 vo = (eng_u64)t * (hc + 1u) * d + (eng_u64)hc * d;
    const float *q = qk + (eng_u64)s * d;
    // 16-byte loads and stores where every row of the three arrays starts
    // 16-byte aligned; else a value at a time, in the same order.
    const bool vec = d % ENG_GATE_VEC == 0u && ((eng_u64)highway & 15u) == 0u && ((eng_u64)kv & 15u) == 0u &&
                     ((eng_u64)qk & 15u) == 0u;
    float hh[8], kk[8], dt[8];
#pragma unroll
    for (int r = 0; r < 8; r++) hh[r] = kk[r] = dt[r] = 0.f;
    for (eng_u32 j0 = ENG_GATE_VEC * lane; j0 < d; j0 += ENG_GATE_PARTS) {
        float x[8], key[8], qv[8];
        if (vec) {
            eng_load8(highway + xo + j0, x);
            eng_load8_kv<COH>(kv + ko + j0, key);
            eng_load8_ro(q + j0, qv);
        } else {
#pragma unroll
            for (int r = 0; r < 8; r++) {
                const eng_u32 j = j0 + (eng_u32)r < d ? j0 + (eng_u32)r : j0;
                x[r] = eng_load(highway, xo + j);
                key[r] = eng_load_kv<COH>(kv, ko + j);
                qv[r] = q[j];
            }
        }
#pragma unroll
        for (int r = 0; r < 8; r++) {
            if (j0 + (eng_u32)r < d) {
                hh[r] += x[r] * x[r];
                kk[r] += key[r] * key[r];
                dt[r] += x[r] * qv[r] * key[r];
            }
        }
    }
    const float a = eng_gate_sum(hh), bk = eng_gate_sum(kk), c = eng_gate_sum(dt);
    const float rx = 1.0f / sqrtf(a / (float)d + eps);
    const float rk = 1.0f / sqrtf(bk / (float)d + eps);
    const float dot = c * rx * rk * inv_sqrt_d;
    float gate;
    if (eng_f32_sums_hold(a, bk, c, dot)) {
        gate = eng_gate_of(dot);
    } else {
        // The f32 sums overflowed, underflowed or met a NaN/infinity: the
        // stream's sums again in f64, in the same order, which holds every
        // finite input (src/cpu/gate.rs dot_wide; docs/numerics.md). Rare:
        // normal-range streams never come here.
        double h2[8], k2[8], d2[8];
#pragma unroll
        for (int r = 0; r < 8; r++) h2[r] = k2[r] = d2[r] = 0.0;
        for (eng_u32 j0 = ENG_GATE_VEC * lane; j0 < d; j0 += ENG_GATE_PARTS) {
#pragma unroll
            for (int r = 0; r < 8; r++) {
                const eng_u32 j = j0 + (eng_u32)r;
                if (j < d) {
                    const double x = (double)eng_load(highway, xo + j);
                    const double key = (double)eng_load_kv<COH>(kv, ko + j);
                    h2[r] += x * x;
                    k2[r] += key * key;
                    d2[r] += x * (double)q[j] * key;
                }
            }
        }
        const double a2 = eng_gate_sum(h2), b2 = eng_gate_sum(k2), c2 = eng_gate_sum(d2);
        const double n = (double)d;
        const double rx2 = 1.0 / sqrt(a2 / n + (double)eps);
        const double rk2 = 1.0 / sqrt(b2 / n + (double)eps);
        gate = eng_gate_of((float)(c2 * rx2 * rk2 / sqrt(n)));
    }
    for (eng_u32 j0 = ENG_GATE_VEC * lane; j0 < d; j0 += ENG_GATE_PARTS) {
        if (vec) {
            float x[8], v[8], o[8];
            eng_load8(highway + xo + j0, x);
            eng_load8_kv<COH>(kv + vo + j0, v);
#pragma unroll
            for (int r = 0; r < 8; r++) o[r] = x[r] + gate * v[r];
            eng_store8(highway + xo + j0, o);
        } else {
#pragma unroll
            for (int r = 0; r < 8; r++) {
                const eng_u32 j = j0 + (eng_u32)r;
                if (j < d) {
                    const float x = eng_load(highway, xo + j);
                    eng_store(highway, xo + j, x + gate * eng_load_kv<COH>(kv, vo + j));
                }
            }
        }
    }
}
