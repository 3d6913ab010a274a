// The projection for a handful of tokens (bandwidth-bound: every wkv byte is
// read once): kv[t][o] = bf16(sum_k rows[t][k] * wkv[o][k]), bf16 in, f32
// accumulate, bf16 out (nearest-even). Each warp computes ENG_GEMV_ROWS output
// rows for all NT tokens; each lane reads 16 bytes (8 bf16) of a weight row per
// step. Needs k % 8 == 0 and wkv, rows 16-byte aligned (the host checks, and
// uses cuBLAS otherwise).
#include "engram_common.cuh"


__device__ __forceinline__ void eng_fma8(float &acc, uint4 w, uint4 r) {
    const eng_u32 wv[4] = {w.x, w.y, w.z, w.w};
    const eng_u32 rv[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        acc += eng_f32_from_bits(wv[i] << 16) * eng_f32_from_bits(rv[i] << 16);
        acc += eng_f32_from_bits(wv[i] & 0xFFFF0000u) * eng_f32_from_bits(rv[i] & 0xFFFF0000u);
    }
}

template <int NT>
__device__ __forceinline__ void eng_gemv(const uint4 *__restrict__ w, const uint4 *__restrict__ rows,
                                         eng_u16 *__restrict__ kv, eng_u32 n_out, eng_u32 k) {
    const eng_u32 k8 = k / 8u;
    // 64-bit: blockIdx.x * blockDim.x passes 2^32 threads above 2^28 output rows.
    const eng_u64 warp = (eng_u64)blockIdx.x * (blockDim.x / 32u) + threadIdx.x / 32u;
    const eng_u32 lane = threadIdx.x % 32u;
    if (warp * ENG_GEMV_ROWS >= n_out) return;
    const eng_u32 o0 = (eng_u32)(warp * ENG_GEMV_ROWS);
    float acc[ENG_GEMV_ROWS][NT];
#pragma unroll
    for (int r = 0; r < ENG_GEMV_ROWS; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = 0.f;
    for (eng_u32 c = lane; c < k8; c += 32u) {
        uint4 wv[ENG_GEMV_ROWS];
#pragma unroll
        for (int r = 0; r < ENG_GEMV_ROWS; r++) {
            const eng_u32 o = o0 + r < n_out ? o0 + r : n_out - 1u;
            wv[r] = w[(eng_u64)o * k8 + c];
        }
#pragma unroll
        for (int t = 0; t < NT; t++) {
            const uint4 rv = rows[(eng_u64)t * k8 + c];
#pragma unroll
            for (int r = 0; r < ENG_GEMV_ROWS; r++) eng_fma8(acc[r][t], wv[r], rv);
        }
    }
#pragma unroll
    for (int r = 0; r < ENG_GEMV_ROWS; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float v = acc[r][t];
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
            if (lane == 0u && o0 + r < n_out) kv[(eng_u64)t * n_out + o0 + r] = eng_f32_to_bf16(v);
        }
}

// Grid: ceil(n_out / (ENG_GEMV_ROWS * ENG_GEMV_THREADS / 32)) blocks of ENG_GEMV_THREADS.
#define ENG_GEMV_ENTRY(NT)                                                                                       \
    extern "C" __global__ void __launch_bounds__(ENG_GEMV_THREADS)                                                \
        engram_gemv_bf16_##NT(const uint4 *w, const uint4 *rows, eng_u16 *kv, eng_u32 n_out, eng_u32 k) {       \
        eng_gemv<NT>(w, rows, kv, n_out, k);                                                                     \
    }
ENG_GEMV_ENTRY(1)
ENG_GEMV_ENTRY(2)
ENG_GEMV_ENTRY(3)
ENG_GEMV_ENTRY(4)
ENG_GEMV_ENTRY(5)
ENG_GEMV_ENTRY(6)
ENG_GEMV_ENTRY(7)
ENG_GEMV_ENTRY(8)
#if ENG_GEMV_MAX != 8
#error "ENG_GEMV_MAX (src/cuda/kernels.rs GEMV_MAX) must match the entries above"
#endif
