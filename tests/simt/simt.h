// simt.h: a SIMT shim that lets CUDA kernel sources (the engram kernels in
// kernels/, unmodified) compile as host C++17 with g++ and run on the CPU.
// Include it first, then the .cu files, in one translation unit linked with
// simt_runtime.cpp. See tests/simt/README.md for the model and its limits.
//
// What it provides, as NVRTC does for device code:
//   - the execution-space keywords (__global__, __device__, __host__,
//     __forceinline__, __noinline__, __launch_bounds__, __constant__) and
//     __shared__ (a per-OS-thread static: each OS thread runs one block at a
//     time, and its fibers are that block's threads), `extern __shared__`
//     included (dynamic shared memory, defined by kernels_host.cpp);
//   - threadIdx, blockIdx, blockDim, gridDim, warpSize;
//   - __syncthreads(_count/_and/_or), __syncwarp, warp shuffles, votes;
//   - atomics on any memory (real atomics, relaxed order, as CUDA's are);
//   - fences, __ldg and the cache-hint loads and stores (alignment checked),
//     __trap, integer and float intrinsics, min/max;
//   - the f32 intrinsics with the GPU's NaN rule: every NaN that an NVIDIA GPU's
//     f32 arithmetic produces is the canonical 0x7FFFFFFF. Exactly these
//     canonicalise here: __fadd_rn __fsub_rn __fmul_rn __fmaf_rn __fdiv_rn
//     __frcp_rn __fsqrt_rn __frsqrt_rn __fdividef __expf __exp10f __logf
//     __log2f __powf sqrtf rsqrtf expf exp2f exp10f logf log2f log10f powf
//     fmaf fmaxf fminf (fmaxf/fminf return the other operand when only one is
//     NaN, as the GPU does) and atomicAdd(float*). fabsf only clears the
//     sign (PTX leaves abs of a NaN unspecified). The plain operators + - * /
//     on float in kernel code cannot be intercepted: they follow x86 rules (a
//     NaN operand's payload propagates, made quiet; an invalid operation such as
//     inf - inf gives the x86 default NaN 0xFFC00000). The engram kernels round
//     through ENG_MUL/ENG_SUB, which are __fmul_rn/__fsub_rn under __CUDACC__.
//
// __CUDACC__, __CUDACC_RTC__ and __CUDA_ARCH__ (default 900; pass
// -D__CUDA_ARCH__=... to change it) are defined as NVRTC defines them, so the
// kernels take their device branches.
#pragma once

// Every standard header first: the CUDA macros below must not reach them. (A
// file that includes simt.h must include its own standard headers before it.)
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>
#include <utility>

#include "simt_rt.h"

#ifndef __CUDACC__
#define __CUDACC__ 1
#endif
#ifndef __CUDACC_RTC__
#define __CUDACC_RTC__ 1
#endif
#ifndef __CUDA_ARCH__
#define __CUDA_ARCH__ 900
#endif
#define SIMT_HOST_EMULATION 1

#define SIMT_INL static inline __attribute__((always_inline))

// ---- execution spaces --------------------------------------------------------
// A kernel is a noinline function in the ELF section "simt_kernels" with default
// visibility, so that the build can list every kernel of the sources (and
// simt_check_registry can check the registry against them).
#define __global__ __attribute__((section("simt_kernels"), used, noinline, visibility("default")))
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
// One variable per OS thread: an OS thread runs one block at a time, and all
// of a block's threads run as fibers on it (a thread_local at block scope is
// static). `extern __shared__ T name[];` (dynamic shared memory) declares a
// thread-local array that kernels_host.cpp defines, SIMT_MAX_SHARED_OPTIN
// bytes long (build.sh finds the names); kernels compiled elsewhere (the
// self-test's) use simt_dynamic_shared() instead.
#define __shared__ thread_local

// ---- builtin variables -------------------------------------------------------
namespace simt {
SIMT_INL const simt_builtins *bi() { return __atomic_load_n(&simt_tl_builtins, __ATOMIC_RELAXED); }
} // namespace simt
#define threadIdx (simt::bi()->tid)
#define blockIdx (simt::bi()->bid)
#define blockDim (simt::bi()->bdim)
#define gridDim (simt::bi()->gdim)
static constexpr int warpSize = 32;

// ---- vector types --------------------------------------------------------------
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) int4 {
    int x, y, z, w;
};
struct alignas(8) int2 {
    int x, y;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) ulonglong2 {
    unsigned long long x, y;
};
SIMT_INL uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
SIMT_INL uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
SIMT_INL uint3 make_uint3(unsigned x, unsigned y, unsigned z) { return uint3{x, y, z}; }
SIMT_INL int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
SIMT_INL int2 make_int2(int x, int y) { return int2{x, y}; }
SIMT_INL float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
SIMT_INL float2 make_float2(float x, float y) { return float2{x, y}; }

// ---- synchronisation ---------------------------------------------------------
SIMT_INL void __syncthreads() { (void)simt_block_sync(SIMT_B_SYNC, 0); }
SIMT_INL int __syncthreads_count(int pred) { return simt_block_sync(SIMT_B_COUNT, pred); }
SIMT_INL int __syncthreads_and(int pred) { return simt_block_sync(SIMT_B_AND, pred); }
SIMT_INL int __syncthreads_or(int pred) { return simt_block_sync(SIMT_B_OR, pred); }
SIMT_INL void __syncwarp(unsigned mask = 0xFFFFFFFFu) { (void)simt_warp_op(SIMT_W_SYNCWARP, mask, 0, 0, 32); }
SIMT_INL unsigned __activemask() { return simt_active_mask(); }
// ThreadSanitizer does not model fences: under it a fence is a sequentially
// consistent read-modify-write of one word, which TSan does understand (and
// the atomics below are acquire-release; see the atomics section).
#if defined(__SANITIZE_THREAD__)
SIMT_INL void simt_fence() { (void)__atomic_fetch_add(&simt_fence_word, 0u, __ATOMIC_SEQ_CST); }
#else
SIMT_INL void simt_fence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
#endif
SIMT_INL void __threadfence() { simt_fence(); }
SIMT_INL void __threadfence_block() { simt_fence(); }
SIMT_INL void __threadfence_system() { simt_fence(); }
SIMT_INL void __nanosleep(unsigned) { simt_yield(); }
[[noreturn]] SIMT_INL void __trap() { simt_trap("__trap()"); }
[[noreturn]] SIMT_INL void __brkpt() { simt_trap("__brkpt()"); }

namespace simt {
template <class T> SIMT_INL unsigned long long to_u64(T v) {
    static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "warp shuffles move at most 8 bytes");
    unsigned long long u = 0;
    std::memcpy(&u, &v, sizeof(T));
    return u;
}
template <class T> SIMT_INL T from_u64(unsigned long long u) {
    T v;
    std::memcpy(&v, &u, sizeof(T));
    return v;
}
template <class T> SIMT_INL T shfl(int kind, unsigned mask, T v, int arg, int width) {
    return from_u64<T>(simt_warp_op(kind, mask, to_u64(v), arg, width));
}
} // namespace simt

template <class T> SIMT_INL T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
    return simt::shfl(SIMT_W_SHFL_IDX, mask, v, src_lane, width);
}
template <class T> SIMT_INL T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return simt::shfl(SIMT_W_SHFL_UP, mask, v, (int)delta, width);
}
template <class T> SIMT_INL T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return simt::shfl(SIMT_W_SHFL_DOWN, mask, v, (int)delta, width);
}
template <class T> SIMT_INL T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return simt::shfl(SIMT_W_SHFL_XOR, mask, v, lane_mask, width);
}
SIMT_INL unsigned __ballot_sync(unsigned mask, int pred) {
    return (unsigned)simt_warp_op(SIMT_W_BALLOT, mask, pred != 0, 0, 32);
}
SIMT_INL int __any_sync(unsigned mask, int pred) { return (int)simt_warp_op(SIMT_W_ANY, mask, pred != 0, 0, 32); }
SIMT_INL int __all_sync(unsigned mask, int pred) { return (int)simt_warp_op(SIMT_W_ALL, mask, pred != 0, 0, 32); }

// ---- float intrinsics ----------------------------------------------------------
namespace simt {
SIMT_INL float f32(unsigned b) {
    float f;
    std::memcpy(&f, &b, 4);
    return f;
}
SIMT_INL unsigned bits(float f) {
    unsigned b;
    std::memcpy(&b, &f, 4);
    return b;
}
// A value the compiler must materialise: keeps a product from being contracted
// into an FMA with its consumer (the __f*_rn intrinsics are never contracted).
SIMT_INL float opaque(float x) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__("" : "+x"(x));
#elif defined(__aarch64__)
    __asm__("" : "+w"(x));
#else
    __asm__("" : "+m"(x));
#endif
    return x;
}
// The GPU's NaN: any NaN result of f32 arithmetic is 0x7FFFFFFF.
SIMT_INL float canon(float r) { return __builtin_isnan(r) ? f32(0x7FFFFFFFu) : r; }
// Flush a subnormal to a zero of its sign (.ftz operations).
SIMT_INL float ftz(float r) { return (bits(r) & 0x7F800000u) == 0u ? f32(bits(r) & 0x80000000u) : r; }
} // namespace simt

SIMT_INL float __fadd_rn(float a, float b) { return simt::canon(simt::opaque(simt::opaque(a) + simt::opaque(b))); }
SIMT_INL float __fsub_rn(float a, float b) { return simt::canon(simt::opaque(simt::opaque(a) - simt::opaque(b))); }
SIMT_INL float __fmul_rn(float a, float b) { return simt::canon(simt::opaque(simt::opaque(a) * simt::opaque(b))); }
SIMT_INL float __fdiv_rn(float a, float b) { return simt::canon(simt::opaque(a) / simt::opaque(b)); }
SIMT_INL float __frcp_rn(float a) { return simt::canon(1.0f / simt::opaque(a)); }
SIMT_INL float __fmaf_rn(float a, float b, float c) { return simt::canon(__builtin_fmaf(a, b, c)); }
SIMT_INL float __fsqrt_rn(float a) { return simt::canon(__builtin_sqrtf(a)); }
// Correctly rounded here (f64 then one rounding); the GPU's rsqrtf is an
// approximation (MUFU.RSQ, 2 ulp) and may differ in the last bits.
SIMT_INL float __frsqrt_rn(float a) { return simt::canon((float)(1.0 / __builtin_sqrt((double)a))); }
SIMT_INL float simt_rsqrtf(float a) { return __frsqrt_rn(a); }
SIMT_INL float simt_sqrtf(float a) { return __fsqrt_rn(a); }
// expf & co: the host libm's (glibc: < 1 ulp); CUDA's are within 2 ulp
// (expf: an FMA range reduction then ex2.approx), so the last bits can differ.
SIMT_INL float simt_expf(float a) { return simt::canon(__builtin_expf(a)); }
SIMT_INL float simt_exp2f(float a) { return simt::canon(__builtin_exp2f(a)); }
SIMT_INL float simt_exp10f(float a) { return simt::canon((float)__builtin_pow(10.0, (double)a)); }
SIMT_INL float simt_logf(float a) { return simt::canon(__builtin_logf(a)); }
SIMT_INL float simt_log2f(float a) { return simt::canon(__builtin_log2f(a)); }
SIMT_INL float simt_log10f(float a) { return simt::canon(__builtin_log10f(a)); }
SIMT_INL float simt_powf(float a, float b) { return simt::canon(__builtin_powf(a, b)); }
SIMT_INL float simt_fmaf(float a, float b, float c) { return __fmaf_rn(a, b, c); }
// The fast-math intrinsics (ex2.approx.ftz / lg2.approx.ftz on the GPU): the
// same formula with an exact exp2/log2, subnormal results flushed.
SIMT_INL float simt_fast_expf(float a) { return simt::ftz(simt::canon(__builtin_exp2f(__fmul_rn(a, 1.44269502f)))); }
SIMT_INL float simt_fast_exp10f(float a) { return simt::ftz(simt::canon(__builtin_exp2f(__fmul_rn(a, 3.32192802f)))); }
SIMT_INL float simt_fast_log2f(float a) { return simt::canon(__builtin_log2f(simt::ftz(a))); }
SIMT_INL float simt_fast_logf(float a) { return __fmul_rn(simt_fast_log2f(a), 0.693147182f); }
SIMT_INL float simt_fast_powf(float a, float b) {
    return simt::ftz(simt::canon(__builtin_exp2f(__fmul_rn(b, simt_fast_log2f(a)))));
}
SIMT_INL float __fdividef(float a, float b) { return __fdiv_rn(a, b); }
SIMT_INL float __saturatef(float a) {
    return __builtin_isnan(a) ? 0.0f : (a < 0.0f ? 0.0f : (a > 1.0f ? 1.0f : a));
}
// maxNum/minNum with -0 < +0; a NaN only if both are NaN (canonical).
SIMT_INL float simt_fmaxf(float a, float b) {
    if (__builtin_isnan(a)) return simt::canon(b);
    if (__builtin_isnan(b)) return a;
    if (a == b) return (simt::bits(a) & 0x80000000u) ? b : a;
    return a > b ? a : b;
}
SIMT_INL float simt_fminf(float a, float b) {
    if (__builtin_isnan(a)) return simt::canon(b);
    if (__builtin_isnan(b)) return a;
    if (a == b) return (simt::bits(a) & 0x80000000u) ? a : b;
    return a < b ? a : b;
}
SIMT_INL float simt_fabsf(float a) { return simt::f32(simt::bits(a) & 0x7FFFFFFFu); }

#define sqrtf(x) simt_sqrtf(x)
#define rsqrtf(x) simt_rsqrtf(x)
#define expf(x) simt_expf(x)
#define exp2f(x) simt_exp2f(x)
#define exp10f(x) simt_exp10f(x)
#define logf(x) simt_logf(x)
#define log2f(x) simt_log2f(x)
#define log10f(x) simt_log10f(x)
#define powf(x, y) simt_powf(x, y)
#define fmaf(x, y, z) simt_fmaf(x, y, z)
#define fmaxf(x, y) simt_fmaxf(x, y)
#define fminf(x, y) simt_fminf(x, y)
#define fabsf(x) simt_fabsf(x)
// glibc declares these names too (its internal aliases): renamed like the others.
#define __expf(x) simt_fast_expf(x)
#define __exp10f(x) simt_fast_exp10f(x)
#define __logf(x) simt_fast_logf(x)
#define __log2f(x) simt_fast_log2f(x)
#define __powf(x, y) simt_fast_powf(x, y)

SIMT_INL float __uint_as_float(unsigned u) { return simt::f32(u); }
SIMT_INL unsigned __float_as_uint(float f) { return simt::bits(f); }
SIMT_INL float __int_as_float(int i) { return simt::f32((unsigned)i); }
SIMT_INL int __float_as_int(float f) { return (int)simt::bits(f); }
SIMT_INL double __longlong_as_double(long long i) {
    double d;
    std::memcpy(&d, &i, 8);
    return d;
}
SIMT_INL long long __double_as_longlong(double d) {
    long long i;
    std::memcpy(&i, &d, 8);
    return i;
}

// ---- integer intrinsics, min/max -------------------------------------------------
SIMT_INL int __popc(unsigned x) { return __builtin_popcount(x); }
SIMT_INL int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
SIMT_INL int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
SIMT_INL int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
SIMT_INL int __ffs(int x) { return __builtin_ffs(x); }
SIMT_INL int __ffsll(long long x) { return __builtin_ffsll(x); }
SIMT_INL unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
    x = ((x >> 8) & 0x00FF00FFu) | ((x & 0x00FF00FFu) << 8);
    return (x >> 16) | (x << 16);
}
SIMT_INL unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
SIMT_INL int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
SIMT_INL unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}

#define SIMT_MINMAX(T)                                                                                               \
    SIMT_INL T min(T a, T b) { return a < b ? a : b; }                                                               \
    SIMT_INL T max(T a, T b) { return a > b ? a : b; }
SIMT_MINMAX(int)
SIMT_MINMAX(unsigned)
SIMT_MINMAX(long)
SIMT_MINMAX(unsigned long)
SIMT_MINMAX(long long)
SIMT_MINMAX(unsigned long long)
#undef SIMT_MINMAX
SIMT_INL unsigned min(int a, unsigned b) { return min((unsigned)a, b); }
SIMT_INL unsigned min(unsigned a, int b) { return min(a, (unsigned)b); }
SIMT_INL unsigned max(int a, unsigned b) { return max((unsigned)a, b); }
SIMT_INL unsigned max(unsigned a, int b) { return max(a, (unsigned)b); }
SIMT_INL float min(float a, float b) { return simt_fminf(a, b); }
SIMT_INL float max(float a, float b) { return simt_fmaxf(a, b); }
SIMT_INL double min(double a, double b) { return __builtin_fmin(a, b); }
SIMT_INL double max(double a, double b) { return __builtin_fmax(a, b); }

// ---- loads and stores with a cache hint ------------------------------------------
// ld.global.nc (__ldg) and the other cache-operator forms; the hint itself is
// not modelled. The address must be aligned to the type, as on the GPU, where
// a misaligned access (a 16-byte uint4 at an address that is not a multiple
// of 16) is a fault that ends the context: here it traps (SIMT_ERR_TRAP)
// instead of quietly working as x86 would. Any type, as CUDA's overloads
// (char ... double, the 2- and 4-element vectors).
namespace simt {
template <class T> SIMT_INL void check_aligned(const void *p, const char *what) {
    if (((uintptr_t)p & (alignof(T) - 1)) != 0) simt_trap(what);
}
} // namespace simt
#define SIMT_LOAD(NAME)                                                                                              \
    template <class T> SIMT_INL T NAME(const T *p) {                                                                 \
        simt::check_aligned<T>(p, #NAME ": misaligned address");                                                   \
        return *p;                                                                                                   \
    }
#define SIMT_STORE(NAME)                                                                                             \
    template <class T> SIMT_INL void NAME(T *p, T v) {                                                               \
        simt::check_aligned<T>(p, #NAME ": misaligned address");                                                   \
        *p = v;                                                                                                      \
    }
SIMT_LOAD(__ldg)
SIMT_LOAD(__ldcg)
SIMT_LOAD(__ldca)
SIMT_LOAD(__ldcs)
SIMT_LOAD(__ldlu)
SIMT_STORE(__stwb)
SIMT_STORE(__stcg)
SIMT_STORE(__stcs)
SIMT_STORE(__stwt)
#undef SIMT_LOAD
#undef SIMT_STORE

// ---- atomics (relaxed, as CUDA's; on any memory) ----------------------------------
// Under ThreadSanitizer they are acquire-release instead: TSan ignores fences,
// so the CUDA idiom "relaxed atomic + __threadfence" would otherwise be
// reported as a race. (TSan then misses a race that only a missing fence causes.)
#if defined(__SANITIZE_THREAD__)
#define SIMT_RMW __ATOMIC_ACQ_REL
#define SIMT_LD __ATOMIC_ACQUIRE
#else
#define SIMT_RMW __ATOMIC_RELAXED
#define SIMT_LD __ATOMIC_RELAXED
#endif
#define SIMT_ATOMIC_INT(T)                                                                                           \
    SIMT_INL T atomicAdd(T *p, T v) { return __atomic_fetch_add(p, v, SIMT_RMW); }                                   \
    SIMT_INL T atomicExch(T *p, T v) { return __atomic_exchange_n(p, v, SIMT_RMW); }                                 \
    SIMT_INL T atomicAnd(T *p, T v) { return __atomic_fetch_and(p, v, SIMT_RMW); }                                   \
    SIMT_INL T atomicOr(T *p, T v) { return __atomic_fetch_or(p, v, SIMT_RMW); }                                     \
    SIMT_INL T atomicXor(T *p, T v) { return __atomic_fetch_xor(p, v, SIMT_RMW); }                                   \
    SIMT_INL T atomicCAS(T *p, T cmp, T v) {                                                                         \
        if (!__atomic_compare_exchange_n(p, &cmp, v, false, SIMT_RMW, SIMT_LD)) simt_yield();                        \
        return cmp;                                                                                                  \
    }
#define SIMT_ATOMIC_MINMAX(T)                                                                                        \
    SIMT_INL T atomicMin(T *p, T v) {                                                                                \
        T old = __atomic_load_n(p, SIMT_LD);                                                                         \
        while (v < old && !__atomic_compare_exchange_n(p, &old, v, true, SIMT_RMW, SIMT_LD)) {                       \
        }                                                                                                            \
        return old;                                                                                                  \
    }                                                                                                                \
    SIMT_INL T atomicMax(T *p, T v) {                                                                                \
        T old = __atomic_load_n(p, SIMT_LD);                                                                         \
        while (v > old && !__atomic_compare_exchange_n(p, &old, v, true, SIMT_RMW, SIMT_LD)) {                       \
        }                                                                                                            \
        return old;                                                                                                  \
    }
SIMT_ATOMIC_INT(int)
SIMT_ATOMIC_INT(unsigned)
SIMT_ATOMIC_INT(unsigned long long)
SIMT_ATOMIC_MINMAX(int)
SIMT_ATOMIC_MINMAX(unsigned)
SIMT_ATOMIC_MINMAX(long long)
SIMT_ATOMIC_MINMAX(unsigned long long)
#undef SIMT_ATOMIC_INT
#undef SIMT_ATOMIC_MINMAX
SIMT_INL int atomicSub(int *p, int v) { return __atomic_fetch_sub(p, v, SIMT_RMW); }
SIMT_INL unsigned atomicSub(unsigned *p, unsigned v) { return __atomic_fetch_sub(p, v, SIMT_RMW); }
SIMT_INL unsigned short atomicCAS(unsigned short *p, unsigned short cmp, unsigned short v) {
    if (!__atomic_compare_exchange_n(p, &cmp, v, false, SIMT_RMW, SIMT_LD)) simt_yield();
    return cmp;
}
// ((old >= v) ? 0 : old + 1) and ((old == 0 || old > v) ? v : old - 1).
SIMT_INL unsigned atomicInc(unsigned *p, unsigned v) {
    unsigned old = __atomic_load_n(p, SIMT_LD);
    while (!__atomic_compare_exchange_n(p, &old, old >= v ? 0u : old + 1u, true, SIMT_RMW, SIMT_LD)) {
    }
    return old;
}
SIMT_INL unsigned atomicDec(unsigned *p, unsigned v) {
    unsigned old = __atomic_load_n(p, SIMT_LD);
    while (!__atomic_compare_exchange_n(p, &old, (old == 0u || old > v) ? v : old - 1u, true, SIMT_RMW,
                                        SIMT_LD)) {
    }
    return old;
}
// atom.add.f32: round to nearest even, subnormal inputs and results flushed
// to a zero of their sign (PTX ISA), NaN canonical.
SIMT_INL float atomicAdd(float *p, float v) {
    unsigned *q = reinterpret_cast<unsigned *>(p);
    unsigned old = __atomic_load_n(q, SIMT_LD);
    for (;;) {
        const float r = simt::ftz(__fadd_rn(simt::ftz(simt::f32(old)), simt::ftz(v)));
        if (__atomic_compare_exchange_n(q, &old, simt::bits(r), true, SIMT_RMW, SIMT_LD))
            return simt::f32(old);
    }
}
SIMT_INL float atomicExch(float *p, float v) {
    return simt::f32(__atomic_exchange_n(reinterpret_cast<unsigned *>(p), simt::bits(v), SIMT_RMW));
}
SIMT_INL double atomicAdd(double *p, double v) {
    unsigned long long *q = reinterpret_cast<unsigned long long *>(p);
    unsigned long long old = __atomic_load_n(q, SIMT_LD);
    for (;;) {
        double o, r;
        std::memcpy(&o, &old, 8);
        r = o + v;
        unsigned long long rb;
        std::memcpy(&rb, &r, 8);
        if (__atomic_compare_exchange_n(q, &old, rb, true, SIMT_RMW, SIMT_LD)) return o;
    }
}

// ld.global.cv (__ldcv): "fetch again", the load a thread polls memory that
// other blocks write with: an atomic load here where the type allows (1, 2,
// 4 or 8 bytes), so that a poll is not a data race to the C++ memory model
// (or to ThreadSanitizer); wider types are plain loads, as the other hints.
template <class T> SIMT_INL T __ldcv(const T *p) {
    simt::check_aligned<T>(p, "__ldcv: misaligned address");
    if constexpr (sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8) {
        using U = std::conditional_t<sizeof(T) == 1, unsigned char,
                                     std::conditional_t<sizeof(T) == 2, unsigned short,
                                                        std::conditional_t<sizeof(T) == 4, unsigned,
                                                                           unsigned long long>>>;
        const U u = __atomic_load_n(reinterpret_cast<const U *>(p), SIMT_LD);
        T v;
        std::memcpy(static_cast<void *>(&v), &u, sizeof v);
        return v;
    } else {
        return *p;
    }
}

// ---- kernel entry points ------------------------------------------------------
// simt::Thunk<decltype(&k), &k>::call unpacks cuLaunchKernel-style arguments
// (args[i] points to argument i's value) and calls kernel k.
namespace simt {
template <class F, F f> struct Thunk;
template <class... A, void (*f)(A...)> struct Thunk<void (*)(A...), f> {
    template <class T> static T arg(void *p) {
        T v;
        std::memcpy(static_cast<void *>(&v), p, sizeof(T));
        return v;
    }
    template <std::size_t... I> static void go(void **a, std::index_sequence<I...>) {
        (void)a;
        f(arg<std::remove_cv_t<A>>(a[I])...);
    }
    static void call(void **a) { go(a, std::index_sequence_for<A...>{}); }
    static constexpr unsigned nparams = sizeof...(A);
    static constexpr unsigned sizes[sizeof...(A) + 1] = {(unsigned)sizeof(A)..., 0u};
};
} // namespace simt
#define SIMT_ENTRY(k) (&simt::Thunk<decltype(&k), &k>::call)
