// The hooks between the SIMT shim (simt.h, compiled into kernel code) and its
// runtime (simt_runtime.cpp): the per-thread builtin variables and the calls
// that synchronise emulated threads. Not part of the public C ABI.
#pragma once

#include "simt_abi.h"

struct uint3 {
    unsigned x, y, z;
};

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};

// threadIdx, blockIdx, blockDim, gridDim of one emulated thread.
struct simt_builtins {
    uint3 tid;
    uint3 bid;
    dim3 bdim;
    dim3 gdim;
};

// Warp operations (simt_warp_op's kind).
enum simt_warp_kind : int {
    SIMT_W_SHFL_IDX = 0,
    SIMT_W_SHFL_UP = 1,
    SIMT_W_SHFL_DOWN = 2,
    SIMT_W_SHFL_XOR = 3,
    SIMT_W_BALLOT = 4,
    SIMT_W_ANY = 5,
    SIMT_W_ALL = 6,
    SIMT_W_SYNCWARP = 7,
};

// __syncthreads variants (simt_block_sync's kind).
enum simt_bar_kind : int {
    SIMT_B_SYNC = 0,
    SIMT_B_COUNT = 1,
    SIMT_B_AND = 2,
    SIMT_B_OR = 3,
};

extern "C" {
// The current emulated thread's builtins (null outside a kernel). Written only
// by the runtime, at each switch between fibers of one OS thread.
SIMT_API extern __thread const simt_builtins *simt_tl_builtins;

// __syncthreads (kind SIMT_B_SYNC) and __syncthreads_count/_and/_or: returns
// the count of threads whose `pred` was non-zero, or the and/or of them.
SIMT_API int simt_block_sync(int kind, int pred);

// Warp-level operations of 32-lane warps: see simt_warp_kind. `arg` is the
// source lane, delta or lane mask; `width` the shuffle width.
SIMT_API unsigned long long simt_warp_op(int kind, unsigned mask, unsigned long long value, int arg, int width);

// The lanes of the caller's warp that exist and have not exited.
SIMT_API unsigned simt_active_mask(void);

// Let the other threads of the block run (a failed atomicCAS, __nanosleep).
SIMT_API void simt_yield(void);

// The word a fence updates under ThreadSanitizer (simt.h's simt_fence).
SIMT_API extern unsigned simt_fence_word;

// __trap(): end the launch with SIMT_ERR_TRAP.
SIMT_API __attribute__((noreturn)) void simt_trap(const char *what);
}

// The kernels of a translation unit (kernels_host.cpp): name, entry point, the
// kernel function's address, its parameter count and sizes. Null-terminated.
struct simt_registry_entry {
    const char *name;
    simt_kernel_fn fn;
    const void *addr;
    unsigned nparams;
    const unsigned *sizes;
};
extern "C" const simt_registry_entry simt_registry[];
// The names of the kernels' `extern __shared__` arrays (dynamic shared
// memory), each defined by kernels_host.cpp as SIMT_MAX_SHARED_OPTIN bytes of
// thread-local storage (build.sh lists them). Null-terminated.
extern "C" const char *const simt_dynamic_shared_names[];
// Non-zero when the kernels were compiled to use FMA instructions (FMAD=1).
extern "C" const int simt_kernels_use_fma;
extern "C" const char simt_kernels_build_info[];
