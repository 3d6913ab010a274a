// The device functions of gather.cu (its kernels are described there): the
// gather of one (token, column) cell, eng_gather_cell, and what it needs;
// decode.cu uses them too.
#pragma once
#include "engram_common.cuh"
#include "latch.cuh"

static_assert(ENG_GATHER_THREADS % 32 == 0 && ENG_GATHER_THREADS >= 32 && ENG_GATHER_THREADS <= 1024,
              "a gather block is whole warps (ENG_GATHER_THREADS, src/cuda/kernels.rs)");
// Values a lane reads at a time on the vector path (16 bytes of bf16 or f16,
// 8 of fp8 codes): all under one fp8 scale.
#define ENG_GATHER_VEC 8u
static_assert(ENG_FP8_SCALE_BLOCK % ENG_GATHER_VEC == 0, "eight fp8 values a lane at a time share a scale");

#define ENG_FULL_MASK 0xFFFFFFFFu
#define ENG_NONE 0xFFFFFFFFu

__device__ __forceinline__ void eng_store_row(void *out, eng_u32 out_f32, eng_u64 at, eng_u16 v) {
    if (out_f32) {
        ((float *)out)[at] = eng_bf16_to_f32(v);
    } else {
        ((eng_u16 *)out)[at] = v;
    }
}

// Values at .. at + 7 of the output (at a multiple of 8; the output 16-byte
// aligned), with 16-byte stores.
__device__ __forceinline__ void eng_store_row8(void *out, eng_u32 out_f32, eng_u64 at, const eng_u16 *v) {
    if (out_f32) {
        float4 *o = (float4 *)((float *)out + at);
        __stcg(o, make_float4(eng_bf16_to_f32(v[0]), eng_bf16_to_f32(v[1]), eng_bf16_to_f32(v[2]),
                              eng_bf16_to_f32(v[3])));
        __stcg(o + 1, make_float4(eng_bf16_to_f32(v[4]), eng_bf16_to_f32(v[5]), eng_bf16_to_f32(v[6]),
                                  eng_bf16_to_f32(v[7])));
    } else {
        __stcg((uint4 *)((eng_u16 *)out + at),
               make_uint4(v[0] | ((eng_u32)v[1] << 16), v[2] | ((eng_u32)v[3] << 16), v[4] | ((eng_u32)v[5] << 16),
                          v[6] | ((eng_u32)v[7] << 16)));
    }
}

__device__ __forceinline__ eng_u32 eng_warp_min(eng_u32 v) {
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(ENG_FULL_MASK, v, o));
    return v;
}

// The bf16 bits of the 8 values whose 16 bytes (bf16 or f16) or 8 bytes (fp8
// codes, `sc` their scale) are in `w`, exactly eng_dequant_bf16's. Returns a
// bit mask of the values that fail (a NaN code or scale, or not finite).
__device__ __forceinline__ eng_u32 eng_dequant8_bits(eng_u32 fmt, const eng_u32 *w, eng_u8 sc, eng_u32 e0,
                                                     eng_u16 *v) {
    eng_u32 bad = 0u;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        eng_u32 code = 0u, where = 0u;
        if (fmt == ENG_BF16) {
            v[j] = (eng_u16)(w[j / 2] >> (16 * (j % 2)));
        } else if (fmt == ENG_F16) {
            v[j] = eng_f32_to_bf16(eng_f16_to_f32((eng_u16)(w[j / 2] >> (16 * (j % 2)))));
        } else if (fmt == ENG_F32) {
            v[j] = eng_f32_to_bf16(eng_f32_from_bits(w[j]));
        } else {
            code = eng_fp8_code_bf16((eng_u8)(w[j / 4] >> (8 * (j % 4))), sc, e0 + (eng_u32)j, &v[j], &where);
        }
        if (code != 0u || eng_bf16_not_finite(v[j])) {
            v[j] = 0u;
            bad |= 1u << j;
        }
    }
    return bad;
}

// Where a cell's dequantised row goes: the rows workspace (bf16, or the bf16
// values widened to f32 for an f32 wkv), value i of cell `pos` at pos * hd + i.
// `vec`: whole 8-value groups may be stored with 16-byte stores (Hd a multiple
// of 8 and the output 16-byte aligned, so every row of it is).
struct eng_row_global {
    void *out;
    eng_u32 out_f32;
    eng_u64 base;
    bool vec;
    __device__ __forceinline__ void store8(eng_u32 e, const eng_u16 *v) const { eng_store_row8(out, out_f32, base + e, v); }
    __device__ __forceinline__ void store1(eng_u32 i, eng_u16 v) const { eng_store_row(out, out_f32, base + i, v); }
};

// The token's ids of cell `pos` (t * cols + c) checked, its row read and
// dequantised, as `lane` of the warp that does the cell; the values go to
// `out` (eng_row_global, or the decode kernel's shared memory). Token t's id
// for column k is ids[t * id_stride + id_offset + k]. The warp checks its
// token's ids (all C of them: a few loads) so that it decides the token's
// status alone. With `report`, it also writes flags[pos] and records any
// error in the latch (the decode kernel's blocks all gather every cell; one
// reports it). `scales` is NULL but for a split fp8 table in device memory.
template <class Out>
__device__ __forceinline__ void eng_gather_cell(eng_u64 pos, eng_u32 lane, const eng_u8 *__restrict__ table,
                                                const eng_u8 *__restrict__ scales, eng_u64 table_rows, eng_u32 fmt,
                                                eng_u32 hd, eng_u32 row_bytes, const eng_i64 *__restrict__ ids,
                                                eng_u32 id_stride, eng_u32 id_offset, eng_u32 cols,
                                                const eng_u8 *__restrict__ staged_rows,
                                                const eng_i64 *__restrict__ staged_ids,
                                                const eng_u32 *__restrict__ staged_slots, const Out &out, bool report,
                                                eng_u32 *flags, eng_u32 *latch, eng_u32 layer_id, eng_u32 serial) {
    const bool vec_fmt = fmt == ENG_BF16 || fmt == ENG_F16 || fmt == ENG_F32 || fmt == ENG_FP8_E4M3_E8M0 ||
                         fmt == ENG_FP8_E4M3_E8M0_SPLIT;
    const eng_u32 t = (eng_u32)(pos / cols), c = (eng_u32)(pos % cols);
    const eng_i64 *tid = ids + (eng_u64)t * id_stride + id_offset;
    // The token's ids, 32 columns at a time (every lane the same count).
    eng_u32 dead = 0u, first_dead = ENG_NONE, first_range = ENG_NONE;
    for (eng_u32 k0 = 0u; k0 < cols; k0 += 32u) {
        const eng_u32 k = k0 + lane;
        const eng_i64 kid = k < cols ? tid[k] : 0;
        const eng_u32 dm = __ballot_sync(ENG_FULL_MASK, k < cols && kid == -1);
        const eng_u32 rm = __ballot_sync(ENG_FULL_MASK, k < cols && kid != -1 && (kid < 0 || (eng_u64)kid >= table_rows));
        dead += (eng_u32)__popc(dm);
        if (dm != 0u && first_dead == ENG_NONE) first_dead = k0 + (eng_u32)__ffs((int)dm) - 1u;
        if (rm != 0u && first_range == ENG_NONE) first_range = k0 + (eng_u32)__ffs((int)rm) - 1u;
    }
    eng_u32 status = ENG_TOKEN_LIVE;
    if (dead == cols) {
        status = ENG_TOKEN_DEAD;
    } else if (dead > 0u || first_range != ENG_NONE) {
        status = ENG_TOKEN_BAD;
    }
    const eng_i64 id = tid[c];
    if (status == ENG_TOKEN_LIVE && staged_rows != 0 && staged_ids[pos] != id) {
        status = ENG_TOKEN_BAD;
        if (lane == 0u && report) eng_latch(latch, ENG_ERR_NOT_STAGED, 0u, t, c, 0u, id, layer_id, serial);
    }
    if (status != ENG_TOKEN_LIVE) {
        if (out.vec) {
            const eng_u16 z[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};
            for (eng_u32 e = ENG_GATHER_VEC * lane; e < hd; e += ENG_GATHER_VEC * 32u) out.store8(e, z);
        } else {
            for (eng_u32 i = lane; i < hd; i += 32u) out.store1(i, 0u);
        }
        if (lane == 0u && report) {
            flags[pos] = status;
            if (status == ENG_TOKEN_BAD && c == 0u) {
                // The CPU backend's order within a token: the first dead
                // column of a partly dead token, else the first id out of range.
                if (dead > 0u) {
                    eng_latch(latch, ENG_ERR_PARTLY_DEAD, 0u, t, first_dead, 0u, -1, layer_id, serial);
                } else if (first_range != ENG_NONE) {
                    eng_latch(latch, ENG_ERR_ROW_RANGE, 0u, t, first_range, 0u, tid[first_range], layer_id, serial);
                }
            }
        }
        return;
    }
    const eng_u8 *row, *srow = 0;
    if (staged_rows != 0) {
        // A layer with a device row cache: the staged row's index (a row of
        // this call's staging area, or a cache slot after it); else the
        // position itself.
        row = staged_rows + (staged_slots != 0 ? (eng_u64)staged_slots[pos] : pos) * row_bytes;
    } else if (scales != 0) {
        row = table + (eng_u64)id * hd;
        srow = scales + (eng_u64)id * (hd / ENG_FP8_SCALE_BLOCK);
    } else {
        row = table + (eng_u64)id * row_bytes;
    }
    // The first failing value of the row seen by this lane.
    eng_u32 err_at = ENG_NONE;
    const bool fp8 = fmt == ENG_FP8_E4M3_E8M0 || fmt == ENG_FP8_E4M3_E8M0_SPLIT;
    const eng_u64 align = fp8 ? 8u : 16u;
    if (out.vec && vec_fmt && ((eng_u64)row & (align - 1u)) == 0u) {
        // The packed fp8 row's scales follow its codes; the split
        // format's are in their own array.
        const eng_u8 *sc_row = srow != 0 ? srow : row + hd;
        for (eng_u32 e = ENG_GATHER_VEC * lane; e < hd; e += ENG_GATHER_VEC * 32u) {
            eng_u32 w[8];
            eng_u8 sc = 0u;
            if (fp8) {
                const uint2 q = __ldg((const uint2 *)(row + e));
                w[0] = q.x;
                w[1] = q.y;
                sc = sc_row[e / ENG_FP8_SCALE_BLOCK];
            } else if (fmt == ENG_F32) {
                const uint4 a = __ldg((const uint4 *)(row + 4u * e));
                const uint4 b = __ldg((const uint4 *)(row + 4u * e) + 1);
                w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
                w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
            } else {
                const uint4 a = __ldg((const uint4 *)(row + 2u * e));
                w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
            }
            eng_u16 v[8];
            const eng_u32 bad = eng_dequant8_bits(fmt, w, sc, e, v);
            if (bad != 0u && err_at == ENG_NONE) err_at = e + (eng_u32)__ffs((int)bad) - 1u;
            out.store8(e, v);
        }
    } else {
        for (eng_u32 i = lane; i < hd; i += 32u) {
            eng_u16 v = 0u;
            eng_u32 where = 0u;
            const eng_u32 code = srow != 0 ? eng_dequant_fp8_split_bf16(row, srow, i, &v, &where)
                                           : eng_dequant_bf16(fmt, row, hd, i, &v, &where);
            if (code != 0u) {
                v = 0u;
                if (err_at == ENG_NONE) err_at = i;
            }
            out.store1(i, v);
        }
    }
    // Report the row's first failing element (a NaN scale fails every
    // element of its block), as the CPU backend does.
    if (__any_sync(ENG_FULL_MASK, err_at != ENG_NONE)) {
        err_at = eng_warp_min(err_at);
        if (lane == 0u && report) {
            eng_u16 v;
            eng_u32 where = 0u;
            const eng_u32 code = srow != 0 ? eng_dequant_fp8_split_bf16(row, srow, err_at, &v, &where)
                                           : eng_dequant_bf16(fmt, row, hd, err_at, &v, &where);
            eng_latch(latch, code, 1u, t, c, where, id, layer_id, serial);
            flags[pos] = ENG_TOKEN_BAD;
        }
    } else if (lane == 0u && report) {
        flags[pos] = ENG_TOKEN_LIVE;
    }
}

// Cells warp, warp + stride, ... of the grid (a warp each, in a grid-stride
// loop), their rows to the rows workspace.
__device__ __forceinline__ void eng_gather_cells(const eng_u8 *__restrict__ table, const eng_u8 *__restrict__ scales,
                                                 eng_u64 table_rows, eng_u32 fmt, eng_u32 hd, eng_u32 row_bytes,
                                                 const eng_i64 *__restrict__ ids, eng_u32 id_stride,
                                                 eng_u32 id_offset, eng_u32 cols, eng_u64 n_cells,
                                                 const eng_u8 *__restrict__ staged_rows,
                                                 const eng_i64 *__restrict__ staged_ids,
                                                 const eng_u32 *__restrict__ staged_slots, void *rows_out,
                                                 eng_u32 out_f32, eng_u32 *flags, eng_u32 *latch, eng_u32 layer_id,
                                                 eng_u32 serial) {
    const eng_u32 lane = threadIdx.x % 32u;
    const eng_u64 stride = (eng_u64)gridDim.x * (blockDim.x / 32u);
    const eng_u64 warp = (eng_u64)blockIdx.x * (blockDim.x / 32u) + threadIdx.x / 32u;
    // Eight values a lane at a time where the output allows it (Hd a multiple
    // of 8, so every row of the output starts 16-byte aligned).
    const bool vec_out = hd % ENG_GATHER_VEC == 0u && ((eng_u64)rows_out & 15u) == 0u;
    for (eng_u64 pos = warp; pos < n_cells; pos += stride) {
        const eng_row_global out = {rows_out, out_f32, pos * hd, vec_out};
        eng_gather_cell(pos, lane, table, scales, table_rows, fmt, hd, row_bytes, ids, id_stride, id_offset, cols,
                        staged_rows, staged_ids, staged_slots, out, true, flags, latch, layer_id, serial);
    }
}
