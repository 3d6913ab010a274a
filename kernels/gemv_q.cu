// The projection with a quantised (or f16) wkv, read in place: rows of
// row_bytes bytes, each `k` values in `fmt` (ENG_F16, or the GGUF blocks
// ENG_Q8_0, ENG_Q4_0, ENG_Q2_K ... ENG_Q6_K), whose values are exactly ggml's
// dequantised f32 values (engram_common.cuh, as src/formats dequantises them).
//
// - engram_gemv_q_<NT> (up to ENG_GEMV_MAX tokens; bandwidth-bound): each warp
//   computes ENG_GEMV_ROWS output rows for all NT tokens, dequantising each
//   weight in registers as the FMAs need it: kv[t][o] = bf16(sum_k rows[t][k] *
//   w[o][k]), f32 products and sums, as the CPU backend's quantised path
//   computes (its f32 path on the same values), in another order. Needs
//   k % 32 == 0 and `rows` 16-byte aligned (the host checks).
// - engram_dequant_bf16: rows row0 .. row0 + n_rows of wkv to bf16 (nearest
//   even) into a tile, which cuBLAS then multiplies (larger batches); the
//   rounding of the weights to bf16 is in the bound the tests state.
#include "engram_common.cuh"

// Value i of a wkv row, as f32.
__device__ __forceinline__ float eng_wkv_value(eng_u32 fmt, const eng_u8 *row, eng_u32 i) {
    switch (fmt) {
    case ENG_F16: return eng_f16_at(row + 2u * i);
    case ENG_Q8_0: return eng_q8_0(row + (i / ENG_Q8_0_BLOCK) * ENG_Q8_0_BLOCK_BYTES, i % ENG_Q8_0_BLOCK);
    case ENG_Q4_0: return eng_q4_0(row + (i / ENG_Q4_0_BLOCK) * ENG_Q4_0_BLOCK_BYTES, i % ENG_Q4_0_BLOCK);
    case ENG_Q2_K: return eng_q2_k(row + (i / ENG_Q2_K_BLOCK) * ENG_Q2_K_BLOCK_BYTES, i % ENG_Q2_K_BLOCK);
    case ENG_Q3_K: return eng_q3_k(row + (i / ENG_Q3_K_BLOCK) * ENG_Q3_K_BLOCK_BYTES, i % ENG_Q3_K_BLOCK);
    case ENG_Q4_K: return eng_q4_k(row + (i / ENG_Q4_K_BLOCK) * ENG_Q4_K_BLOCK_BYTES, i % ENG_Q4_K_BLOCK);
    case ENG_Q5_K: return eng_q5_k(row + (i / ENG_Q5_K_BLOCK) * ENG_Q5_K_BLOCK_BYTES, i % ENG_Q5_K_BLOCK);
    case ENG_Q6_K: return eng_q6_k(row + (i / ENG_Q6_K_BLOCK) * ENG_Q6_K_BLOCK_BYTES, i % ENG_Q6_K_BLOCK);
    default: return 0.f;
    }
}

// The 32 values of unit u (values 32u .. 32u + 31) of a wkv row. The switch
// is outside the loops, so each loop's block address and scales are common
// to its 32 values.
__device__ __forceinline__ void eng_wkv_unit(eng_u32 fmt, const eng_u8 *row, eng_u32 u, float *v) {
    switch (fmt) {
    case ENG_F16:
#pragma unroll
        for (int j = 0; j < 32; j++) v[j] = eng_f16_at(row + 64u * u + 2u * (eng_u32)j);
        break;
    case ENG_Q8_0: {
        const eng_u8 *b = row + u * ENG_Q8_0_BLOCK_BYTES;
#pragma unroll
        for (int j = 0; j < 32; j++) v[j] = eng_q8_0(b, (eng_u32)j);
        break;
    }
    case ENG_Q4_0: {
        const eng_u8 *b = row + u * ENG_Q4_0_BLOCK_BYTES;
#pragma unroll
        for (int j = 0; j < 32; j++) v[j] = eng_q4_0(b, (eng_u32)j);
        break;
    }
    default:
        // K-quants: 8 units of 32 values per 256-value block.
        for (int j = 0; j < 32; j++) v[j] = eng_wkv_value(fmt, row, u * 32u + (eng_u32)j);
        break;
    }
}

// A bf16 pair of a 32-bit word, as f32.
__device__ __forceinline__ float eng_lo_bf16(eng_u32 w) { return eng_f32_from_bits(w << 16); }
__device__ __forceinline__ float eng_hi_bf16(eng_u32 w) { return eng_f32_from_bits(w & 0xFFFF0000u); }

template <int NT>
__device__ __forceinline__ void eng_gemv_q(const eng_u8 *__restrict__ w, eng_u32 fmt, eng_u32 row_bytes,
                                           const uint4 *__restrict__ rows, eng_u16 *__restrict__ kv,
                                           eng_u32 n_out, eng_u32 k) {
    const eng_u64 warp = (eng_u64)blockIdx.x * (blockDim.x / 32u) + threadIdx.x / 32u;
    const eng_u32 lane = threadIdx.x % 32u;
    if (warp * ENG_GEMV_ROWS >= n_out) return;
    const eng_u32 o0 = (eng_u32)(warp * ENG_GEMV_ROWS);
    const eng_u32 units = k / 32u;
    const eng_u32 k8 = k / 8u;
    float acc[ENG_GEMV_ROWS][NT];
#pragma unroll
    for (int r = 0; r < ENG_GEMV_ROWS; r++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[r][t] = 0.f;
    for (eng_u32 u = lane; u < units; u += 32u) {
#pragma unroll
        for (int r = 0; r < ENG_GEMV_ROWS; r++) {
            const eng_u32 o = o0 + r < n_out ? o0 + r : n_out - 1u;
            float wv[32];
            eng_wkv_unit(fmt, w + (eng_u64)o * row_bytes, u, wv);
#pragma unroll
            for (int t = 0; t < NT; t++) {
                const uint4 *x = rows + (eng_u64)t * k8 + 4u * u;
                float a = acc[r][t];
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    const uint4 xv = x[q];
                    const eng_u32 xs[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        a += wv[8 * q + 2 * i] * eng_lo_bf16(xs[i]);
                        a += wv[8 * q + 2 * i + 1] * eng_hi_bf16(xs[i]);
                    }
                }
                acc[r][t] = a;
            }
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
#define ENG_GEMV_Q_ENTRY(NT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(ENG_GEMV_THREADS)                                                \
        engram_gemv_q_##NT(const eng_u8 *w, eng_u32 fmt, eng_u32 row_bytes, const uint4 *rows, eng_u16 *kv,      \
                           eng_u32 n_out, eng_u32 k) {                                                           \
        eng_gemv_q<NT>(w, fmt, row_bytes, rows, kv, n_out, k);                                                   \
    }
ENG_GEMV_Q_ENTRY(1)
ENG_GEMV_Q_ENTRY(2)
ENG_GEMV_Q_ENTRY(3)
ENG_GEMV_Q_ENTRY(4)
ENG_GEMV_Q_ENTRY(5)
ENG_GEMV_Q_ENTRY(6)
ENG_GEMV_Q_ENTRY(7)
ENG_GEMV_Q_ENTRY(8)
#if ENG_GEMV_MAX != 8
#error "ENG_GEMV_MAX (src/cuda/kernels.rs GEMV_MAX) must match the entries above"
#endif

// Grid: ceil(n_rows * k / ENG_DEQUANT_THREADS) blocks of ENG_DEQUANT_THREADS;
// out[r][i] = bf16(value i of wkv row row0 + r), r < n_rows.
extern "C" __global__ void __launch_bounds__(ENG_DEQUANT_THREADS)
    engram_dequant_bf16(const eng_u8 *__restrict__ w, eng_u32 fmt, eng_u32 row_bytes, eng_u32 k, eng_u32 row0,
                        eng_u32 n_rows, eng_u16 *__restrict__ out) {
    const eng_u64 i = (eng_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (eng_u64)n_rows * k) return;
    const eng_u32 r = (eng_u32)(i / k), e = (eng_u32)(i % k);
    out[i] = eng_f32_to_bf16(eng_wkv_value(fmt, w + (eng_u64)(row0 + r) * row_bytes, e));
}
