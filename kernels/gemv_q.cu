// The projection with a quantised (or f16) wkv, read in place: rows of
// row_bytes bytes, each `k` values in one format (ENG_F16, or the GGUF blocks
// ENG_Q8_0, ENG_Q4_0, ENG_Q2_K ... ENG_Q6_K), whose values are exactly ggml's
// dequantised f32 values (engram_common.cuh, as src/formats dequantises them).
//
// - engram_gemv_q_<format> (up to ENG_GEMV_MAX tokens, `nt` at run time;
//   bandwidth-bound): each warp computes ENG_GEMV_ROWS output rows for all nt
//   tokens, copying its rows 32 units (32 values each) at a time into shared
//   memory with 16-byte loads where aligned, and dequantising each weight
//   from there as the FMAs need it:
//   kv[t][o] = bf16(sum_k rows[t][k] * w[o][k]), f32 products and sums, as the
//   CPU backend's quantised path computes (its f32 path on the same values),
//   in another order. Needs k % 32 == 0 and `rows` 16-byte aligned (the host
//   checks). One kernel per format, its dequantisation specialised; the token
//   loop is unrolled to ENG_GEMV_MAX with a uniform guard, so one kernel
//   serves every token count (the code stays small enough for NVRTC to
//   compile in seconds).
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

// Values 8c .. 8c + 7 of the 32-value unit u of a wkv row in format FMT,
// exactly eng_wkv_value's: eight values share one block and one sub-block
// scale, which are read and converted once.
template <eng_u32 FMT>
__device__ __forceinline__ void eng_wkv_8(const eng_u8 *row, eng_u32 u, eng_u32 c, float *v) {
    const eng_u32 e0 = 32u * u + 8u * c;
    if (FMT == ENG_F16) {
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = eng_f16_at(row + 2u * (e0 + (eng_u32)j));
    } else if (FMT == ENG_Q8_0 || FMT == ENG_Q4_0) {
        // One block per unit.
        const eng_u8 *b = row + u * (FMT == ENG_Q8_0 ? ENG_Q8_0_BLOCK_BYTES : ENG_Q4_0_BLOCK_BYTES);
        const float d = eng_f16_at(b + (FMT == ENG_Q8_0 ? ENG_Q8_0_D : ENG_Q4_0_D));
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const eng_u32 e = 8u * c + (eng_u32)j;
            float q;
            if (FMT == ENG_Q8_0) {
                q = (float)(eng_i8)b[ENG_Q8_0_QS + e];
            } else {
                q = (float)((eng_i32)(e < 16u ? (b[ENG_Q4_0_QS + e] & 0xFu) : (b[ENG_Q4_0_QS + e - 16u] >> 4)) - 8);
            }
            v[j] = ENG_MUL(q, d);
        }
    } else {
        // K-quants: 256-value blocks; 8 values lie in one sub-block of 16 or 32.
        const eng_u32 bb = FMT == ENG_Q2_K   ? ENG_Q2_K_BLOCK_BYTES
                           : FMT == ENG_Q3_K ? ENG_Q3_K_BLOCK_BYTES
                           : FMT == ENG_Q4_K ? ENG_Q4_K_BLOCK_BYTES
                           : FMT == ENG_Q5_K ? ENG_Q5_K_BLOCK_BYTES
                                             : ENG_Q6_K_BLOCK_BYTES;
        const eng_u8 *b = row + (e0 / 256u) * bb;
        const eng_u32 el = e0 % 256u;
        float s1 = 0.f, s2 = 0.f;
        if (FMT == ENG_Q2_K) eng_q2_k_scale(b, el, &s1, &s2);
        if (FMT == ENG_Q3_K) s1 = eng_q3_k_scale(b, el);
        if (FMT == ENG_Q4_K || FMT == ENG_Q5_K) eng_k4_scale(b, el, &s1, &s2);
        if (FMT == ENG_Q6_K) s1 = eng_q6_k_scale(b, el);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const eng_u32 e = el + (eng_u32)j;
            if (FMT == ENG_Q2_K) v[j] = eng_q2_k_at(b, e, s1, s2);
            if (FMT == ENG_Q3_K) v[j] = eng_q3_k_at(b, e, s1);
            if (FMT == ENG_Q4_K) v[j] = eng_q4_k_at(b, e, s1, s2);
            if (FMT == ENG_Q5_K) v[j] = eng_q5_k_at(b, e, s1, s2);
            if (FMT == ENG_Q6_K) v[j] = eng_q6_k_at(b, e, s1);
        }
    }
}

// A bf16 pair of a 32-bit word, as f32.
__device__ __forceinline__ float eng_lo_bf16(eng_u32 w) { return eng_f32_from_bits(w << 16); }
__device__ __forceinline__ float eng_hi_bf16(eng_u32 w) { return eng_f32_from_bits(w & 0xFFFF0000u); }

// Bytes of `units` 32-value units of a wkv row in format FMT starting at a
// unit whose index is a multiple of 8 (a K-quant block is 8 units; 32 units
// are whole blocks of every format).
template <eng_u32 FMT> __device__ __forceinline__ eng_u32 eng_units_bytes(eng_u32 units) {
    if (FMT == ENG_F16) return 64u * units;
    if (FMT == ENG_Q8_0) return ENG_Q8_0_BLOCK_BYTES * units;
    if (FMT == ENG_Q4_0) return ENG_Q4_0_BLOCK_BYTES * units;
    const eng_u32 bb = FMT == ENG_Q2_K   ? ENG_Q2_K_BLOCK_BYTES
                       : FMT == ENG_Q3_K ? ENG_Q3_K_BLOCK_BYTES
                       : FMT == ENG_Q4_K ? ENG_Q4_K_BLOCK_BYTES
                       : FMT == ENG_Q5_K ? ENG_Q5_K_BLOCK_BYTES
                                         : ENG_Q6_K_BLOCK_BYTES;
    return bb * (units / 8u);
}

// Bytes of 32 units (a span: whole blocks of every format), and 16-byte
// words to hold them.
template <eng_u32 FMT> struct eng_span {
    static constexpr eng_u32 bytes = FMT == ENG_F16    ? 64u * 32u
                                     : FMT == ENG_Q8_0 ? ENG_Q8_0_BLOCK_BYTES * 32u
                                     : FMT == ENG_Q4_0 ? ENG_Q4_0_BLOCK_BYTES * 32u
                                     : FMT == ENG_Q2_K ? ENG_Q2_K_BLOCK_BYTES * 4u
                                     : FMT == ENG_Q3_K ? ENG_Q3_K_BLOCK_BYTES * 4u
                                     : FMT == ENG_Q4_K ? ENG_Q4_K_BLOCK_BYTES * 4u
                                     : FMT == ENG_Q5_K ? ENG_Q5_K_BLOCK_BYTES * 4u
                                                       : ENG_Q6_K_BLOCK_BYTES * 4u;
    static constexpr eng_u32 words = (bytes + 15u) / 16u;
};

// Copy `nb` bytes at `src` (global) to `dst` (shared, 16-byte aligned), the
// warp's lanes together, with the widest loads `src`'s alignment allows, the
// tail a byte at a time (a span that is not 16-byte aligned: a wkv whose
// rows are not a multiple of 16 bytes, or at an odd address).
__device__ __forceinline__ void eng_warp_copy(eng_u8 *dst, const eng_u8 *__restrict__ src, eng_u32 nb,
                                              eng_u32 lane) {
    const eng_u64 a = (eng_u64)src;
    eng_u32 done;
    if ((a & 15u) == 0u) {
        done = nb / 16u * 16u;
        for (eng_u32 q = lane; q < nb / 16u; q += 32u) ((uint4 *)dst)[q] = __ldg((const uint4 *)src + q);
    } else if ((a & 7u) == 0u) {
        done = nb / 8u * 8u;
        for (eng_u32 q = lane; q < nb / 8u; q += 32u) ((uint2 *)dst)[q] = __ldg((const uint2 *)src + q);
    } else if ((a & 3u) == 0u) {
        done = nb / 4u * 4u;
        for (eng_u32 q = lane; q < nb / 4u; q += 32u) ((eng_u32 *)dst)[q] = __ldg((const eng_u32 *)src + q);
    } else if ((a & 1u) == 0u) {
        done = nb / 2u * 2u;
        for (eng_u32 q = lane; q < nb / 2u; q += 32u) ((eng_u16 *)dst)[q] = __ldg((const eng_u16 *)src + q);
    } else {
        done = 0u;
    }
    for (eng_u32 q = done + lane; q < nb; q += 32u) dst[q] = __ldg(src + q);
}

// Each warp: ENG_GEMV_ROWS output rows for nt tokens. The weight rows are
// read 32 units (a span) at a time: the warp copies both rows' spans into
// shared memory with 16-byte loads where they are aligned (every load of
// both rows in flight at once), then lane l decodes unit l of the span (the
// blocks' bytes from shared memory) and adds its products, each token's
// bf16 values read once for both rows. Per lane the sums are those of the
// unit-per-lane kernel before (units l, l + 32, ... in order, each unit's
// 32 products in order), so the results are the same bits
// (tests/cuda_formats.rs the_fused_gemv_sums_in_its_documented_order).
template <eng_u32 FMT>
__device__ __forceinline__ void eng_gemv_q(const eng_u8 *__restrict__ w, eng_u32 row_bytes,
                                           const uint4 *__restrict__ rows, eng_u16 *__restrict__ kv,
                                           eng_u32 n_out, eng_u32 k, eng_u32 nt) {
    __shared__ uint4 s_w[ENG_GEMV_THREADS / 32][ENG_GEMV_ROWS][eng_span<FMT>::words];
    const eng_u64 warp = (eng_u64)blockIdx.x * (blockDim.x / 32u) + threadIdx.x / 32u;
    const eng_u32 lane = threadIdx.x % 32u, wib = threadIdx.x / 32u;
    if (warp * ENG_GEMV_ROWS >= n_out) return;
    const eng_u32 o0 = (eng_u32)(warp * ENG_GEMV_ROWS);
    const eng_u32 units = k / 32u;
    const eng_u32 k8 = k / 8u;
    float acc[ENG_GEMV_ROWS][ENG_GEMV_MAX];
#pragma unroll
    for (int r = 0; r < ENG_GEMV_ROWS; r++)
#pragma unroll
        for (int t = 0; t < ENG_GEMV_MAX; t++) acc[r][t] = 0.f;
    for (eng_u32 u0 = 0u; u0 < units; u0 += 32u) {
        const eng_u32 n_units = units - u0 < 32u ? units - u0 : 32u;
        const eng_u32 off = eng_units_bytes<FMT>(u0), nb = eng_units_bytes<FMT>(n_units);
        const eng_u8 *src[ENG_GEMV_ROWS];
        bool aligned = true;
#pragma unroll
        for (int r = 0; r < ENG_GEMV_ROWS; r++) {
            const eng_u32 o = o0 + r < n_out ? o0 + r : n_out - 1u;
            src[r] = w + (eng_u64)o * row_bytes + off;
            aligned = aligned && ((eng_u64)src[r] & 15u) == 0u;
        }
        if (aligned) {
            // Every 16-byte load of both rows' spans issued before any is
            // stored (the span's tail, under 16 bytes, a byte at a time).
            constexpr eng_u32 per_lane = (eng_span<FMT>::words + 31u) / 32u;
            const eng_u32 n16 = nb / 16u;
            uint4 v[ENG_GEMV_ROWS][per_lane];
#pragma unroll
            for (int r = 0; r < ENG_GEMV_ROWS; r++)
#pragma unroll
                for (eng_u32 i = 0; i < per_lane; i++)
                    if (lane + 32u * i < n16) v[r][i] = __ldg((const uint4 *)src[r] + lane + 32u * i);
#pragma unroll
            for (int r = 0; r < ENG_GEMV_ROWS; r++) {
#pragma unroll
                for (eng_u32 i = 0; i < per_lane; i++)
                    if (lane + 32u * i < n16) s_w[wib][r][lane + 32u * i] = v[r][i];
                if (lane < nb % 16u) ((eng_u8 *)s_w[wib][r])[16u * n16 + lane] = __ldg(src[r] + 16u * n16 + lane);
            }
        } else {
#pragma unroll 1
            for (int r = 0; r < ENG_GEMV_ROWS; r++) eng_warp_copy((eng_u8 *)s_w[wib][r], src[r], nb, lane);
        }
        __syncwarp();
        if (lane < n_units) {
            const eng_u32 u = u0 + lane;
#pragma unroll 1
            for (eng_u32 c = 0; c < 4u; c++) {
                float wv[ENG_GEMV_ROWS][8];
#pragma unroll
                for (int r = 0; r < ENG_GEMV_ROWS; r++) eng_wkv_8<FMT>((const eng_u8 *)s_w[wib][r], lane, c, wv[r]);
#pragma unroll
                for (int t = 0; t < ENG_GEMV_MAX; t++) {
                    if ((eng_u32)t < nt) {
                        const uint4 xv = rows[(eng_u64)t * k8 + 4u * u + c];
#pragma unroll
                        for (int r = 0; r < ENG_GEMV_ROWS; r++) {
                            float a = acc[r][t];
                            a += wv[r][0] * eng_lo_bf16(xv.x);
                            a += wv[r][1] * eng_hi_bf16(xv.x);
                            a += wv[r][2] * eng_lo_bf16(xv.y);
                            a += wv[r][3] * eng_hi_bf16(xv.y);
                            a += wv[r][4] * eng_lo_bf16(xv.z);
                            a += wv[r][5] * eng_hi_bf16(xv.z);
                            a += wv[r][6] * eng_lo_bf16(xv.w);
                            a += wv[r][7] * eng_hi_bf16(xv.w);
                            acc[r][t] = a;
                        }
                    }
                }
            }
        }
        // Every lane is done with the span before the next one overwrites it.
        __syncwarp();
    }
#pragma unroll
    for (int r = 0; r < ENG_GEMV_ROWS; r++)
#pragma unroll
        for (int t = 0; t < ENG_GEMV_MAX; t++) {
            if ((eng_u32)t < nt) { // uniform across the warp
                float v = acc[r][t];
                for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
                if (lane == 0u && o0 + r < n_out) kv[(eng_u64)t * n_out + o0 + r] = eng_f32_to_bf16(v);
            }
        }
}

// Grid: ceil(n_out / (ENG_GEMV_ROWS * ENG_GEMV_THREADS / 32)) blocks of ENG_GEMV_THREADS;
// nt in 1 .. ENG_GEMV_MAX tokens.
#define ENG_GEMV_Q_ENTRY(NAME, FMT)                                                                              \
    extern "C" __global__ void __launch_bounds__(ENG_GEMV_THREADS)                                                \
        engram_gemv_q_##NAME(const eng_u8 *w, eng_u32 row_bytes, const uint4 *rows, eng_u16 *kv, eng_u32 n_out,  \
                             eng_u32 k, eng_u32 nt) {                                                            \
        eng_gemv_q<FMT>(w, row_bytes, rows, kv, n_out, k, nt);                                                   \
    }
ENG_GEMV_Q_ENTRY(f16, ENG_F16)
ENG_GEMV_Q_ENTRY(q8_0, ENG_Q8_0)
ENG_GEMV_Q_ENTRY(q4_0, ENG_Q4_0)
ENG_GEMV_Q_ENTRY(q2_k, ENG_Q2_K)
ENG_GEMV_Q_ENTRY(q3_k, ENG_Q3_K)
ENG_GEMV_Q_ENTRY(q4_k, ENG_Q4_K)
ENG_GEMV_Q_ENTRY(q5_k, ENG_Q5_K)
ENG_GEMV_Q_ENTRY(q6_k, ENG_Q6_K)

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

// ---------------------------------------------------------------------------
// The checkpoint's block-scaled fp8 wkv (ENG_FP8_E4M3_E8M0_BLOCK), read in
// place: e4m3 codes [n_out, k] (one byte a value) and one e8m0 scale per
// br x bc block, scales [ceil(n_out / br), nbc = ceil(k / bc)]. Every value
// code * 2^(scale - 127) is exact in f32 and in bf16 (the host refuses any
// other at set_layer), so these kernels hold the very weights of the bf16
// path on the widened matrix:
//
// - engram_gemv_fp8_block (up to ENG_GEMV_MAX tokens, `nt` at run time): the
//   bf16 GEMV of gemv.cu, lane for lane and product for product (each lane
//   takes 8 values per step, element 2i then 2i + 1, acc += w * x), with each
//   weight converted in registers from its code and its block's scale: the
//   same sums, the same bits. Needs k % 8 == 0 and the codes 8-byte aligned
//   (the host checks).
// - engram_dequant_fp8_block: rows row0 .. row0 + n_rows to bf16 (exact) into
//   a tile for cuBLAS (larger batches), as the quantised formats do.

extern "C" __global__ void __launch_bounds__(ENG_GEMV_THREADS)
    engram_gemv_fp8_block(const eng_u8 *__restrict__ w, const eng_u8 *__restrict__ scales, eng_u32 br,
                          eng_u32 bc, eng_u32 nbc, const uint4 *__restrict__ rows, eng_u16 *__restrict__ kv,
                          eng_u32 n_out, eng_u32 k, eng_u32 nt) {
    const eng_u32 k8 = k / 8u;
    const eng_u64 warp = (eng_u64)blockIdx.x * (blockDim.x / 32u) + threadIdx.x / 32u;
    const eng_u32 lane = threadIdx.x % 32u;
    if (warp * ENG_GEMV_ROWS >= n_out) return;
    const eng_u32 o0 = (eng_u32)(warp * ENG_GEMV_ROWS);
    float acc[ENG_GEMV_ROWS][ENG_GEMV_MAX];
#pragma unroll
    for (int r = 0; r < ENG_GEMV_ROWS; r++)
#pragma unroll
        for (int t = 0; t < ENG_GEMV_MAX; t++) acc[r][t] = 0.f;
    for (eng_u32 c = lane; c < k8; c += 32u) {
        float wv[ENG_GEMV_ROWS][8];
#pragma unroll
        for (int r = 0; r < ENG_GEMV_ROWS; r++) {
            const eng_u32 o = o0 + r < n_out ? o0 + r : n_out - 1u;
            const uint2 q = ((const uint2 *)(w + (eng_u64)o * k))[c];
            const eng_u8 *srow = scales + (eng_u64)(o / br) * nbc;
            const eng_u32 qv[2] = {q.x, q.y};
            if (bc % 8u == 0u) {
                // One block holds the 8 values.
                const float s = eng_e8m0_to_f32(srow[(8u * c) / bc]);
#pragma unroll
                for (int j = 0; j < 8; j++)
                    wv[r][j] = ENG_MUL(eng_e4m3_to_f32((eng_u8)(qv[j / 4] >> (8 * (j % 4)))), s);
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++)
                    wv[r][j] = eng_fp8_block_value((eng_u8)(qv[j / 4] >> (8 * (j % 4))), srow, 8u * c + (eng_u32)j, bc);
            }
        }
#pragma unroll
        for (int t = 0; t < ENG_GEMV_MAX; t++) {
            if ((eng_u32)t < nt) { // uniform across the warp
                const uint4 rv = rows[(eng_u64)t * k8 + c];
                const eng_u32 xv[4] = {rv.x, rv.y, rv.z, rv.w};
#pragma unroll
                for (int r = 0; r < ENG_GEMV_ROWS; r++) {
                    float a = acc[r][t];
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        a += wv[r][2 * i] * eng_f32_from_bits(xv[i] << 16);
                        a += wv[r][2 * i + 1] * eng_f32_from_bits(xv[i] & 0xFFFF0000u);
                    }
                    acc[r][t] = a;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ENG_GEMV_ROWS; r++)
#pragma unroll
        for (int t = 0; t < ENG_GEMV_MAX; t++) {
            if ((eng_u32)t < nt) { // uniform across the warp
                float v = acc[r][t];
                for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
                if (lane == 0u && o0 + r < n_out) kv[(eng_u64)t * n_out + o0 + r] = eng_f32_to_bf16(v);
            }
        }
}

// Grid: ceil(n_rows * k / ENG_DEQUANT_THREADS) blocks of ENG_DEQUANT_THREADS;
// out[r][i] = bf16(value i of row row0 + r), r < n_rows (exact).
extern "C" __global__ void __launch_bounds__(ENG_DEQUANT_THREADS)
    engram_dequant_fp8_block(const eng_u8 *__restrict__ w, const eng_u8 *__restrict__ scales, eng_u32 br,
                             eng_u32 bc, eng_u32 nbc, eng_u32 k, eng_u32 row0, eng_u32 n_rows,
                             eng_u16 *__restrict__ out) {
    const eng_u64 i = (eng_u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (eng_u64)n_rows * k) return;
    const eng_u32 r = (eng_u32)(i / k), e = (eng_u32)(i % k);
    const eng_u32 o = row0 + r;
    const eng_u8 *srow = scales + (eng_u64)(o / br) * nbc;
    out[i] = eng_f32_to_bf16(eng_fp8_block_value(w[(eng_u64)o * k + e], srow, e, bc));
}
