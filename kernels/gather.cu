// Gather the rows of one engram layer by id and dequantise them:
// rows_out[t][c*Hd + i] = bf16 of value i of row ids[t][c] (or that bf16 value
// widened to f32, for an f32 wkv). One block per (token, column).
//
// Where a row is read from: a table in device memory (`table`, row `id` at
// table + id * row_bytes), or, for a table in host memory, the layer's device
// staging buffer (`staged_rows` non-NULL): the host staged the row of position
// (t, c) at staged_rows + (t * cols + c) * row_bytes and its id at
// staged_ids[t * cols + c]; a position whose staged id is not the id asked for
// is an error (ENG_ERR_NOT_STAGED: the engine replayed a graph without
// staging that step's rows).
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
// call in the order the CPU backend checks, whatever order the blocks ran in:
// row-id errors before row-data errors, then by token, then by column.
//
// engram_gather_split does the same for a device table in the split fp8
// format (ENG_FP8_E4M3_E8M0_SPLIT): its e4m3 codes in `table` (`hd` bytes a
// row) and its e8m0 scales in `scales` (`hd / 32` bytes a row). Staged rows
// are always packed (the host assembles them), so the staged path is shared.
#include "engram_common.cuh"
#include "latch.cuh"

__device__ __forceinline__ void eng_store_row(void *out, eng_u32 out_f32, eng_u64 at, eng_u16 v) {
    if (out_f32) {
        ((float *)out)[at] = eng_bf16_to_f32(v);
    } else {
        ((eng_u16 *)out)[at] = v;
    }
}

// One block per (token t, column c), block index t * cols + c; token t's id
// for column k is ids[t * id_stride + id_offset + k]. Every block checks its
// token's ids (all C of them: a few loads) so that each decides the token's
// status alone, and writes flags[t * cols + c]. `scales` is NULL but for a
// split fp8 table in device memory; `s` is the block's shared scratch (4 words).
__device__ __forceinline__ void eng_gather_block(const eng_u8 *__restrict__ table, const eng_u8 *__restrict__ scales,
                                                 eng_u64 table_rows, eng_u32 fmt, eng_u32 hd, eng_u32 row_bytes,
                                                 const eng_i64 *__restrict__ ids, eng_u32 id_stride,
                                                 eng_u32 id_offset, eng_u32 cols,
                                                 const eng_u8 *__restrict__ staged_rows,
                                                 const eng_i64 *__restrict__ staged_ids, void *rows_out,
                                                 eng_u32 out_f32, eng_u32 *flags, eng_u32 *latch, eng_u32 layer_id,
                                                 eng_u32 serial, eng_u32 *s) {
    eng_u32 &s_dead = s[0], &s_first_dead = s[1], &s_first_range = s[2], &s_err_at = s[3];
    const eng_u32 t = blockIdx.x / cols, c = blockIdx.x % cols;
    const eng_u64 base = ((eng_u64)t * cols + c) * hd;
    const eng_i64 *tid = ids + (eng_u64)t * id_stride + id_offset;
    if (threadIdx.x == 0) {
        s_dead = 0u;
        s_first_dead = 0xFFFFFFFFu;
        s_first_range = 0xFFFFFFFFu;
        s_err_at = 0xFFFFFFFFu;
    }
    __syncthreads();
    for (eng_u32 k = threadIdx.x; k < cols; k += blockDim.x) {
        const eng_i64 id = tid[k];
        if (id == -1) {
            atomicAdd(&s_dead, 1u);
            atomicMin(&s_first_dead, k);
        } else if (id < 0 || (eng_u64)id >= table_rows) {
            atomicMin(&s_first_range, k);
        }
    }
    __syncthreads();
    const eng_u32 dead = s_dead;
    eng_u32 status = ENG_TOKEN_LIVE;
    if (dead == cols) {
        status = ENG_TOKEN_DEAD;
    } else if (dead > 0u || s_first_range != 0xFFFFFFFFu) {
        status = ENG_TOKEN_BAD;
    }
    const eng_i64 id = tid[c];
    const eng_u64 pos = (eng_u64)t * cols + c;
    if (status == ENG_TOKEN_LIVE && staged_rows != 0 && staged_ids[pos] != id) {
        status = ENG_TOKEN_BAD;
        if (threadIdx.x == 0) {
            eng_latch(latch, ENG_ERR_NOT_STAGED, 0u, t, c, 0u, id, layer_id, serial);
        }
    }
    if (status != ENG_TOKEN_LIVE) {
        for (eng_u32 i = threadIdx.x; i < hd; i += blockDim.x) eng_store_row(rows_out, out_f32, base + i, 0u);
        if (threadIdx.x == 0) {
            flags[pos] = status;
            if (status == ENG_TOKEN_BAD && c == 0u) {
                // The CPU backend's order within a token: the first dead
                // column of a partly dead token, else the first id out of range.
                if (dead > 0u) {
                    eng_latch(latch, ENG_ERR_PARTLY_DEAD, 0u, t, s_first_dead, 0u, -1, layer_id, serial);
                } else if (s_first_range != 0xFFFFFFFFu) {
                    eng_latch(latch, ENG_ERR_ROW_RANGE, 0u, t, s_first_range, 0u, tid[s_first_range], layer_id,
                              serial);
                }
            }
        }
        return;
    }
    const eng_u8 *row, *srow = 0;
    if (staged_rows != 0) {
        row = staged_rows + pos * row_bytes;
    } else if (scales != 0) {
        row = table + (eng_u64)id * hd;
        srow = scales + (eng_u64)id * (hd / ENG_FP8_SCALE_BLOCK);
    } else {
        row = table + (eng_u64)id * row_bytes;
    }
    for (eng_u32 i = threadIdx.x; i < hd; i += blockDim.x) {
        eng_u16 v = 0u;
        eng_u32 where = 0u;
        const eng_u32 code = srow != 0 ? eng_dequant_fp8_split_bf16(row, srow, i, &v, &where)
                                       : eng_dequant_bf16(fmt, row, hd, i, &v, &where);
        if (code != 0u) {
            // Report the row's first failing element (a NaN scale fails every
            // element of its block), as the CPU backend does.
            v = 0u;
            atomicMin(&s_err_at, i);
        }
        eng_store_row(rows_out, out_f32, base + i, v);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        if (s_err_at != 0xFFFFFFFFu) {
            eng_u16 v;
            eng_u32 where = 0u;
            const eng_u32 code = srow != 0 ? eng_dequant_fp8_split_bf16(row, srow, s_err_at, &v, &where)
                                           : eng_dequant_bf16(fmt, row, hd, s_err_at, &v, &where);
            eng_latch(latch, code, 1u, t, c, where, id, layer_id, serial);
            flags[pos] = ENG_TOKEN_BAD;
        } else {
            flags[pos] = ENG_TOKEN_LIVE;
        }
    }
}

extern "C" __global__ void engram_gather(const eng_u8 *__restrict__ table, eng_u64 table_rows, eng_u32 fmt,
                                         eng_u32 hd, eng_u32 row_bytes, const eng_i64 *__restrict__ ids,
                                         eng_u32 id_stride, eng_u32 id_offset, eng_u32 cols,
                                         const eng_u8 *__restrict__ staged_rows,
                                         const eng_i64 *__restrict__ staged_ids, void *rows_out,
                                         eng_u32 out_f32, eng_u32 *flags, eng_u32 *latch, eng_u32 layer_id,
                                         eng_u32 serial) {
    __shared__ eng_u32 s[4];
    eng_gather_block(table, nullptr, table_rows, fmt, hd, row_bytes, ids, id_stride, id_offset, cols, staged_rows,
                     staged_ids, rows_out, out_f32, flags, latch, layer_id, serial, s);
}

// engram_gather for a device table in the split fp8 format: the same
// parameters, then `scales`.
extern "C" __global__ void engram_gather_split(const eng_u8 *__restrict__ table, eng_u64 table_rows, eng_u32 fmt,
                                               eng_u32 hd, eng_u32 row_bytes, const eng_i64 *__restrict__ ids,
                                               eng_u32 id_stride, eng_u32 id_offset, eng_u32 cols,
                                               const eng_u8 *__restrict__ staged_rows,
                                               const eng_i64 *__restrict__ staged_ids, void *rows_out,
                                               eng_u32 out_f32, eng_u32 *flags, eng_u32 *latch, eng_u32 layer_id,
                                               eng_u32 serial, const eng_u8 *__restrict__ scales) {
    __shared__ eng_u32 s[4];
    eng_gather_block(table, scales, table_rows, fmt, hd, row_bytes, ids, id_stride, id_offset, cols, staged_rows,
                     staged_ids, rows_out, out_f32, flags, latch, layer_id, serial, s);
}
