// The gate (SPEC section 1, step 6), in place on the highway: one warp per
// (token t, stream s), warp index t * hc + s over the grid. With x =
// highway[t, s, :], key = kv[t, s*D..], value = kv[t, hc*D..] and qk = q*k:
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
// small they underflow; a NaN or infinity), the warp sums the stream again
// in f64, as the CPU backend does; normal-range streams never take that path.
//
// Loads: a lane reads 8 values of x, key and q*k at a time with 16-byte loads
// (two for f32) and writes 8 of x with 16-byte stores, where D is a multiple
// of 8 and the highway, kv and q*k are 16-byte aligned (kv and q*k are the
// context's own buffers; the highway only needs its element's alignment), else
// a value at a time. The sums' order (below) is the same either way, and the
// same as when the gate was a 256-thread block per stream.
//
// Bits: the sums run in a different order than the CPU backend's, and NVRTC
// contracts products and sums into FMAs (--fmad=true) and uses its own
// expf, so the gate's bits may differ from the CPU's in the last places;
// the tests hold both to the bound of tests/common/bounds.rs. A NaN in the
// highway gives a NaN gate on both backends, with the canonical NaN bits
// (0x7FFFFFFF) on the GPU and x86's payload on the CPU.
#include "gate.cuh"

// Grid: src/cuda/kernels.rs gate_blocks(n_streams) blocks of ENG_GATE_THREADS,
// a warp per (token, stream): warp b of the grid is token b / hc, stream b % hc
// (a token's streams are neighbours, so its value row is read from memory
// once and then from L2).
template <typename HW, typename KV>
__device__ __forceinline__ void eng_gate(HW *highway, const KV *__restrict__ kv, const float *__restrict__ qk,
                                         const eng_u32 *__restrict__ flags, eng_u32 cols, eng_u32 hc,
                                         eng_u32 d, float eps, float inv_sqrt_d, eng_u32 *latch,
                                         eng_u32 *mirror, eng_u32 n_streams) {
    if (blockIdx.x == 0 && threadIdx.x == 0) eng_move_latch(latch, mirror);
    const eng_u32 lane = threadIdx.x % 32u;
    const eng_u64 b = (eng_u64)blockIdx.x * (blockDim.x / 32u) + threadIdx.x / 32u;
    if (b >= n_streams) return;
    eng_gate_stream<false>(b, lane, highway, kv, qk, flags, cols, hc, d, eps, inv_sqrt_d);
}

// Grid: gate_blocks(n_streams) blocks of ENG_GATE_THREADS (a warp per
// stream); n_streams = n_tokens * hc. Names: highway type, kv type.
#define ENG_GATE_ENTRY(NAME, HW, KV)                                                                             \
    extern "C" __global__ void __launch_bounds__(ENG_GATE_THREADS)                                                \
        NAME(HW *highway, const KV *kv, const float *qk, const eng_u32 *flags, eng_u32 cols, eng_u32 hc,         \
             eng_u32 d, float eps, float inv_sqrt_d, eng_u32 *latch, eng_u32 *mirror, eng_u32 n_streams) {       \
        eng_gate(highway, kv, qk, flags, cols, hc, d, eps, inv_sqrt_d, latch, mirror, n_streams);                \
    }
ENG_GATE_ENTRY(engram_gate_f32_bf16, float, eng_u16)
ENG_GATE_ENTRY(engram_gate_bf16_bf16, eng_u16, eng_u16)
ENG_GATE_ENTRY(engram_gate_f32_f32, float, float)
ENG_GATE_ENTRY(engram_gate_bf16_f32, eng_u16, float)
