// The gate (SPEC section 1, step 6), in place on the highway: one block per
// (token t, stream s), block index t * hc + s. With x = highway[t, s, :], key = kv[t, s*D..], value =
// kv[t, hc*D..] and qk = q*k:
//   dot  = sum(x*qk*key) * rstd(x) * rstd(key) / sqrt(D),  rstd(v) = 1/sqrt(mean(v^2) + eps)
//   gate = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6)))      (sign(0) = 0)
//   x   += gate * value
// Sums and the update are f32; a bf16 highway is read exactly and written
// rounded once to nearest-even. kv is bf16, or f32 (the f32-wkv GEMM's output),
// which is rounded to bf16 as it is read, as the reference rounds kv.
// Tokens with a row flag that is not LIVE (dead, or a bad id or row) are not touched.
//
// Block 0 also moves the gather's error latch to the host-mapped mirror
// (if the mirror is free) and clears the latch: the gather kernel of this call
// has finished, and nothing else writes the latch while this kernel runs.
// While the mirror holds an error the host has not reported yet, the errors
// of later calls are dropped: the host reports the first error until then.
//
// Numeric edges (docs/numerics.md): where the f32 sums cannot be trusted
// (an overflow, e.g. a stream of +-1e20 or a bf16 value near 3e38; values so
// small they underflow; a NaN or infinity), the block sums the stream again
// in f64, as the CPU backend does; normal-range streams never take that path.
//
// Bits: the sums run in a different order than the CPU backend's, and NVRTC
// contracts products and sums into FMAs (--fmad=true) and uses its own
// expf, so the gate's bits may differ from the CPU's in the last places;
// the tests hold both to the bound of tests/common/bounds.rs. A NaN in the
// highway gives a NaN gate on both backends, with the canonical NaN bits
// (0x7FFFFFFF) on the GPU and x86's payload on the CPU.
#include "engram_common.cuh"
#include "latch.cuh"

static_assert(ENG_GATE_THREADS % 32 == 0 && ENG_GATE_THREADS >= 32 && ENG_GATE_THREADS <= 1024,
              "the gate's reduction takes whole warps (ENG_GATE_THREADS, src/cuda/kernels.rs)");


template <typename T> __device__ __forceinline__ float eng_load(const T *p, eng_u64 i);
template <> __device__ __forceinline__ float eng_load<float>(const float *p, eng_u64 i) { return p[i]; }
template <> __device__ __forceinline__ float eng_load<eng_u16>(const eng_u16 *p, eng_u64 i) {
    return eng_bf16_to_f32(p[i]);
}

// kv values are bf16 values: an f32 kv is rounded here.
template <typename T> __device__ __forceinline__ float eng_load_kv(const T *p, eng_u64 i);
template <> __device__ __forceinline__ float eng_load_kv<float>(const float *p, eng_u64 i) {
    return eng_bf16_to_f32(eng_f32_to_bf16(p[i]));
}
template <> __device__ __forceinline__ float eng_load_kv<eng_u16>(const eng_u16 *p, eng_u64 i) {
    return eng_bf16_to_f32(p[i]);
}

__device__ __forceinline__ void eng_store(float *p, eng_u64 i, float v) { p[i] = v; }
__device__ __forceinline__ void eng_store(eng_u16 *p, eng_u64 i, float v) { p[i] = eng_f32_to_bf16(v); }

__device__ __forceinline__ float eng_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

__device__ __forceinline__ double eng_warp_sum64(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

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

// Values of x each thread keeps in registers between the sums and the update
// (D <= ENG_GATE_THREADS * ENG_GATE_CACHE is read once; larger D re-reads the rest).
#define ENG_GATE_CACHE 24

template <typename HW, typename KV>
__device__ __forceinline__ void eng_gate(HW *highway, const KV *__restrict__ kv, const float *__restrict__ qk,
                                         const eng_u32 *__restrict__ flags, eng_u32 cols, eng_u32 hc,
                                         eng_u32 d, float eps, float inv_sqrt_d, eng_u32 *latch,
                                         eng_u32 *mirror) {
    __shared__ float s_red[3][ENG_GATE_THREADS / 32];
    __shared__ double s_red64[3][ENG_GATE_THREADS / 32];
    __shared__ float s_gate;
    __shared__ int s_wide;
    // Block b is (token b / hc, stream b % hc): a token's streams are
    // neighbours, so its value row is read from memory once and then from L2.
    const eng_u32 t = blockIdx.x / hc, s = blockIdx.x % hc;
    if (blockIdx.x == 0 && threadIdx.x == 0) eng_move_latch(latch, mirror);
    // The token's C row flags (written by the gather): any that is not LIVE
    // (dead, bad id, bad row) leaves the token alone.
    int skip = 0;
    for (eng_u32 k = threadIdx.x; k < cols; k += blockDim.x) skip |= flags[(eng_u64)t * cols + k] != ENG_TOKEN_LIVE;
    if (__syncthreads_or(skip)) return;
    const eng_u64 xo = ((eng_u64)t * hc + s) * d;
    const eng_u64 ko = (eng_u64)t * (hc + 1u) * d + (eng_u64)s * d;
    const eng_u64 vo = (eng_u64)t * (hc + 1u) * d + (eng_u64)hc * d;
    const float *q = qk + (eng_u64)s * d;
    const eng_u32 cached = ENG_GATE_CACHE * blockDim.x;
    float xr[ENG_GATE_CACHE];
    float hh = 0.f, kk = 0.f, dt = 0.f;
#pragma unroll
    for (int i = 0; i < ENG_GATE_CACHE; i++) {
        const eng_u32 j = threadIdx.x + (eng_u32)i * blockDim.x;
        xr[i] = 0.f;
        if (j < d) {
            const float x = eng_load(highway, xo + j);
            const float key = eng_load_kv(kv, ko + j);
            xr[i] = x;
            hh += x * x;
            kk += key * key;
            dt += x * q[j] * key;
        }
    }
    for (eng_u32 j = cached + threadIdx.x; j < d; j += blockDim.x) {
        const float x = eng_load(highway, xo + j);
        const float key = eng_load_kv(kv, ko + j);
        hh += x * x;
        kk += key * key;
        dt += x * q[j] * key;
    }
    hh = eng_warp_sum(hh);
    kk = eng_warp_sum(kk);
    dt = eng_warp_sum(dt);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    if (lane == 0) {
        s_red[0][warp] = hh;
        s_red[1][warp] = kk;
        s_red[2][warp] = dt;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float a = 0.f, b = 0.f, c = 0.f;
        for (int w = 0; w < nw; w++) {
            a += s_red[0][w];
            b += s_red[1][w];
            c += s_red[2][w];
        }
        const float rx = 1.0f / sqrtf(a / (float)d + eps);
        const float rk = 1.0f / sqrtf(b / (float)d + eps);
        const float dot = c * rx * rk * inv_sqrt_d;
        const int wide = !eng_f32_sums_hold(a, b, c, dot);
        s_wide = wide;
        if (!wide) s_gate = eng_gate_of(dot);
    }
    __syncthreads();
    if (s_wide) {
        // The f32 sums overflowed, underflowed or met a NaN/infinity: the
        // stream's sums again in f64, which holds every finite input
        // (src/cpu/gate.rs dot_wide; docs/numerics.md). Rare: normal-range
        // streams never come here.
        double h2 = 0.0, k2 = 0.0, d2 = 0.0;
        for (eng_u32 j = threadIdx.x; j < d; j += blockDim.x) {
            const double x = (double)eng_load(highway, xo + j);
            const double key = (double)eng_load_kv(kv, ko + j);
            h2 += x * x;
            k2 += key * key;
            d2 += x * (double)q[j] * key;
        }
        h2 = eng_warp_sum64(h2);
        k2 = eng_warp_sum64(k2);
        d2 = eng_warp_sum64(d2);
        if (lane == 0) {
            s_red64[0][warp] = h2;
            s_red64[1][warp] = k2;
            s_red64[2][warp] = d2;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            double a = 0.0, b = 0.0, c = 0.0;
            for (int w = 0; w < nw; w++) {
                a += s_red64[0][w];
                b += s_red64[1][w];
                c += s_red64[2][w];
            }
            const double n = (double)d;
            const double rx = 1.0 / sqrt(a / n + (double)eps);
            const double rk = 1.0 / sqrt(b / n + (double)eps);
            s_gate = eng_gate_of((float)(c * rx * rk / sqrt(n)));
        }
        __syncthreads();
    }
    const float gate = s_gate;
#pragma unroll
    for (int i = 0; i < ENG_GATE_CACHE; i++) {
        const eng_u32 j = threadIdx.x + (eng_u32)i * blockDim.x;
        if (j < d) eng_store(highway, xo + j, xr[i] + gate * eng_load_kv(kv, vo + j));
    }
    for (eng_u32 j = cached + threadIdx.x; j < d; j += blockDim.x) {
        const float x = eng_load(highway, xo + j);
        eng_store(highway, xo + j, x + gate * eng_load_kv(kv, vo + j));
    }
}

// Grid: n_tokens * hc blocks (one dimension), ENG_GATE_THREADS threads. Names: highway type, kv type.
#define ENG_GATE_ENTRY(NAME, HW, KV)                                                                             \
    extern "C" __global__ void __launch_bounds__(ENG_GATE_THREADS)                                                \
        NAME(HW *highway, const KV *kv, const float *qk, const eng_u32 *flags, eng_u32 cols, eng_u32 hc,         \
             eng_u32 d, float eps, float inv_sqrt_d, eng_u32 *latch, eng_u32 *mirror) {                          \
        eng_gate(highway, kv, qk, flags, cols, hc, d, eps, inv_sqrt_d, latch, mirror);                           \
    }
ENG_GATE_ENTRY(engram_gate_f32_bf16, float, eng_u16)
ENG_GATE_ENTRY(engram_gate_bf16_bf16, eng_u16, eng_u16)
ENG_GATE_ENTRY(engram_gate_f32_f32, float, float)
ENG_GATE_ENTRY(engram_gate_bf16_f32, eng_u16, float)
