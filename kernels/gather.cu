// Gather the rows of one engram layer by id from a device-resident table and
// dequantise them: rows_out[t][c*Hd + i] = bf16 of value i of row ids[t][c]
// (or that bf16 value widened to f32, for an f32 wkv). One block per row.
//
// The token's ids are checked here, as the CPU backend checks them on the host:
// all -1 is a dead token (rows zeroed, flags[t] = DEAD); some -1 (partly dead),
// a negative id other than -1 or an id >= table_rows is an error; and an fp8
// row with a NaN scale or code is an error. A token with an error gets zero
// rows and BAD flags (the gate leaves it untouched), and the first error of
// the call is recorded in `latch` (see engram_common.cuh for the codes).
// engram_gather_split does the same for a table whose fp8 codes and scales
// are two arrays.
#include "engram_common.cuh"

__device__ __forceinline__ void eng_latch(eng_u32 *latch, eng_u32 code, eng_u32 token, eng_u32 col,
                                          eng_u32 where, eng_i64 row, eng_u32 layer, eng_u32 serial) {
    if (atomicCAS(latch, 0u, code) == 0u) {
        latch[1] = token;
        latch[2] = col;
        latch[3] = where;
        latch[4] = (eng_u32)((eng_u64)row & 0xFFFFFFFFu);
        latch[5] = (eng_u32)((eng_u64)row >> 32);
        latch[6] = layer;
        latch[7] = serial;
    }
}

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
// status alone, and writes flags[t * cols + c]. `scales` is NULL, or (the
// split fp8 format) the table's e8m0 scale array: then `table` holds `hd` code
// bytes a row and `scales` `hd / 32` scale bytes a row. `s` is the block's
// shared scratch (4 words).
__device__ __forceinline__ void eng_gather_block(const eng_u8 *__restrict__ table, const eng_u8 *__restrict__ scales,
                                                 eng_u64 table_rows, eng_u32 fmt, eng_u32 hd, eng_u32 row_bytes,
                                                 const eng_i64 *__restrict__ ids, eng_u32 id_stride,
                                                 eng_u32 id_offset, eng_u32 cols, void *rows_out, eng_u32 out_f32,
                                                 eng_u32 *flags, eng_u32 *latch, eng_u32 layer_id, eng_u32 serial,
                                                 eng_u32 *s) {
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
    if (status != ENG_TOKEN_LIVE) {
        for (eng_u32 i = threadIdx.x; i < hd; i += blockDim.x) eng_store_row(rows_out, out_f32, base + i, 0u);
        if (threadIdx.x == 0) {
            flags[(eng_u64)t * cols + c] = status;
            if (status == ENG_TOKEN_BAD && c == 0u) {
                if (dead > 0u) {
                    eng_latch(latch, ENG_ERR_PARTLY_DEAD, t, s_first_dead, 0u, -1, layer_id, serial);
                } else {
                    eng_latch(latch, ENG_ERR_ROW_RANGE, t, s_first_range, 0u, tid[s_first_range], layer_id,
                              serial);
                }
            }
        }
        return;
    }
    const eng_i64 id = tid[c];
    const eng_u8 *row = table + (eng_u64)id * (scales ? hd : row_bytes);
    const eng_u8 *srow = scales ? scales + (eng_u64)id * (hd / ENG_FP8_SCALE_BLOCK) : row;
    for (eng_u32 i = threadIdx.x; i < hd; i += blockDim.x) {
        eng_u16 v = 0u;
        eng_u32 where = 0u;
        const eng_u32 code = scales ? eng_dequant_fp8_split_bf16(row, srow, i, &v, &where)
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
            const eng_u32 code = scales ? eng_dequant_fp8_split_bf16(row, srow, s_err_at, &v, &where)
                                        : eng_dequant_bf16(fmt, row, hd, s_err_at, &v, &where);
            eng_latch(latch, code, t, c, where, id, layer_id, serial);
            flags[(eng_u64)t * cols + c] = ENG_TOKEN_BAD;
        } else {
            flags[(eng_u64)t * cols + c] = ENG_TOKEN_LIVE;
        }
    }
}

extern "C" __global__ void engram_gather(const eng_u8 *__restrict__ table, eng_u64 table_rows, eng_u32 fmt,
                                         eng_u32 hd, eng_u32 row_bytes, const eng_i64 *__restrict__ ids,
                                         eng_u32 id_stride, eng_u32 id_offset, eng_u32 cols, void *rows_out,
                                         eng_u32 out_f32, eng_u32 *flags, eng_u32 *latch, eng_u32 layer_id,
                                         eng_u32 serial) {
    __shared__ eng_u32 s[4];
    eng_gather_block(table, nullptr, table_rows, fmt, hd, row_bytes, ids, id_stride, id_offset, cols, rows_out,
                     out_f32, flags, latch, layer_id, serial, s);
}

// engram_gather for a table in the split fp8 format (ENG_FP8_E4M3_E8M0_SPLIT):
// codes in `table` (`hd` bytes a row), e8m0 scales in `scales` (`hd / 32`
// bytes a row); the same parameters otherwise (`fmt` and `row_bytes` unused).
extern "C" __global__ void engram_gather_split(const eng_u8 *__restrict__ table, eng_u64 table_rows, eng_u32 fmt,
                                               eng_u32 hd, eng_u32 row_bytes, const eng_i64 *__restrict__ ids,
                                               eng_u32 id_stride, eng_u32 id_offset, eng_u32 cols, void *rows_out,
                                               eng_u32 out_f32, eng_u32 *flags, eng_u32 *latch, eng_u32 layer_id,
                                               eng_u32 serial, const eng_u8 *__restrict__ scales) {
    __shared__ eng_u32 s[4];
    eng_gather_block(table, scales, table_rows, fmt, hd, row_bytes, ids, id_stride, id_offset, cols, rows_out,
                     out_f32, flags, latch, layer_id, serial, s);
}
