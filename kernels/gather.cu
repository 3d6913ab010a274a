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
