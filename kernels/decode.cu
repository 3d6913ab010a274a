// The decode kernel (issue 17; the design is docs/cuda.md "The decode
// kernel"): for a few tokens, the gather, the projection and the gate in one
// persistent launch that streams wkv once per tile of tokens.
// engram_decode_<w> (w: bf16, or fp8 for the block-scaled fp8 wkv):
//
// - Phase A. Each block gathers the tile's (token, column) rows into its
//   shared memory (bf16, [tile][K]) exactly as engram_gather does a cell, and
//   its warps sum their pairs of output rows for the tile's tokens:
//   kv[t][o] = bf16(sum_k rows[t][k] * wkv[o][k]) in the order of
//   engram_gemv_bf16_* (lane l adds chunks of 8 values l, l + 32, ... with an
//   fma each, then an xor butterfly over the lanes), so a token's kv does not
//   depend on the batch, the tile, the grid or the GPU. Of the blocks, block
//   `cell mod gridDim` also writes each cell's row to rows_out, its flag and
//   any error (the latch). With no highway, that is all: any launch, no
//   block waits for another.
// - With a highway: the last block done finishes (phase B). Each block, once
//   its kv rows are written, makes them visible to the device and counts
//   itself on the launch's `done` word (an atomicAdd); the block that counts
//   last (every other block has written its kv) puts the word back to zero,
//   moves the latch to the host-mapped mirror and its warps do the gate
//   kernel's work for each (token, stream) (the same function, so the same
//   bits); the other blocks end. No block ever waits for another, so the
//   kernel needs no co-residency: an ordinary launch, of any grid, next to
//   an engine's persistent kernels, under MPS or in a green context.
//
// Pairs of output rows p = (2p, 2p + 1), P = ceil(n_out / 2) of them: block b
// takes pairs floor(b P / G) .. floor((b + 1) P / G) - 1 (G = gridDim.x), its
// warp w the pairs p0 + w, p0 + w + warps, ... of them. A warp streams its
// pairs' rows ENG_DECODE_PREFETCH chunks (16 bytes of bf16, 8 of fp8 codes, a
// lane, per row) at a time, the next ones in flight while it sums these
// (they are the lane's next chunks in its order: the sums are unchanged);
// the first ones are loaded before the tile's gather (the weights do not
// depend on the row ids).
//
// Needs k % 8 == 0, wkv 16-byte aligned (bf16) or its codes 8-byte aligned
// (fp8), `tile` * k bf16 values of dynamic shared memory, 1 <= tile <=
// ENG_DECODE_TILE and rows_out, kv 16-byte aligned (the host checks and sizes).
#include "engram_common.cuh"
#include "gate.cuh"
#include "gather.cuh"
#include "latch.cuh"

static_assert(ENG_DECODE_THREADS % 32 == 0 && ENG_DECODE_THREADS >= 32 && ENG_DECODE_THREADS <= 1024,
              "a decode block is whole warps (ENG_DECODE_THREADS, src/cuda/kernels.rs)");
static_assert(ENG_DECODE_TILE >= 1 && ENG_DECODE_PREFETCH >= 1 && ENG_DECODE_MIN_BLOCKS >= 1,
              "src/cuda/kernels.rs decode constants");
#define ENG_DECODE_ROWS 2

// The block's gathered rows: [tile][k / 8] 16-byte words (the launch's
// dynamic shared memory).
extern __shared__ uint4 eng_decode_smem[];

// Where a cell's row goes in the decode kernel: the block's shared memory (the
// cell's row of the tile, `row`), and with `to_g` the rows workspace too.
struct eng_row_shared {
    eng_u16 *row;
    eng_row_global g;
    bool to_g;
    bool vec;
    __device__ __forceinline__ void store8(eng_u32 e, const eng_u16 *v) const {
        *(uint4 *)(row + e) = make_uint4(v[0] | ((eng_u32)v[1] << 16), v[2] | ((eng_u32)v[3] << 16),
                                         v[4] | ((eng_u32)v[5] << 16), v[6] | ((eng_u32)v[7] << 16));
        if (to_g) g.store8(e, v);
    }
    __device__ __forceinline__ void store1(eng_u32 i, eng_u16 v) const {
        row[i] = v;
        if (to_g) g.store1(i, v);
    }
};

// A lane's chunk of a weight row: 8 bf16 values (16 bytes) or 8 fp8 codes.
template <bool FP8> struct eng_wchunk;
template <> struct eng_wchunk<false> {
    typedef uint4 type;
};
template <> struct eng_wchunk<true> {
    typedef uint2 type;
};

// The 8 weights of chunk c of row o as f32 (exact): bf16 bits widened, or
// e4m3 codes times their block's e8m0 scale as engram_gemv_fp8_block
// converts them.
__device__ __forceinline__ void eng_w8(const uint4 &q, const eng_u8 *, eng_u32, eng_u32, eng_u32, eng_u32, eng_u32,
                                       float *v) {
    const eng_u32 x[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        v[2 * i] = eng_f32_from_bits(x[i] << 16);
        v[2 * i + 1] = eng_f32_from_bits(x[i] & 0xFFFF0000u);
    }
}
__device__ __forceinline__ void eng_w8(const uint2 &q, const eng_u8 *scales, eng_u32 o, eng_u32 c, eng_u32 br,
                                       eng_u32 bc, eng_u32 nbc, float *v) {
    const eng_u8 *srow = scales + (eng_u64)(o / br) * nbc;
    const eng_u32 qv[2] = {q.x, q.y};
    if (bc % 8u == 0u) {
        // One block holds the 8 values.
        const float s = eng_e8m0_to_f32(srow[(8u * c) / bc]);
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = ENG_MUL(eng_e4m3_to_f32((eng_u8)(qv[j / 4] >> (8 * (j % 4)))), s);
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++)
            v[j] = eng_fp8_block_value((eng_u8)(qv[j / 4] >> (8 * (j % 4))), srow, 8u * c + (eng_u32)j, bc);
    }
}

// Everything phase A needs: filled once per block into shared memory by the
// entry point and passed by pointer (not copied into each call's frame).
struct eng_decode_args {
    const eng_u8 *table;
    eng_u64 table_rows;
    eng_u32 fmt, hd, row_bytes;
    const eng_i64 *ids;
    eng_u32 id_stride, id_offset, cols;
    const eng_u8 *staged_rows;
    const eng_i64 *staged_ids;
    const eng_u32 *staged_slots;
    const eng_u8 *table_scales;
    eng_u16 *rows_out;
    eng_u32 *flags, *latch;
    eng_u32 layer_id, serial;
    const void *w;
    const eng_u8 *wscales;
    eng_u32 br, bc, nbc;
    eng_u16 *kv;
    eng_u32 n_out, k, nt, tile;
};

// The warp's pairs and where its stream of weights is: pair q of the warp is
// pair p0 + w + q * warps of the grid; a lane's chunks of a row are lane,
// lane + 32, ... (`steps` of them, some past the row's k8 chunks), taken
// ENG_DECODE_PREFETCH at a time (an item: `items` per pair).
struct eng_decode_stream {
    eng_u64 first, stride, pairs;
    eng_u32 lane, k8, items, n_out;
};

// Item `i` of the warp's pair `q` of both rows, into `buf` (nothing for a
// pair or chunk past the end).
template <bool FP8>
__device__ __forceinline__ void eng_decode_load(const typename eng_wchunk<FP8>::type *__restrict__ w,
                                                const eng_decode_stream &st, eng_u64 q, eng_u32 i,
                                                typename eng_wchunk<FP8>::type (*buf)[ENG_DECODE_ROWS]) {
    if (q >= st.pairs) return;
    const eng_u64 pair = st.first + q * st.stride;
#pragma unroll
    for (int j = 0; j < ENG_DECODE_PREFETCH; j++) {
        const eng_u32 c = st.lane + 32u * (ENG_DECODE_PREFETCH * i + (eng_u32)j);
        if (c < st.k8) {
#pragma unroll
            for (int r = 0; r < ENG_DECODE_ROWS; r++) {
                const eng_u64 o0 = ENG_DECODE_ROWS * pair + (eng_u64)r;
                const eng_u64 o = o0 < st.n_out ? o0 : st.n_out - 1u;
                buf[j][r] = __ldg(w + o * st.k8 + c);
            }
        }
    }
}

// The decode kernels' gather of one cell into shared memory (one body for
// every decode kernel: not inlined).
__device__ __noinline__ void eng_decode_gather_cell(const eng_decode_args *__restrict__ pa, eng_u64 pos,
                                                    eng_u32 lane, const eng_row_shared &out) {
    const eng_decode_args &a = *pa;
    eng_gather_cell(pos, lane, a.table, a.table_scales, a.table_rows, a.fmt, a.hd, a.row_bytes, a.ids, a.id_stride,
                    a.id_offset, a.cols, a.staged_rows, a.staged_ids, a.staged_slots, out, out.to_g, a.flags, a.latch, a.layer_id,
                    a.serial);
}

// Phase A (see the top of the file): one body per weight format, which the
// plain and the cooperative kernels call (not inlined).
template <bool FP8> __device__ __noinline__ void eng_decode_phase_a(const eng_decode_args *__restrict__ pa) {
    const eng_decode_args &a = *pa;
    typedef typename eng_wchunk<FP8>::type WT;
    const WT *__restrict__ w = (const WT *)a.w;
    const eng_u32 lane = threadIdx.x % 32u, wib = threadIdx.x / 32u, warps = blockDim.x / 32u;
    const eng_u32 k8 = a.k / 8u;
    const eng_u32 steps = (k8 + 31u) / 32u; // chunks a lane takes per row (some past the row)
    // The block's pairs [p0, p1), the warp's p0 + wib, p0 + wib + warps, ...
    const eng_u64 pairs = (a.n_out + ENG_DECODE_ROWS - 1u) / ENG_DECODE_ROWS;
    const eng_u64 p0 = (eng_u64)blockIdx.x * pairs / gridDim.x, p1 = ((eng_u64)blockIdx.x + 1u) * pairs / gridDim.x;
    const eng_decode_stream st = {p0 + wib,
                                  warps,
                                  p1 - p0 > wib ? (p1 - p0 - wib + warps - 1u) / warps : 0u,
                                  lane,
                                  k8,
                                  (steps + ENG_DECODE_PREFETCH - 1u) / ENG_DECODE_PREFETCH,
                                  a.n_out};
    eng_u16 *smem = (eng_u16 *)eng_decode_smem;
    const bool vec_out = a.hd % ENG_GATHER_VEC == 0u && ((eng_u64)a.rows_out & 15u) == 0u;
    for (eng_u32 t0 = 0u; t0 < a.nt; t0 += a.tile) {
        const eng_u32 tn = a.nt - t0 < a.tile ? a.nt - t0 : a.tile;
        // The warp's first item, in flight during the gather.
        WT cur[ENG_DECODE_PREFETCH][ENG_DECODE_ROWS], nxt[ENG_DECODE_PREFETCH][ENG_DECODE_ROWS];
        eng_decode_load<FP8>(w, st, 0u, 0u, cur);
        // The tile's cells, a warp each; block cell mod G reports it.
        const eng_u32 cells = tn * a.cols;
        for (eng_u32 cell = wib; cell < cells; cell += warps) {
            const eng_u64 pos = (eng_u64)t0 * a.cols + cell;
            const eng_u32 tl = cell / a.cols, c = cell % a.cols;
            const eng_row_shared out = {smem + (eng_u64)tl * a.k + (eng_u64)c * a.hd,
                                        {a.rows_out, 0u, pos * a.hd, vec_out},
                                        pos % gridDim.x == blockIdx.x,
                                        a.hd % ENG_GATHER_VEC == 0u && vec_out};
            eng_decode_gather_cell(pa, pos, lane, out);
        }
        __syncthreads();
        const uint4 *rows = (const uint4 *)eng_decode_smem;
        for (eng_u64 q = 0u; q < st.pairs; q++) {
            const eng_u64 pair = st.first + q * st.stride;
            float acc[ENG_DECODE_ROWS][ENG_DECODE_TILE];
#pragma unroll
            for (int r = 0; r < ENG_DECODE_ROWS; r++)
#pragma unroll
                for (int t = 0; t < ENG_DECODE_TILE; t++) acc[r][t] = 0.f;
            for (eng_u32 i = 0u; i < st.items; i++) {
                // The next item (of this pair, or the next pair's first) in
                // flight while this one is summed.
                if (i + 1u < st.items) {
                    eng_decode_load<FP8>(w, st, q, i + 1u, nxt);
                } else {
                    eng_decode_load<FP8>(w, st, q + 1u, 0u, nxt);
                }
#pragma unroll
                for (int j = 0; j < ENG_DECODE_PREFETCH; j++) {
                    const eng_u32 c = lane + 32u * (ENG_DECODE_PREFETCH * i + (eng_u32)j);
                    if (c < k8) {
                        float wv[ENG_DECODE_ROWS][8];
#pragma unroll
                        for (int r = 0; r < ENG_DECODE_ROWS; r++) {
                            const eng_u64 o0 = ENG_DECODE_ROWS * pair + (eng_u64)r;
                            const eng_u32 o = (eng_u32)(o0 < a.n_out ? o0 : a.n_out - 1u);
                            eng_w8(cur[j][r], a.wscales, o, c, a.br, a.bc, a.nbc, wv[r]);
                        }
#pragma unroll
                        for (int t = 0; t < ENG_DECODE_TILE; t++) {
                            if ((eng_u32)t < tn) { // uniform across the warp
                                const uint4 xq = rows[(eng_u64)t * k8 + c];
                                const eng_u32 xv[4] = {xq.x, xq.y, xq.z, xq.w};
#pragma unroll
                                for (int r = 0; r < ENG_DECODE_ROWS; r++) {
                                    float v = acc[r][t];
#pragma unroll
                                    for (int e = 0; e < 4; e++) {
                                        v = __fmaf_rn(wv[r][2 * e], eng_f32_from_bits(xv[e] << 16), v);
                                        v = __fmaf_rn(wv[r][2 * e + 1], eng_f32_from_bits(xv[e] & 0xFFFF0000u), v);
                                    }
                                    acc[r][t] = v;
                                }
                            }
                        }
                    }
                }
#pragma unroll
                for (int j = 0; j < ENG_DECODE_PREFETCH; j++)
#pragma unroll
                    for (int r = 0; r < ENG_DECODE_ROWS; r++) cur[j][r] = nxt[j][r];
            }
            // The pair is summed: the butterfly, then kv.
#pragma unroll
            for (int r = 0; r < ENG_DECODE_ROWS; r++) {
                const eng_u64 o = ENG_DECODE_ROWS * pair + (eng_u64)r;
#pragma unroll
                for (int t = 0; t < ENG_DECODE_TILE; t++) {
                    if ((eng_u32)t < tn) { // uniform across the warp
                        float v = acc[r][t];
                        for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, m);
                        if (lane == 0u && o < a.n_out) a.kv[(eng_u64)(t0 + (eng_u32)t) * a.n_out + o] = eng_f32_to_bf16(v);
                    }
                }
            }
        }
        // Every warp is done with the tile's rows before the next tile's
        // gather overwrites them.
        __syncthreads();
    }
}

// The gate of (token, stream) pair b after the barrier (one body per highway
// type: not inlined).
template <typename HW>
__device__ __noinline__ void eng_decode_gate(const eng_decode_args *__restrict__ pa, eng_u64 b, eng_u32 lane,
                                             HW *highway, const float *qk, eng_u32 hc, eng_u32 d, float eps,
                                             float inv_sqrt_d) {
    eng_gate_stream<true>(b, lane, highway, (const eng_u16 *)pa->kv, qk, pa->flags, pa->cols, hc, d, eps,
                          inv_sqrt_d);
}

// Whether this block is the last of the grid to get here; every block calls
// it once, after the last write the gate reads. `done` is zero before the
// launch and zero again after it (the last block puts it back). Thread 0, once
// the block's threads are here (__syncthreads), makes the block's writes
// visible to the device (__threadfence: they happen before its count) and
// counts the block (atomicAdd); the block that counts gridDim.x - 1 blocks
// before it fences again, so that every other block's writes (each made
// visible before that block counted) are visible to its threads after the
// closing __syncthreads. Nothing waits: no co-residency is needed.
__device__ __forceinline__ bool eng_last_block_done(eng_u32 *done) {
    __shared__ eng_u32 last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const eng_u32 before = atomicAdd(done, 1u);
        last = before == gridDim.x - 1u ? 1u : 0u;
        if (last != 0u) {
            atomicExch(done, 0u);
            __threadfence();
        }
    }
    __syncthreads();
    return last != 0u;
}

#define ENG_DECODE_PARAMS                                                                                        \
    const eng_u8 *table, eng_u64 table_rows, eng_u32 fmt, eng_u32 hd, eng_u32 row_bytes, const eng_i64 *ids,      \
        eng_u32 id_stride, eng_u32 id_offset, eng_u32 cols, const eng_u8 *staged_rows, const eng_i64 *staged_ids, \
        const eng_u32 *staged_slots, const eng_u8 *table_scales, eng_u16 *rows_out, eng_u32 *flags, eng_u32 *latch, eng_u32 layer_id,         \
        eng_u32 serial, const void *w, const eng_u8 *wscales, eng_u32 br, eng_u32 bc, eng_u32 nbc, eng_u16 *kv,   \
        eng_u32 n_out, eng_u32 k, eng_u32 nt, eng_u32 tile
#define ENG_DECODE_ARGS                                                                                          \
    {table,       table_rows, fmt,      hd,    row_bytes, ids,      id_stride, id_offset, cols, staged_rows,       \
     staged_ids,  staged_slots, table_scales, rows_out, flags, latch,   layer_id, serial,    w,         wscales, br,           \
     bc,          nbc,        kv,       n_out, k,         nt,       tile}

// Grid: any number of blocks of ENG_DECODE_THREADS (src/cuda/kernels.rs
// decode_grid), `tile` * k * 2 bytes of dynamic shared memory, an ordinary
// launch. With `highway` NULL: phase A only. With a highway (f32, or bf16
// with `hw_bf16`): phase A, then the last block done (counted on `done`,
// the context's word, zero between launches: the context's calls are
// ordered, docs/cuda-streams.md) moves the latch and runs the gate of every
// (token, stream) with its warps.
#define ENG_DECODE_ENTRY(NAME, FP8)                                                                              \
    extern "C" __global__ void __launch_bounds__(ENG_DECODE_THREADS, ENG_DECODE_MIN_BLOCKS)                      \
        NAME(ENG_DECODE_PARAMS, void *highway, eng_u32 hw_bf16, const float *qk, eng_u32 hc, eng_u32 d,          \
             float eps, float inv_sqrt_d, eng_u32 *mirror, eng_u32 *done) {                                      \
        __shared__ eng_decode_args a;                                                                            \
        if (threadIdx.x == 0) a = eng_decode_args ENG_DECODE_ARGS;                                               \
        __syncthreads();                                                                                         \
        eng_decode_phase_a<FP8>(&a);                                                                             \
        if (highway == nullptr) return; /* the same for every thread of the grid */                              \
        if (!eng_last_block_done(done)) return; /* the same for every thread of the block */                     \
        if (threadIdx.x == 0) eng_move_latch(latch, mirror);                                                     \
        const eng_u32 lane = threadIdx.x % 32u, warps = blockDim.x / 32u;                                        \
        const eng_u64 n_streams = (eng_u64)nt * hc;                                                              \
        for (eng_u64 b = threadIdx.x / 32u; b < n_streams; b += warps) {                                         \
            if (hw_bf16) {                                                                                       \
                eng_decode_gate(&a, b, lane, (eng_u16 *)highway, qk, hc, d, eps, inv_sqrt_d);                    \
            } else {                                                                                             \
                eng_decode_gate(&a, b, lane, (float *)highway, qk, hc, d, eps, inv_sqrt_d);                      \
            }                                                                                                    \
        }                                                                                                        \
    }
ENG_DECODE_ENTRY(engram_decode_bf16, false)
ENG_DECODE_ENTRY(engram_decode_fp8, true)
