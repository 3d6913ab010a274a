// Gather the rows of one engram layer by id and dequantise them:
// rows_out[t][c*Hd + i] = bf16 of value i of row ids[t][c] (or that bf16 value
// widened to f32, for an f32 wkv). A persistent grid: each warp takes the
// (token, column) cells t * cols + c in a grid-stride loop and does a whole
// row (its lanes over the values), so a 4096-token prefill is a bounded grid
// (src/cuda/kernels.rs gather_blocks) instead of one block per cell.
//
// Where a row is read from: a table in device memory (`table`, row `id` at
// table + id * row_bytes), or, for a table in host memory, the layer's device
// staging buffer (`staged_rows` non-NULL): the host staged the row of position
// (t, c) at staged_rows + (t * cols + c) * row_bytes and its id at
// staged_ids[t * cols + c]; a position whose staged id is not the id asked for
// is an error (ENG_ERR_NOT_STAGED: the engine replayed a graph without
// staging that step's rows). With a device row cache (`staged_slots`
// non-NULL, docs/row-cache.md "Device tier") the row of position p is
// instead at staged_rows + staged_slots[p] * row_bytes: a row the host
// copied for this call (index below the staging area's size) or a cache slot
// (after it), which engram_cache_fill filled in an earlier call or in this
// one, before the gather on the same stream.
//
// How a row is read: a lane takes ENG_GATHER_VEC (8) consecutive values at a
// time with one 16-byte load (bf16, f16; two for f32) or one 8-byte load of
// fp8 codes (and their block's scale byte), and writes them with one 16-byte
// store (two for f32 output), where the format allows and the row and the
// output are aligned for it (Hd a multiple of 8; the row's address a multiple
// of the load); any other row (the GGUF blocks, a table at an odd address, an
// fp8 row at id * (Hd + Hd/32) not 8-byte aligned) is read a value per lane at
// a time. Both use the same per-value formulas (engram_common.cuh), so the
// bits do not depend on the path.
//
// The token's ids are checked here, as the CPU backend checks them on the host:
// all -1 is a dead token (rows zeroed, flags = DEAD); some -1 (partly dead),
// a negative id other than -1 or an id >= table_rows is an error; and a row
// whose data is invalid (an fp8 NaN scale or code, a value that is not finite
// once dequantised) is an error. The gate leaves a token alone when any of its
// C flags is not LIVE, so a token with an error is never applied. Its rows in
// the workspace are then not all zero (a bad row's valid elements are written,
// and its other columns' rows are gathered normally), but nothing reads them:
// read-back reports the error instead of returning rows.
//
// Errors are recorded in `latch` (see src/cuda/latch.rs): the first of the
// call in the order the CPU backend checks, whatever order the warps ran in:
// row-id errors before row-data errors, then by token, then by column.
//
// engram_gather_split does the same for a device table in the split fp8
// format (ENG_FP8_E4M3_E8M0_SPLIT): its e4m3 codes in `table` (`hd` bytes a
// row) and its e8m0 scales in `scales` (`hd / 32` bytes a row). Staged rows
// are always packed (the host assembles them), so the staged path is shared.
#include "gather.cuh"

// Grid: src/cuda/kernels.rs gather_blocks(n_cells) blocks of ENG_GATHER_THREADS.
extern "C" __global__ void __launch_bounds__(ENG_GATHER_THREADS)
    engram_gather(const eng_u8 *__restrict__ table, eng_u64 table_rows, eng_u32 fmt, eng_u32 hd, eng_u32 row_bytes,
                  const eng_i64 *__restrict__ ids, eng_u32 id_stride, eng_u32 id_offset, eng_u32 cols,
                  eng_u64 n_cells, const eng_u8 *__restrict__ staged_rows, const eng_i64 *__restrict__ staged_ids,
                  const eng_u32 *__restrict__ staged_slots, void *rows_out, eng_u32 out_f32, eng_u32 *flags, eng_u32 *latch, eng_u32 layer_id,
                  eng_u32 serial) {
    eng_gather_cells(table, nullptr, table_rows, fmt, hd, row_bytes, ids, id_stride, id_offset, cols, n_cells,
                     staged_rows, staged_ids, staged_slots, rows_out, out_f32, flags, latch, layer_id, serial);
}

// engram_gather for a device table in the split fp8 format: the same
// parameters, then `scales`.
extern "C" __global__ void __launch_bounds__(ENG_GATHER_THREADS)
    engram_gather_split(const eng_u8 *__restrict__ table, eng_u64 table_rows, eng_u32 fmt, eng_u32 hd,
                        eng_u32 row_bytes, const eng_i64 *__restrict__ ids, eng_u32 id_stride, eng_u32 id_offset,
                        eng_u32 cols, eng_u64 n_cells, const eng_u8 *__restrict__ staged_rows,
                        const eng_i64 *__restrict__ staged_ids, const eng_u32 *__restrict__ staged_slots,
                        void *rows_out, eng_u32 out_f32, eng_u32 *flags,
                        eng_u32 *latch, eng_u32 layer_id, eng_u32 serial, const eng_u8 *__restrict__ scales) {
    eng_gather_cells(table, scales, table_rows, fmt, hd, row_bytes, ids, id_stride, id_offset, cols, n_cells,
                     staged_rows, staged_ids, staged_slots, rows_out, out_f32, flags, latch, layer_id, serial);
}

// The device row cache's admissions of one call (docs/row-cache.md "Device
// tier"): entry e of `fill` is a pair (src, dst) of row indices in `rows`
// (src: a row the host copied into the call's staging area; dst: the cache
// slot it now holds); row dst becomes a copy of row src, `row_bytes` bytes.
// No two entries have the same dst, and no dst is a src, so the entries are
// independent. A warp an entry (grid-stride), its lanes over the bytes.
extern "C" __global__ void __launch_bounds__(ENG_GATHER_THREADS)
    engram_cache_fill(eng_u8 *__restrict__ rows, const eng_u32 *__restrict__ fill, eng_u32 n_fill,
                      eng_u32 row_bytes) {
    const eng_u32 lane = threadIdx.x % 32u;
    const eng_u64 stride = (eng_u64)gridDim.x * (blockDim.x / 32u);
    const eng_u64 warp = (eng_u64)blockIdx.x * (blockDim.x / 32u) + threadIdx.x / 32u;
    for (eng_u64 e = warp; e < n_fill; e += stride) {
        const eng_u8 *src = rows + (eng_u64)fill[2u * e] * row_bytes;
        eng_u8 *dst = rows + (eng_u64)fill[2u * e + 1u] * row_bytes;
        for (eng_u32 b = lane; b < row_bytes; b += 32u) dst[b] = src[b];
    }
}

// The split points (docs/sharding.md, src/cuda/split.rs).
//
// engram_gather_shard: the rows a shard owns, into the engine's buffer. Cell
// `pos` of `out` (`[n_cells, hd]`, f32 or bf16) is the row of local id
// ids[pos] of the table the context holds, read exactly as engram_gather
// reads a cell (eng_gather_cell, each cell its own one-column token), or -0.0
// in every value where ids[pos] is -1 (a row outside the shard's range, a
// head not asked for, a dead token): x + (-0) = x for every x, so the
// engine's all-reduce of the ranks' outputs is the whole rows bit for bit.
// The host wrote the ids in the output's order and checked each against the
// table. Grid: gather_blocks(n_cells) blocks of ENG_GATHER_THREADS.
extern "C" __global__ void __launch_bounds__(ENG_GATHER_THREADS)
    engram_gather_shard(const eng_u8 *__restrict__ table, const eng_u8 *__restrict__ scales, eng_u64 table_rows,
                        eng_u32 fmt, eng_u32 hd, eng_u32 row_bytes, const eng_i64 *__restrict__ ids,
                        eng_u64 n_cells, void *out, eng_u32 out_f32, eng_u32 *flags, eng_u32 *latch,
                        eng_u32 layer_id, eng_u32 serial) {
    const eng_u32 lane = threadIdx.x % 32u;
    const eng_u64 stride = (eng_u64)gridDim.x * (blockDim.x / 32u);
    const eng_u64 warp = (eng_u64)blockIdx.x * (blockDim.x / 32u) + threadIdx.x / 32u;
    const bool vec_out = hd % ENG_GATHER_VEC == 0u && ((eng_u64)out & 15u) == 0u;
    for (eng_u64 pos = warp; pos < n_cells; pos += stride) {
        if (ids[pos] == -1) {
            for (eng_u32 i = lane; i < hd; i += 32u) {
                if (out_f32) {
                    ((eng_u32 *)out)[pos * hd + i] = 0x80000000u;
                } else {
                    ((eng_u16 *)out)[pos * hd + i] = (eng_u16)0x8000u;
                }
            }
            continue;
        }
        const eng_row_global o = {out, out_f32, pos * hd, vec_out};
        eng_gather_cell(pos, lane, table, scales, table_rows, fmt, hd, row_bytes, ids, 1u, 0u, 1u, nullptr, nullptr, nullptr,
                        o, true, flags, latch, layer_id, serial);
    }
}

// engram_convert_values: dst[r * dst_ld + i] = src[r * src_ld + i] for r <
// n_rows, i < width, as f32 or bf16 bits each side: bf16 -> f32 widens
// (exact), f32 -> bf16 rounds to nearest even (eng_f32_to_bf16, the host's
// f32_to_bf16), a same-type copy moves the bits (no float arithmetic, so NaN
// payloads are kept). The split calls' values in and out of the engine's
// buffers. Grid-stride; any grid.
extern "C" __global__ void __launch_bounds__(ENG_GATHER_THREADS)
    engram_convert_values(const void *__restrict__ src, eng_u32 src_f32, eng_u64 src_ld, void *__restrict__ dst,
                          eng_u32 dst_f32, eng_u64 dst_ld, eng_u64 n_rows, eng_u64 width) {
    const eng_u64 total = n_rows * width;
    const eng_u64 stride = (eng_u64)gridDim.x * blockDim.x;
    for (eng_u64 j = (eng_u64)blockIdx.x * blockDim.x + threadIdx.x; j < total; j += stride) {
        const eng_u64 r = j / width, i = j % width;
        const eng_u64 s = r * src_ld + i, d = r * dst_ld + i;
        const eng_u32 bits = src_f32 ? ((const eng_u32 *)src)[s] : ((eng_u32)((const eng_u16 *)src)[s]) << 16;
        if (dst_f32) {
            ((eng_u32 *)dst)[d] = bits;
        } else if (src_f32) {
            ((eng_u16 *)dst)[d] = eng_f32_to_bf16(eng_f32_from_bits(bits));
        } else {
            ((eng_u16 *)dst)[d] = (eng_u16)(bits >> 16);
        }
    }
}
