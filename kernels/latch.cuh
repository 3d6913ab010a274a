// The error latch's device side (see src/cuda/latch.rs): recording an error
// (eng_latch: the gather and hash kernels) and moving it to the host-mapped
// mirror (eng_move_latch: the gate and hash-commit kernels). Shared, so that
// each kernel file compiles on its own.
#pragma once
#include "engram_common.cuh"

// Record an error unless an earlier one (by that order) is recorded. The
// order key is stored inverted, so that the cleared latch (all zero) holds
// the latest possible key and atomicMax keeps the earliest. The details are
// written under a lock by a block whose key is still the latch's, so the
// last writer is the block with the earliest key.
__device__ __forceinline__ void eng_latch(eng_u32 *latch, eng_u32 code, eng_u32 data_error, eng_u32 token,
                                          eng_u32 col, eng_u32 where, eng_i64 row, eng_u32 layer,
                                          eng_u32 serial) {
    const eng_u64 key = ~(((eng_u64)data_error << 63) | ((eng_u64)token << 32) | (eng_u64)col);
    eng_u64 *k = (eng_u64 *)(latch + ENG_LATCH_KEY);
    if (atomicMax(k, key) > key) return;
    while (atomicCAS(latch + ENG_LATCH_LOCK, 0u, 1u) != 0u) {
    }
    __threadfence();
    if (*(volatile eng_u64 *)k == key) {
        volatile eng_u32 *l = latch;
        l[1] = token;
        l[2] = col;
        l[3] = where;
        l[4] = (eng_u32)((eng_u64)row & 0xFFFFFFFFu);
        l[5] = (eng_u32)((eng_u64)row >> 32);
        l[6] = layer;
        l[7] = serial;
        l[0] = code;
    }
    __threadfence();
    atomicExch(latch + ENG_LATCH_LOCK, 0u);
}

// Move a recorded error to the mirror (when the mirror is free) and clear the
// latch.
__device__ __forceinline__ void eng_move_latch(eng_u32 *latch, volatile eng_u32 *mirror) {
    if (latch[0] != 0u) {
        if (mirror[0] == 0u) {
            for (int i = 1; i < (int)ENG_LATCH_KEY; i++) mirror[i] = latch[i];
            __threadfence_system();
            mirror[0] = latch[0];
        }
        latch[0] = 0u;
        latch[ENG_LATCH_KEY] = 0u;
        latch[ENG_LATCH_KEY + 1] = 0u;
    }
}
