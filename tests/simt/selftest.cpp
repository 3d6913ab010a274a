// Self-test of the SIMT shim (simt.h + simt_runtime.cpp) and smoke tests of
// the engram kernels it runs (libengram_simt.so). Exit status 0 when every
// check passes. See README.md.
//
//   selftest [--expect NAME]... [--bench[=real|small]] [--race-demo[=fixed]]
//
// --expect NAME: a kernel name the CUDA backend looks up (run_selftest.sh
// passes those of src/cuda/kernels.rs); each must be registered.
// --bench[=real|small]: time the kernels (at the real model's sizes, at a
// test-sized step, or both) instead of testing.
// --race-demo: run a kernel with an intra-block data race (for a TSan build:
// TSan must report it); --race-demo=fixed runs the same kernel with the
// missing __syncthreads added (TSan must stay quiet).
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "simt.h"

// The kernels' grid barrier (standalone: needs none of the engram defines).
#include "grid_sync.cuh"

// ---- harness -------------------------------------------------------------------------
static int g_failures = 0;
static int g_checks = 0;

#define CHECK(cond, ...)                                                                                         \
    do {                                                                                                         \
        g_checks++;                                                                                              \
        if (!(cond)) {                                                                                           \
            g_failures++;                                                                                        \
            if (g_failures < 60) {                                                                               \
                fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                                  \
                fprintf(stderr, __VA_ARGS__);                                                                    \
                fputc('\n', stderr);                                                                             \
            }                                                                                                    \
        }                                                                                                        \
    } while (0)

#define CHECK_RC(rc, want)                                                                                       \
    CHECK((rc) == (want), "got %s, want %s: %s", simt_error_name(rc), simt_error_name(want), simt_last_error())

static double now_s() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Section {
    const char *name;
    double t0;
    int f0;
    explicit Section(const char *n) : name(n), t0(now_s()), f0(g_failures) {}
    ~Section() {
        printf("%-4s %-58s %7.3f s\n", g_failures == f0 ? "ok" : "FAIL", name, now_s() - t0);
        fflush(stdout);
    }
};

template <class... A> static int launch1(simt_kernel_fn fn, unsigned grid, unsigned block, uint64_t seed, A &...a) {
    void *args[] = {static_cast<void *>(&a)..., nullptr};
    return simt_launch_fn(fn, grid, 1, 1, block, 1, 1, 0, args, seed);
}

template <class... A> static int launch_named(const char *name, unsigned grid, unsigned block, uint64_t seed, A &...a) {
    void *args[] = {static_cast<void *>(&a)..., nullptr};
    return simt_launch(name, grid, 1, 1, block, 1, 1, 0, args, seed);
}

static uint64_t ptr(const void *p) { return (uint64_t)(uintptr_t)p; }

// ---- independent f32 / bf16 helpers (not engram_common.cuh's) -----------------------------
static float f32_of(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}
static uint32_t bits_of(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}
// Round to nearest even: add 0x7FFF plus the lowest kept bit, truncate.
static uint16_t ref_bf16(float f) {
    const uint32_t u = bits_of(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static float bf16f(uint16_t b) { return f32_of((uint32_t)b << 16); }
static double ulp_bf16(double x) {
    x = std::fabs(x);
    if (x < 1e-38) return std::ldexp(1.0, -133);
    int e;
    std::frexp(x, &e); // x = m * 2^e, m in [0.5, 1)
    return std::ldexp(1.0, e - 8);
}

// ---- the shim's own kernels ------------------------------------------------------------
static const unsigned FULL = 0xFFFFFFFFu;

__device__ __forceinline__ unsigned lin_tid() {
    return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
__device__ __forceinline__ unsigned long long lin_bid() {
    return blockIdx.x + (unsigned long long)gridDim.x * (blockIdx.y + (unsigned long long)gridDim.y * blockIdx.z);
}

// A tree reduction in shared memory that is right only with real barriers.
__global__ void k_tree(const int *in, long long *out) {
    __shared__ long long s[1024];
    const unsigned n = blockDim.x * blockDim.y * blockDim.z, t = lin_tid();
    const unsigned long long b = lin_bid();
    s[t] = in[b * n + t];
    __syncthreads();
    for (unsigned stride = 1; stride < n; stride *= 2) {
        if (t % (2 * stride) == 0 && t + stride < n) s[t] += s[t + stride];
        __syncthreads();
    }
    if (t == 0) out[b] = s[0];
}

// The same without barriers: wrong under this emulation (and on a GPU).
// (Unsigned: the garbage it may read must not overflow a signed sum.)
__global__ void k_tree_nobarrier(const int *in, long long *out) {
    __shared__ unsigned long long s[1024];
    const unsigned n = blockDim.x, t = threadIdx.x;
    s[t] = (unsigned long long)(long long)in[blockIdx.x * n + t];
    for (unsigned stride = 1; stride < n; stride *= 2) {
        if (t % (2 * stride) == 0 && t + stride < n) s[t] += s[t + stride];
    }
    if (t == 0) out[blockIdx.x] = (long long)s[0];
}

__global__ void k_sync_variants(int *out) {
    const unsigned t = lin_tid(), n = blockDim.x * blockDim.y * blockDim.z;
    int *o = out + (lin_bid() * n + t) * 5;
    o[0] = __syncthreads_count(t % 3 == 0);
    o[1] = __syncthreads_and(t < 100000);
    o[2] = __syncthreads_and(t != 5);
    o[3] = __syncthreads_or(t == n - 1);
    o[4] = __syncthreads_or(0);
}

// Half the threads exit; the others' barrier waits only for them.
__global__ void k_exit_then_sync(int *out) {
    __shared__ int s[1024];
    const unsigned t = threadIdx.x, n = blockDim.x;
    if (t % 2) return;
    s[t] = (int)t * 10;
    __syncthreads();
    out[t] = s[(t + 2) % n];
}

__device__ __forceinline__ unsigned glob_tid() { return blockIdx.x * blockDim.x + threadIdx.x; }

__global__ void k_divergent_barrier(int *out) {
    const unsigned t = threadIdx.x;
    if (t < 32) {
        __syncthreads();
        out[glob_tid()] = 1;
    } else {
        __syncthreads();
        out[glob_tid()] = 2;
    }
}

// Lanes 0-15 wait at a barrier for lanes 16-31, which wait in a shuffle for 0-15.
__global__ void k_deadlock(int *out) {
    const unsigned t = threadIdx.x;
    if (t < 16) {
        __syncthreads();
        out[glob_tid()] = 1;
    } else {
        out[glob_tid()] = __shfl_xor_sync(FULL, (int)t, 1);
    }
}

__global__ void k_trap(int *out) {
    if (threadIdx.x == 5 && blockIdx.x == 1) __trap();
    out[glob_tid()] = 1;
}

// 16- and 8-byte loads and stores with cache hints: each thread copies one
// uint4, one uint2 and one float4.
__global__ void k_vector_access(const uint4 *a, const uint2 *b, const float4 *c, uint4 *oa, uint2 *ob, float4 *oc) {
    const unsigned i = glob_tid();
    __stcg(oa + i, __ldg(a + i));
    __stcs(ob + i, __ldcg(b + i));
    __stwb(oc + i, __ldcs(c + i));
}

// A 16-byte load 8 bytes past a multiple of 16, an 8-byte store 4 bytes past
// one: faults on the GPU, traps here.
__global__ void k_misaligned_load(const unsigned char *p, uint4 *out) {
    out[glob_tid()] = __ldg((const uint4 *)(p + 8));
}
__global__ void k_misaligned_store(unsigned char *p) { __stcg((uint2 *)(p + 4), make_uint2(1u, 2u)); }

// Rounds of a grid-wide exchange: each block writes its slot, all meet at the
// kernels' grid barrier, each block sums every slot, all meet again before
// the next round overwrites them. Right only if the barrier holds every block
// until all have arrived.
__global__ void k_grid_rounds(int *slots, long long *sums, unsigned *bar, int rounds) {
    const unsigned b = blockIdx.x, nb = gridDim.x;
    for (int r = 0; r < rounds; r++) {
        if (threadIdx.x == 0) ((volatile int *)slots)[b] = r * 1000 + (int)b;
        eng_grid_sync(bar);
        if (threadIdx.x == 0) {
            long long s = 0;
            for (unsigned i = 0; i < nb; i++) s += ((volatile int *)slots)[i];
            sums[(size_t)b * rounds + r] = s;
        }
        eng_grid_sync(bar);
    }
}

// Block 1 leaves without meeting the others: they wait for it forever.
__global__ void k_grid_missing(unsigned *bar) {
    if (blockIdx.x == 1) return;
    eng_grid_sync(bar);
}

// Block 2 traps while the others wait at the barrier.
__global__ void k_grid_trap(unsigned *bar) {
    if (blockIdx.x == 2 && threadIdx.x == 7) __trap();
    eng_grid_sync(bar);
}

// Fills `words` 16-byte words of dynamic shared memory, then sums them back.
__global__ void k_big_shared(unsigned long long *out, unsigned words) {
    uint4 *s = (uint4 *)simt_dynamic_shared();
    for (unsigned i = threadIdx.x; i < words; i += blockDim.x) s[i] = make_uint4(i, 2 * i, 3 * i, blockIdx.x);
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long t = 0;
        for (unsigned i = 0; i < words; i++) t += (unsigned long long)s[i].x + s[i].y + s[i].z + s[i].w;
        out[blockIdx.x] = t;
    }
}

static const int NSHFL = 30;

__global__ void k_shuffles(const int *vals, int *oi, double *od, unsigned long long *ou, unsigned *ov, float *of) {
    const unsigned t = threadIdx.x, lane = t & 31u;
    const unsigned gt = blockIdx.x * blockDim.x + t;
    const int v = vals[gt];
    int *o = oi + (size_t)gt * NSHFL;
    int k = 0;
    for (int m = 1; m < 32; m <<= 1) o[k++] = __shfl_xor_sync(FULL, v, m);    // 5
    for (int m = 1; m < 32; m <<= 1) o[k++] = __shfl_xor_sync(FULL, v, m, 8); // 5
    for (unsigned d = 0; d < 33; d += 4) o[k++] = __shfl_down_sync(FULL, v, d); // 9
    for (unsigned d = 1; d < 20; d += 3) o[k++] = __shfl_up_sync(FULL, v, d, 16); // 7
    o[k++] = __shfl_sync(FULL, v, (int)((lane * 7u + 3u) % 32u));
    o[k++] = __shfl_sync(FULL, v, (int)lane + 5, 8);
    o[k++] = __shfl_sync(FULL, v, -1);
    o[k++] = __shfl_down_sync(FULL, v, 1, 4);
    od[gt] = __shfl_down_sync(FULL, v * 0.5 + 0.25, 3);
    ou[gt] = __shfl_xor_sync(FULL, ((unsigned long long)(unsigned)v << 32) | gt, 5);
    ov[gt * 4 + 0] = __ballot_sync(FULL, v % 3 == 0);
    ov[gt * 4 + 1] = (unsigned)__any_sync(FULL, v == 17);
    ov[gt * 4 + 2] = (unsigned)__all_sync(FULL, v > 0);
    ov[gt * 4 + 3] = __activemask();
    float f = (float)v * 0.125f;
    for (int m = 16; m > 0; m >>= 1) f += __shfl_xor_sync(FULL, f, m);
    of[gt] = f;
}

// Lanes 16-31 exit; lanes 0-15 then read them.
__global__ void k_shfl_exited(int *out) {
    const unsigned lane = threadIdx.x & 31u;
    if (lane >= 16) return;
    out[glob_tid()] = __shfl_xor_sync(FULL, (int)lane, 16);
}
// A partial mask (lanes 16-31 live, at the barrier): not modelled.
__global__ void k_shfl_partial(int *out) {
    const unsigned lane = threadIdx.x & 31u;
    if (lane < 16) out[glob_tid()] = __shfl_sync(0x0000FFFFu, (int)lane, 0);
    __syncthreads();
}
// 48 threads: warp 1 has 16 lanes; width 16 shuffles stay inside them.
__global__ void k_shfl_short_warp(int *out) {
    int v = (int)threadIdx.x;
    for (int m = 8; m > 0; m >>= 1) v += __shfl_xor_sync(FULL, v, m, 16);
    out[threadIdx.x] = v;
}

struct AtomicOut {
    unsigned cnt;
    unsigned pad0;
    unsigned long long cnt64;
    int mn, mx;
    unsigned umx;
    int lock;
    long long plain;
    float fsum;
    unsigned pad1;
};

__global__ void k_atomics(AtomicOut *g, unsigned *sh_out, int iters) {
    __shared__ unsigned s_cnt, s_inc, s_dec, s_and, s_or, s_xor;
    const unsigned t = threadIdx.x, gt = blockIdx.x * blockDim.x + t;
    if (t == 0) {
        s_cnt = 0;
        s_inc = 0;
        s_dec = 1000;
        s_and = FULL;
        s_or = 0;
        s_xor = 0;
    }
    __syncthreads();
    for (int i = 0; i < iters; i++) {
        atomicAdd(&g->cnt, 1u);
        atomicAdd(&g->cnt64, 3ull);
        atomicAdd(&g->fsum, 1.0f);
        atomicAdd(&s_cnt, 1u);
        atomicInc(&s_inc, 9u);
        atomicDec(&s_dec, 1000u);
    }
    atomicMin(&g->mn, (int)(gt * 7919u % 10007u) - 5000);
    atomicMax(&g->mx, (int)(gt * 7919u % 10007u) - 5000);
    atomicMax(&g->umx, gt);
    atomicAnd(&s_and, ~(1u << (t % 32u)));
    atomicOr(&s_or, 1u << (t % 32u));
    atomicXor(&s_xor, t);
    // A spin lock (atomicCAS + __threadfence) around a plain read-modify-write.
    while (atomicCAS(&g->lock, 0, 1) != 0) {
    }
    __threadfence();
    g->plain += 1;
    __threadfence();
    atomicExch(&g->lock, 0);
    __syncthreads();
    if (t == 0) {
        unsigned *o = sh_out + blockIdx.x * 6;
        o[0] = s_cnt;
        o[1] = s_inc;
        o[2] = s_dec;
        o[3] = s_and;
        o[4] = s_or;
        o[5] = s_xor;
    }
}

__global__ void k_order(unsigned *counter, unsigned long long *log) {
    if (lin_tid() == 0) log[atomicAdd(counter, 1u)] = lin_bid();
}

__global__ void k_thread_order(unsigned *log) {
    __shared__ unsigned s_n;
    if (threadIdx.x == 0) s_n = 0;
    __syncthreads();
    log[blockIdx.x * blockDim.x + atomicAdd(&s_n, 1u)] = threadIdx.x;
}

// Reads shared memory before writing it (a bug): sees the runtime's garbage.
__global__ void k_uninit(unsigned *out) {
    __shared__ unsigned s_v[4];
    if (threadIdx.x == 0)
        for (int i = 0; i < 4; i++) out[blockIdx.x * 4 + i] = s_v[i];
    __syncthreads();
    if (threadIdx.x < 4) s_v[threadIdx.x] = threadIdx.x;
}

__global__ void k_dynamic_shared(unsigned *out, unsigned n) {
    unsigned *s = static_cast<unsigned *>(simt_dynamic_shared());
    for (unsigned i = threadIdx.x; i < n; i += blockDim.x) s[i] = i * 3u + blockIdx.x;
    __syncthreads();
    unsigned acc = 0;
    for (unsigned i = 0; i < n; i++) acc += s[i];
    out[blockIdx.x * blockDim.x + threadIdx.x] = acc + (((uintptr_t)s % 16u) ? 1000000u : 0u);
}

// Intra-block race: thread 0 reads what the others wrote, with no barrier
// in between unless `fixed`.
__global__ void k_race(int *out, int fixed) {
    __shared__ int s[256];
    s[threadIdx.x] = (int)threadIdx.x;
    if (fixed) __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        for (unsigned i = 0; i < blockDim.x; i++) acc += s[i];
        out[blockIdx.x] = acc;
    }
}

// ---- shim tests ---------------------------------------------------------------------------
static void test_barriers() {
    Section sec("barriers: shared-memory tree reduction, sync variants");
    std::mt19937_64 rng(1);
    struct Shape {
        unsigned gx, gy, gz, bx, by, bz;
    };
    const Shape shapes[] = {{7, 1, 1, 256, 1, 1}, {3, 2, 1, 1024, 1, 1}, {5, 1, 1, 96, 1, 1},
                            {2, 2, 2, 16, 8, 2},  {4, 1, 1, 1, 1, 1},    {3, 1, 1, 33, 1, 1}};
    for (const Shape &s : shapes) {
        const unsigned n = s.bx * s.by * s.bz, nb = s.gx * s.gy * s.gz;
        std::vector<int> in((size_t)n * nb);
        for (int &v : in) v = (int)(rng() % 2000001) - 1000000;
        std::vector<long long> out(nb, 0x5A5A), want(nb, 0);
        for (unsigned b = 0; b < nb; b++)
            for (unsigned t = 0; t < n; t++) want[b] += in[(size_t)b * n + t];
        const int *pin = in.data();
        long long *pout = out.data();
        void *args[] = {&pin, &pout};
        for (uint64_t seed : {1ull, 77ull}) {
            std::fill(out.begin(), out.end(), 0x5A5A);
            const int rc = simt_launch_fn(SIMT_ENTRY(k_tree), s.gx, s.gy, s.gz, s.bx, s.by, s.bz, 0, args, seed);
            CHECK_RC(rc, SIMT_OK);
            CHECK(out == want, "tree reduction wrong for block (%u,%u,%u)", s.bx, s.by, s.bz);
        }
    }
#if !defined(__SANITIZE_THREAD__) // a data race on purpose: see --race-demo
    {
        // Without barriers the same reduction goes wrong (at least for some seeds).
        const unsigned n = 256, nb = 4;
        std::vector<int> in(n * nb, 1);
        std::vector<long long> out(nb);
        const int *pin = in.data();
        long long *pout = out.data();
        int wrong = 0;
        for (uint64_t seed = 1; seed <= 4; seed++) {
            CHECK_RC(launch1(SIMT_ENTRY(k_tree_nobarrier), nb, n, seed, pin, pout), SIMT_OK);
            for (long long v : out) wrong += v != (long long)n;
        }
        CHECK(wrong > 0, "a reduction without __syncthreads gave the right sum every time");
    }
#endif
    for (unsigned n : {256u, 64u, 7u}) {
        std::vector<int> out((size_t)n * 3 * 5, -7);
        int *p = out.data();
        CHECK_RC(launch1(SIMT_ENTRY(k_sync_variants), 3, n, 5, p), SIMT_OK);
        const int cnt = (int)((n + 2) / 3);
        for (unsigned i = 0; i < n * 3; i++) {
            const int *o = &out[(size_t)i * 5];
            CHECK(o[0] == cnt && o[1] == 1 && o[2] == (n > 5 ? 0 : 1) && o[3] == 1 && o[4] == 0,
                  "sync variants n=%u thread %u: %d %d %d %d %d", n, i, o[0], o[1], o[2], o[3], o[4]);
        }
    }
    {
        const unsigned n = 128;
        std::vector<int> out(n, -1);
        int *p = out.data();
        CHECK_RC(launch1(SIMT_ENTRY(k_exit_then_sync), 1, n, 3, p), SIMT_OK);
        for (unsigned t = 0; t < n; t++)
            CHECK(out[t] == (t % 2 ? -1 : (int)((t + 2) % n) * 10), "exit then sync: out[%u] = %d", t, out[t]);
    }
}

static void test_errors() {
    Section sec("errors: divergent barrier, deadlock, trap, bad launches");
    std::vector<int> out(4 * 1024);
    int *p = out.data();
    CHECK_RC(launch1(SIMT_ENTRY(k_divergent_barrier), 2, 64, 1, p), SIMT_ERR_BARRIER);
    CHECK(strstr(simt_last_error(), "divergent") != nullptr, "message: %s", simt_last_error());
    CHECK_RC(launch1(SIMT_ENTRY(k_deadlock), 3, 32, 1, p), SIMT_ERR_DEADLOCK);
    CHECK(strstr(simt_last_error(), "deadlock") != nullptr, "message: %s", simt_last_error());
    CHECK_RC(launch1(SIMT_ENTRY(k_trap), 3, 64, 1, p), SIMT_ERR_TRAP);
    CHECK_RC(launch1(SIMT_ENTRY(k_shfl_exited), 2, 64, 1, p), SIMT_ERR_WARP);
    CHECK_RC(launch1(SIMT_ENTRY(k_shfl_partial), 2, 64, 1, p), SIMT_ERR_WARP);
    // After failed launches the fibers are reset and work again.
    {
        std::vector<int> in(256 * 3, 2);
        std::vector<long long> o(3);
        const int *pin = in.data();
        long long *po = o.data();
        CHECK_RC(launch1(SIMT_ENTRY(k_tree), 3, 256, 9, pin, po), SIMT_OK);
        CHECK(o[0] == 512 && o[1] == 512 && o[2] == 512, "reduction after errors: %lld %lld %lld", o[0], o[1], o[2]);
    }
    void *args[] = {&p};
    CHECK_RC(simt_launch_fn(SIMT_ENTRY(k_trap), 1, 1, 1, 1025, 1, 1, 0, args, 1), SIMT_ERR_INVALID_VALUE);
    CHECK_RC(simt_launch_fn(SIMT_ENTRY(k_trap), 0, 1, 1, 32, 1, 1, 0, args, 1), SIMT_ERR_INVALID_VALUE);
    CHECK_RC(simt_launch_fn(SIMT_ENTRY(k_trap), 1, 65536, 1, 32, 1, 1, 0, args, 1), SIMT_ERR_INVALID_VALUE);
    CHECK_RC(simt_launch_fn(SIMT_ENTRY(k_trap), 1, 1, 1, 32, 1, 65, 0, args, 1), SIMT_ERR_INVALID_VALUE);
    CHECK_RC(simt_launch_fn(SIMT_ENTRY(k_trap), 1, 1, 1, 32, 1, 1, 48 * 1024 + 1, args, 1), SIMT_ERR_INVALID_VALUE);
    CHECK_RC(simt_launch("no_such_kernel", 1, 1, 1, 32, 1, 1, 0, args, 1), SIMT_ERR_UNKNOWN_KERNEL);
    CHECK_RC(simt_launch(nullptr, 1, 1, 1, 32, 1, 1, 0, args, 1), SIMT_ERR_UNKNOWN_KERNEL);
    CHECK_RC(simt_launch("engram_gather", 1, 1, 1, 32, 1, 1, 0, nullptr, 1), SIMT_ERR_INVALID_VALUE);
    CHECK_RC(simt_launch_fn(nullptr, 1, 1, 1, 32, 1, 1, 0, args, 1), SIMT_ERR_UNKNOWN_KERNEL);
}

static void test_cooperative() {
    Section sec("cooperative launches: the grid barrier, too large, a block missing, a trap");
    const unsigned sms = simt_sm_count();
    CHECK(simt_max_active_blocks(256, 0) == 8 && simt_max_active_blocks(1024, 0) == 2 &&
              simt_max_active_blocks(32, 0) == 32 && simt_max_active_blocks(256, 100 * 1024) == 2 &&
              simt_max_active_blocks(256, 227 * 1024) == 1 && simt_max_active_blocks(256, 227 * 1024 + 1) == 0 &&
              simt_max_active_blocks(2048, 0) == 0,
          "occupancy: %u %u %u %u %u", simt_max_active_blocks(256, 0), simt_max_active_blocks(1024, 0),
          simt_max_active_blocks(32, 0), simt_max_active_blocks(256, 100 * 1024),
          simt_max_active_blocks(256, 227 * 1024));
    // Every grid the device holds at once, a few seeds, the barrier word
    // used by launch after launch (it must come back to bit 31 only).
    unsigned bar = 0;
    const unsigned max_blocks = sms * simt_max_active_blocks(64, 0);
    // ThreadSanitizer cannot map the traces of 128 OS threads and their
    // fibers: a smaller grid there.
    const bool tsan = strstr(simt_build_info(), "sanitize=thread") != nullptr;
    for (unsigned nb : {1u, 2u, 5u, tsan ? 12u : max_blocks}) {
        for (uint64_t seed = 1; seed <= 3; seed++) {
            const int rounds = 4;
            std::vector<int> slots(nb, -1);
            std::vector<long long> sums((size_t)nb * rounds, -1);
            int *ps = slots.data();
            long long *pm = sums.data();
            unsigned *pb = &bar;
            int r = rounds;
            void *args[] = {&ps, &pm, &pb, &r};
            CHECK_RC(simt_launch_fn_cooperative(SIMT_ENTRY(k_grid_rounds), nb, 1, 1, 64, 1, 1, 0, args, seed),
                     SIMT_OK);
            long bad = 0;
            for (unsigned b = 0; b < nb; b++)
                for (int k = 0; k < rounds; k++)
                    bad += sums[(size_t)b * rounds + k] != (long long)k * 1000 * nb + (long long)nb * (nb - 1) / 2;
            CHECK(bad == 0, "%u blocks, seed %llu: %ld sums saw another round's slots", nb,
                  (unsigned long long)seed, bad);
            CHECK((bar & 0x7FFFFFFFu) == 0u, "the barrier word's low bits after a launch: %#x", bar);
        }
    }
    // More blocks than the emulated device holds at once: refused whole,
    // nothing run (CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE).
    {
        std::vector<long long> sums(4, -7);
        long long *pm = sums.data();
        int *ps = nullptr;
        unsigned *pb = &bar;
        int r = 1;
        void *args[] = {&ps, &pm, &pb, &r};
        CHECK_RC(simt_launch_fn_cooperative(SIMT_ENTRY(k_grid_rounds), max_blocks + 1, 1, 1, 64, 1, 1, 0, args, 1),
                 SIMT_ERR_COOP_TOO_LARGE);
        CHECK(strstr(simt_last_error(), "cooperative launch") != nullptr, "message: %s", simt_last_error());
        CHECK(sums[0] == -7, "a refused cooperative launch ran");
        CHECK_RC(simt_launch_fn_cooperative(SIMT_ENTRY(k_grid_rounds), sms * 2 + 1, 1, 1, 1024, 1, 1, 0, args, 1),
                 SIMT_ERR_COOP_TOO_LARGE);
    }
    // More blocks than the emulated device holds: an SM count that fits them.
    simt_set_sm_count(sms + 3);
    CHECK(simt_sm_count() == sms + 3, "simt_set_sm_count");
    simt_set_sm_count(0);
    CHECK(simt_sm_count() == sms, "simt_set_sm_count(0) restores the default");
    // A block that never reaches the barrier: the others end with a
    // deadlock once they have waited the spin limit, not a hang.
    simt_set_spin_limit_ms(300);
    {
        unsigned b2 = 0, *pb = &b2;
        void *args[] = {&pb};
        const double t0 = now_s();
        CHECK_RC(simt_launch_fn_cooperative(SIMT_ENTRY(k_grid_missing), 4, 1, 1, 64, 1, 1, 0, args, 1),
                 SIMT_ERR_DEADLOCK);
        CHECK(strstr(simt_last_error(), "grid barrier") != nullptr, "message: %s", simt_last_error());
        CHECK(now_s() - t0 < 30.0, "the deadlock took %.1f s to show", now_s() - t0);
        // A block that traps while the others wait: its trap is the error,
        // and the waiting blocks give up at once.
        b2 = 0;
        const double t1 = now_s();
        CHECK_RC(simt_launch_fn_cooperative(SIMT_ENTRY(k_grid_trap), 4, 1, 1, 64, 1, 1, 0, args, 1), SIMT_ERR_TRAP);
        CHECK(now_s() - t1 < 0.25, "the waiting blocks took %.2f s to give up", now_s() - t1);
    }
    simt_set_spin_limit_ms(0);
    // After the failures, cooperative and plain launches work again.
    {
        std::vector<int> slots(3, -1);
        std::vector<long long> sums(3, -1);
        int *ps = slots.data();
        long long *pm = sums.data();
        unsigned b3 = 0, *pb = &b3;
        int r = 1;
        void *args[] = {&ps, &pm, &pb, &r};
        CHECK_RC(simt_launch_fn_cooperative(SIMT_ENTRY(k_grid_rounds), 3, 1, 1, 64, 1, 1, 0, args, 5), SIMT_OK);
        CHECK(sums[0] == 3 && sums[1] == 3 && sums[2] == 3, "after the failures: %lld %lld %lld", sums[0], sums[1],
              sums[2]);
    }
}

static void test_shared_optin() {
    Section sec("dynamic shared memory past 48 KiB: the kernel's opt-in");
    const unsigned bytes = 200 * 1024, words = bytes / 16;
    std::vector<unsigned long long> out(3, 0);
    unsigned long long *po = out.data();
    unsigned w = words;
    void *args[] = {&po, &w};
    CHECK_RC(simt_launch_fn(SIMT_ENTRY(k_big_shared), 3, 1, 1, 256, 1, 1, bytes, args, 1), SIMT_ERR_INVALID_VALUE);
    CHECK(strstr(simt_last_error(), "opt-in") != nullptr, "message: %s", simt_last_error());
    CHECK_RC(simt_set_max_dynamic_shared_fn(SIMT_ENTRY(k_big_shared), SIMT_MAX_SHARED_OPTIN + 1),
             SIMT_ERR_INVALID_VALUE);
    CHECK_RC(simt_set_max_dynamic_shared_fn(SIMT_ENTRY(k_big_shared), bytes), SIMT_OK);
    CHECK_RC(simt_launch_fn(SIMT_ENTRY(k_big_shared), 3, 1, 1, 256, 1, 1, bytes, args, 1), SIMT_OK);
    const unsigned long long per = 6ull * ((unsigned long long)words * (words - 1) / 2);
    for (unsigned b = 0; b < 3; b++)
        CHECK(out[b] == per + (unsigned long long)b * words, "block %u: %llu, want %llu", b, out[b],
              per + (unsigned long long)b * words);
    CHECK_RC(simt_launch_fn(SIMT_ENTRY(k_big_shared), 1, 1, 1, 256, 1, 1, bytes + 16, args, 1),
             SIMT_ERR_INVALID_VALUE);
    CHECK_RC(simt_set_max_dynamic_shared("no_such_kernel", 1024), SIMT_ERR_UNKNOWN_KERNEL);
    CHECK_RC(simt_set_max_dynamic_shared("engram_gather", SIMT_DEFAULT_DYNAMIC_SHARED), SIMT_OK);
}

static void test_vector_access() {
    Section sec("16- and 8-byte loads and stores with cache hints; misaligned ones trap");
    const unsigned n = 64;
    std::vector<uint4> a(n), oa(n);
    std::vector<uint2> b(n), ob(n);
    std::vector<float4> c(n), oc(n);
    for (unsigned i = 0; i < n; i++) {
        a[i] = make_uint4(i, ~i, i * 7u, 0xA5A5A5A5u ^ i);
        b[i] = make_uint2(i * 3u, ~i * 5u);
        c[i] = make_float4((float)i, -(float)i, 0.5f * (float)i, 1.0f / (float)(i + 1));
    }
    const uint4 *pa = a.data();
    const uint2 *pb = b.data();
    const float4 *pc = c.data();
    uint4 *poa = oa.data();
    uint2 *pob = ob.data();
    float4 *poc = oc.data();
    CHECK_RC(launch1(SIMT_ENTRY(k_vector_access), 2, 32, 1, pa, pb, pc, poa, pob, poc), SIMT_OK);
    CHECK(memcmp(a.data(), oa.data(), n * sizeof(uint4)) == 0, "uint4 __ldg / __stcg");
    CHECK(memcmp(b.data(), ob.data(), n * sizeof(uint2)) == 0, "uint2 __ldcg / __stcs");
    CHECK(memcmp(c.data(), oc.data(), n * sizeof(float4)) == 0, "float4 __ldcs / __stwb");
    alignas(16) unsigned char buf[64] = {0};
    unsigned char *pbuf = buf;
    const unsigned char *cbuf = buf;
    CHECK_RC(launch1(SIMT_ENTRY(k_misaligned_load), 1, 32, 1, cbuf, poa), SIMT_ERR_TRAP);
    CHECK(strstr(simt_last_error(), "__ldg: misaligned") != nullptr, "message: %s", simt_last_error());
    CHECK_RC(launch1(SIMT_ENTRY(k_misaligned_store), 1, 32, 1, pbuf), SIMT_ERR_TRAP);
    CHECK(strstr(simt_last_error(), "__stcg: misaligned") != nullptr, "message: %s", simt_last_error());
}

static int ref_shfl_src(int kind, unsigned lane, int arg, unsigned w) {
    // kind: 0 idx, 1 up, 2 down, 3 xor (CUDA Programming Guide, warp shuffle functions)
    const unsigned grp = lane / w * w;
    switch (kind) {
    case 0: return (int)(grp + (unsigned)(((arg % (int)w) + (int)w) % (int)w));
    case 1: return lane % w < (unsigned)arg ? (int)lane : (int)(lane - (unsigned)arg);
    case 2: return lane % w + (unsigned)arg >= w ? (int)lane : (int)(lane + (unsigned)arg);
    default: {
        const unsigned s = lane ^ (unsigned)arg;
        return s / w > lane / w ? (int)lane : (int)s;
    }
    }
}

static void test_shuffles() {
    Section sec("warp shuffles, votes, misuse");
    const unsigned nb = 3, n = 64, total = nb * n;
    std::vector<int> vals(total);
    std::mt19937 rng(2);
    for (int &v : vals) v = (int)(rng() % 1000) - 100;
    vals[37] = 17;
    std::vector<int> oi((size_t)total * NSHFL, -999);
    std::vector<double> od(total);
    std::vector<unsigned long long> ou(total);
    std::vector<unsigned> ov((size_t)total * 4);
    std::vector<float> of(total);
    const int *pv = vals.data();
    int *poi = oi.data();
    double *pod = od.data();
    unsigned long long *pou = ou.data();
    unsigned *pov = ov.data();
    float *pof = of.data();
    CHECK_RC(launch1(SIMT_ENTRY(k_shuffles), nb, n, 11, pv, poi, pod, pou, pov, pof), SIMT_OK);
    for (unsigned gt = 0; gt < total; gt++) {
        const unsigned lane = gt % 32, wbase = gt - lane;
        auto at = [&](int src) { return vals[wbase + (unsigned)src]; };
        std::vector<int> want;
        for (int m = 1; m < 32; m <<= 1) want.push_back(at(ref_shfl_src(3, lane, m, 32)));
        for (int m = 1; m < 32; m <<= 1) want.push_back(at(ref_shfl_src(3, lane, m, 8)));
        for (int d = 0; d < 33; d += 4) want.push_back(at(ref_shfl_src(2, lane, d, 32)));
        for (int d = 1; d < 20; d += 3) want.push_back(at(ref_shfl_src(1, lane, d, 16)));
        want.push_back(at(ref_shfl_src(0, lane, (int)((lane * 7 + 3) % 32), 32)));
        want.push_back(at(ref_shfl_src(0, lane, (int)lane + 5, 8)));
        want.push_back(at(ref_shfl_src(0, lane, -1, 32)));
        want.push_back(at(ref_shfl_src(2, lane, 1, 4)));
        for (int k = 0; k < NSHFL; k++)
            CHECK(oi[(size_t)gt * NSHFL + k] == want[(size_t)k], "thread %u shuffle %d: %d, want %d", gt, k,
                  oi[(size_t)gt * NSHFL + k], want[(size_t)k]);
        const int sd = ref_shfl_src(2, lane, 3, 32);
        CHECK(od[gt] == at(sd) * 0.5 + 0.25, "double shuffle of thread %u", gt);
        const unsigned sx = wbase + (unsigned)ref_shfl_src(3, lane, 5, 32);
        CHECK(ou[gt] == (((unsigned long long)(unsigned)vals[sx] << 32) | sx), "u64 shuffle of thread %u", gt);
        unsigned ballot = 0;
        bool any = false, all = true;
        float wsum[32];
        for (unsigned l = 0; l < 32; l++) {
            ballot |= (vals[wbase + l] % 3 == 0) << l;
            any = any || vals[wbase + l] == 17;
            all = all && vals[wbase + l] > 0;
            wsum[l] = (float)vals[wbase + l] * 0.125f;
        }
        for (unsigned m = 16; m > 0; m >>= 1) {
            float nx[32];
            for (unsigned l = 0; l < 32; l++) nx[l] = wsum[l] + wsum[l ^ m];
            memcpy(wsum, nx, sizeof wsum);
        }
        CHECK(ov[gt * 4] == ballot && ov[gt * 4 + 1] == any && ov[gt * 4 + 2] == all && ov[gt * 4 + 3] == FULL,
              "votes of thread %u: %#x %u %u %#x", gt, ov[gt * 4], ov[gt * 4 + 1], ov[gt * 4 + 2], ov[gt * 4 + 3]);
        CHECK(bits_of(of[gt]) == bits_of(wsum[lane]), "butterfly sum of thread %u: %a, want %a", gt, of[gt],
              wsum[lane]);
    }
    {
        std::vector<int> o(48);
        int *p = o.data();
        CHECK_RC(launch1(SIMT_ENTRY(k_shfl_short_warp), 1, 48, 1, p), SIMT_OK);
        for (unsigned t = 0; t < 48; t++) {
            const unsigned g = t / 16 * 16;
            const int want = (int)(16 * g + 120); // the sum of the 16 lanes of t's group
            CHECK(o[t] == want, "short warp: thread %u: %d, want %d", t, o[t], want);
        }
    }
}

static void test_atomics() {
    Section sec("atomics under contention (4 workers)");
    const unsigned prev = simt_get_workers();
    simt_set_workers(4);
    const unsigned nb = 24, n = 256;
    const int iters = 20;
    AtomicOut g;
    memset(&g, 0, sizeof g);
    g.mn = 1 << 30;
    g.mx = -(1 << 30);
    std::vector<unsigned> sh(nb * 6);
    AtomicOut *pg = &g;
    unsigned *psh = sh.data();
    int it = iters;
    CHECK_RC(launch1(SIMT_ENTRY(k_atomics), nb, n, 3, pg, psh, it), SIMT_OK);
    const unsigned long long threads = (unsigned long long)nb * n;
    int mn = 1 << 30, mx = -(1 << 30);
    for (unsigned gt = 0; gt < threads; gt++) {
        const int v = (int)(gt * 7919u % 10007u) - 5000;
        mn = std::min(mn, v);
        mx = std::max(mx, v);
    }
    CHECK(g.cnt == threads * iters, "atomicAdd u32: %u", g.cnt);
    CHECK(g.cnt64 == threads * iters * 3, "atomicAdd u64: %llu", g.cnt64);
    CHECK(g.fsum == (float)(threads * iters), "atomicAdd f32: %f", (double)g.fsum);
    CHECK(g.mn == mn && g.mx == mx && g.umx == threads - 1, "atomicMin/Max: %d %d %u", g.mn, g.mx, g.umx);
    CHECK(g.plain == (long long)threads && g.lock == 0, "spin lock: %lld increments", g.plain);
    const unsigned per = n * (unsigned)iters;
    unsigned x = 0;
    for (unsigned t = 0; t < n; t++) x ^= t;
    for (unsigned b = 0; b < nb; b++) {
        const unsigned *o = &sh[b * 6];
        CHECK(o[0] == per && o[1] == per % 10 && o[2] == 1000 - per % 1001 && o[3] == 0 && o[4] == FULL && o[5] == x,
              "shared atomics of block %u: %u %u %u %#x %#x %u", b, o[0], o[1], o[2], o[3], o[4], o[5]);
    }
    simt_set_workers(prev);
}

static void test_nan_rules() {
    Section sec("f32 intrinsics: GPU NaN rule, IEEE rounding");
    const uint32_t CANON = 0x7FFFFFFFu;
    const float qnan = f32_of(0x7FC12345u), snan = f32_of(0x7F812345u), nneg = f32_of(0xFFC00001u);
    const float inf = f32_of(0x7F800000u);
    const float nans[] = {qnan, snan, nneg};
    for (float a : nans) {
        CHECK(bits_of(__fadd_rn(a, 1.0f)) == CANON && bits_of(__fadd_rn(1.0f, a)) == CANON, "__fadd_rn");
        CHECK(bits_of(__fsub_rn(a, 1.0f)) == CANON && bits_of(__fsub_rn(1.0f, a)) == CANON, "__fsub_rn");
        CHECK(bits_of(__fmul_rn(a, 2.0f)) == CANON && bits_of(__fmul_rn(2.0f, a)) == CANON, "__fmul_rn");
        CHECK(bits_of(__fdiv_rn(a, 2.0f)) == CANON && bits_of(__fdiv_rn(2.0f, a)) == CANON, "__fdiv_rn");
        CHECK(bits_of(__fmaf_rn(a, 1.0f, 1.0f)) == CANON && bits_of(__fmaf_rn(1.0f, 1.0f, a)) == CANON, "__fmaf_rn");
        CHECK(bits_of(__frcp_rn(a)) == CANON && bits_of(__fsqrt_rn(a)) == CANON && bits_of(__frsqrt_rn(a)) == CANON,
              "__frcp_rn / __fsqrt_rn / __frsqrt_rn");
        CHECK(bits_of(sqrtf(a)) == CANON && bits_of(rsqrtf(a)) == CANON && bits_of(expf(a)) == CANON &&
                  bits_of(exp2f(a)) == CANON && bits_of(logf(a)) == CANON && bits_of(log2f(a)) == CANON &&
                  bits_of(powf(a, 2.0f)) == CANON && bits_of(fmaf(a, 1.0f, 0.0f)) == CANON,
              "math functions");
        CHECK(bits_of(__expf(a)) == CANON && bits_of(__logf(a)) == CANON && bits_of(__fdividef(a, 3.0f)) == CANON,
              "fast intrinsics");
        CHECK(fmaxf(a, 2.0f) == 2.0f && fmaxf(2.0f, a) == 2.0f && fminf(a, -2.0f) == -2.0f &&
                  bits_of(fmaxf(a, a)) == CANON && bits_of(fminf(a, qnan)) == CANON,
              "fmaxf/fminf");
        CHECK(bits_of(fabsf(a)) == (bits_of(a) & 0x7FFFFFFFu), "fabsf clears the sign only");
        CHECK(__saturatef(a) == 0.0f, "__saturatef(NaN)");
        float acc = 1.0f;
        atomicAdd(&acc, a);
        CHECK(bits_of(acc) == CANON, "atomicAdd(float) NaN");
    }
    // Invalid operations (x86 would give 0xFFC00000).
    CHECK(bits_of(__fsub_rn(inf, inf)) == CANON && bits_of(__fadd_rn(inf, -inf)) == CANON, "inf - inf");
    CHECK(bits_of(__fmul_rn(0.0f, inf)) == CANON && bits_of(__fdiv_rn(0.0f, 0.0f)) == CANON, "0 * inf, 0 / 0");
    CHECK(bits_of(__fsqrt_rn(-1.0f)) == CANON && bits_of(sqrtf(-2.0f)) == CANON && bits_of(logf(-1.0f)) == CANON,
          "sqrt(-1), log(-1)");
    CHECK(bits_of(__fmaf_rn(0.0f, inf, 1.0f)) == CANON, "fma(0, inf, 1)");
    CHECK(fmaxf(-0.0f, 0.0f) == 0.0f && !std::signbit(fmaxf(-0.0f, 0.0f)) && std::signbit(fminf(0.0f, -0.0f)),
          "fmaxf/fminf order -0 < +0");
    // Non-NaN results are the IEEE round-to-nearest ones (reference: f64, exact
    // for + - * / sqrt of f32 operands before the one rounding), subnormals kept.
    std::mt19937_64 rng(3);
    int bad = 0;
    for (int i = 0; i < 200000; i++) {
        uint32_t ua = (uint32_t)rng(), ub = (uint32_t)rng();
        if (i % 4 == 1) ua &= 0x807FFFFFu; // subnormal
        if (i % 4 == 2) ub = (ub & 0x80FFFFFFu) | (ua & 0x7F000000u);
        const float a = f32_of(ua), b = f32_of(ub);
        if (std::isnan(a) || std::isnan(b)) continue;
        const double da = a, db = b;
        auto same = [](float got, double want) {
            const float w = (float)want;
            return std::isnan(w) ? bits_of(got) == 0x7FFFFFFFu : bits_of(got) == bits_of(w);
        };
        bad += !same(__fadd_rn(a, b), da + db);
        bad += !same(__fsub_rn(a, b), da - db);
        bad += !same(__fmul_rn(a, b), da * db);
        bad += !same(__fdiv_rn(a, b), da / db);
        bad += !same(__fsqrt_rn(std::fabs(a)), std::sqrt(std::fabs(da)));
        const float c = f32_of((uint32_t)rng());
        if (!std::isnan(c)) bad += !same(__fmaf_rn(a, b, c), (double)std::fma(a, b, c));
    }
    CHECK(bad == 0, "%d IEEE mismatches", bad);
    // Subnormals are honoured (no FTZ): 2^-140 * 2^-2 = 2^-142.
    CHECK(bits_of(__fmul_rn(f32_of(0x00000200u), 0.25f)) == 0x00000080u, "subnormal product");
    // atomicAdd(float) flushes subnormals (PTX atom.add.f32).
    float acc = f32_of(0x00000200u);
    atomicAdd(&acc, f32_of(0x00000100u));
    CHECK(bits_of(acc) == 0u, "atomicAdd(float) flushes subnormals: %#x", bits_of(acc));
}

static void test_order() {
    Section sec("block order: seeded shuffle, reproducible; thread order");
    const unsigned prev = simt_get_workers();
    simt_set_workers(1);
    unsetenv("SIMT_SEED");
    unsetenv("SIMT_ORDER");
    auto run = [](unsigned gx, unsigned gy, unsigned gz, uint64_t seed) {
        const unsigned long long total = (unsigned long long)gx * gy * gz;
        std::vector<unsigned long long> log(total, ~0ull);
        unsigned counter = 0;
        unsigned *pc = &counter;
        unsigned long long *pl = log.data();
        void *args[] = {&pc, &pl};
        const int rc = simt_launch_fn(SIMT_ENTRY(k_order), gx, gy, gz, 32, 1, 1, 0, args, seed);
        CHECK_RC(rc, SIMT_OK);
        CHECK(counter == total, "%u of %llu blocks ran", counter, total);
        return log;
    };
    for (uint64_t seed : {1ull, 2ull, 12345ull}) {
        auto a = run(40, 1, 1, seed);
        auto b = run(40, 1, 1, seed);
        CHECK(a == b, "seed %" PRIu64 ": the order is not reproducible", seed);
        std::vector<unsigned long long> ident(40), sorted = a;
        for (unsigned i = 0; i < 40; i++) ident[i] = i;
        std::sort(sorted.begin(), sorted.end());
        CHECK(sorted == ident, "seed %" PRIu64 ": some block ran twice or never", seed);
        CHECK(a != ident, "seed %" PRIu64 ": blocks ran in index order", seed);
        for (unsigned i = 0; i < 40; i++)
            CHECK(a[i] == simt_block_order(40, seed, i), "simt_block_order(40, %" PRIu64 ", %u)", seed, i);
    }
    CHECK(run(40, 1, 1, 1) != run(40, 1, 1, 2), "seeds 1 and 2 give the same order");
    {
        auto a = run(5, 3, 2, 9);
        std::set<unsigned long long> s(a.begin(), a.end());
        CHECK(s.size() == 30 && *s.rbegin() == 29, "3-D grid: %zu distinct blocks", s.size());
    }
    // SIMT_SEED replaces the launch's seed; SIMT_ORDER=linear runs blocks in order.
    setenv("SIMT_SEED", "2", 1);
    CHECK(run(40, 1, 1, 1) == run(40, 1, 1, 2) && simt_effective_seed(1) == 2, "SIMT_SEED is not honoured");
    unsetenv("SIMT_SEED");
    setenv("SIMT_ORDER", "linear", 1);
    {
        auto a = run(40, 1, 1, 5);
        bool lin = true;
        for (unsigned i = 0; i < 40; i++) lin = lin && a[i] == i;
        CHECK(lin, "SIMT_ORDER=linear");
    }
    unsetenv("SIMT_ORDER");
    // The permutation is a bijection for every grid size.
    for (unsigned long long total = 1; total <= 3000; total += (total < 300 ? 1 : 37)) {
        std::vector<char> seen(total, 0);
        bool ok = true;
        for (unsigned long long i = 0; i < total; i++) {
            const unsigned long long j = simt_block_order(total, total * 31 + 7, i);
            ok = ok && j < total && !seen[j];
            if (j < total) seen[j] = 1;
        }
        CHECK(ok, "simt_block_order is not a permutation of %llu", total);
    }
    // Threads of a block resume after a barrier in a seeded order.
    auto thread_order = [](uint64_t seed) {
        std::vector<unsigned> log(2 * 128);
        unsigned *p = log.data();
        CHECK_RC(launch1(SIMT_ENTRY(k_thread_order), 2, 128, seed, p), SIMT_OK);
        return log;
    };
    const auto o1 = thread_order(1), o1b = thread_order(1), o2 = thread_order(2);
    CHECK(o1 == o1b && o1 != o2, "thread order: reproducible %d, seed-dependent %d", o1 == o1b, o1 != o2);
    setenv("SIMT_THREAD_ORDER", "linear", 1);
    {
        const auto o = thread_order(3);
        bool lin = true;
        for (unsigned i = 0; i < 256; i++) lin = lin && o[i] == i % 128;
        CHECK(lin, "SIMT_THREAD_ORDER=linear");
    }
    unsetenv("SIMT_THREAD_ORDER");
    simt_set_workers(prev);
}

static void test_shared_memory() {
    Section sec("shared memory: per block, garbage at block start, dynamic");
    std::vector<unsigned> a(8 * 4), b(8 * 4);
    unsigned *pa = a.data(), *pb = b.data();
    CHECK_RC(launch1(SIMT_ENTRY(k_uninit), 8, 32, 1, pa), SIMT_OK);
    CHECK_RC(launch1(SIMT_ENTRY(k_uninit), 8, 32, 2, pb), SIMT_OK);
    int zeros = 0;
    for (unsigned v : a) zeros += v == 0;
    CHECK(a != b && zeros < 4, "uninitialised shared memory reads are not garbage (%d zeros)", zeros);
    const unsigned n = 1000;
    std::vector<unsigned> o(4 * 64);
    unsigned *po = o.data();
    unsigned nn = n;
    void *args[] = {&po, &nn};
    CHECK_RC(simt_launch_fn(SIMT_ENTRY(k_dynamic_shared), 4, 1, 1, 64, 1, 1, n * 4, args, 1), SIMT_OK);
    for (unsigned i = 0; i < o.size(); i++) {
        const unsigned blk = i / 64;
        const unsigned want = 3u * (n * (n - 1) / 2) + n * blk;
        CHECK(o[i] == want, "dynamic shared memory: %u, want %u", o[i], want);
    }
}

// ---- the registry --------------------------------------------------------------------------
static void test_registry(const std::vector<std::string> &expect) {
    Section sec("registry: every kernel of the sources, by name");
    char buf[4096];
    const int problems = simt_check_registry(buf, sizeof buf);
    CHECK(problems == 0, "simt_check_registry: %s", buf);
    printf("     %s", buf);
    std::set<std::string> names;
    for (unsigned i = 0; i < simt_kernel_count(); i++) names.insert(simt_kernel_name(i));
    CHECK(simt_kernel_name(simt_kernel_count()) == nullptr, "name past the end");
    for (const std::string &e : expect) CHECK(names.count(e) == 1, "the CUDA backend's kernel %s is not registered", e.c_str());
    // engram_gather's parameters, as src/cuda/enqueue.rs passes them.
    unsigned sizes[32];
    const int np = simt_kernel_params("engram_gather", sizes, 32);
    const unsigned want[] = {8, 8, 4, 4, 4, 8, 4, 4, 4, 8, 8, 8, 8, 8, 4, 8, 8, 4, 4};
    CHECK(np == 19 && memcmp(sizes, want, sizeof want) == 0, "engram_gather parameters: %d", np);
    CHECK(simt_kernel_params("engram_gemv_q_q4_k", sizes, 32) == 7 && sizes[6] == 4, "quantised gemv parameters");
    CHECK(simt_kernel_params("engram_dequant_bf16", sizes, 32) == 7, "dequantise parameters");
    CHECK(simt_kernel_params("engram_gemv_bf16_8", sizes, 32) == 5 && sizes[3] == 4, "gemv parameters");
    CHECK(simt_kernel_params("engram_gate_bf16_f32", sizes, 32) == 12 && sizes[7] == 4 && sizes[11] == 4,
          "gate parameters");
    CHECK(simt_kernel_params("nope", sizes, 32) == -1, "unknown kernel parameters");
    printf("     build: %s\n", simt_build_info());
}

// ---- the engram kernels -------------------------------------------------------------------
enum : uint32_t { T_F32 = 0, T_F16 = 1, T_Q8_0 = 8, T_BF16 = 30, T_FP8 = 1000 };

struct GatherRun {
    std::vector<uint16_t> rows16;
    std::vector<float> rows32;
    std::vector<uint32_t> flags;
    uint32_t latch[12]; // ENG_LATCH_WORDS: the record, the order key, the lock
};

// engram_gather's grid for `cells` cells as src/cuda/kernels.rs gather_blocks
// makes it (a warp per cell, 8 warps a block, at most 1024 blocks; each warp
// takes cells in a grid-stride loop), or for some seeds 1 or 3 blocks: the
// result must not depend on the grid.
static unsigned gather_grid(uint64_t cells, uint64_t seed) {
    if (seed % 4 == 1) return 1;
    if (seed % 4 == 2) return 3;
    return (unsigned)std::min<uint64_t>((cells + 7) / 8, 1024);
}

// engram_gather, launched as src/cuda/enqueue.rs does: 256 threads.
static GatherRun gather(const std::vector<uint8_t> &table, uint64_t table_rows, uint32_t fmt, uint32_t hd,
                        uint32_t row_bytes, const std::vector<int64_t> &ids, uint32_t id_stride, uint32_t id_offset,
                        uint32_t cols, uint32_t n, bool out_f32, uint64_t seed, int *rc_out = nullptr) {
    GatherRun r;
    r.rows16.assign((size_t)n * cols * hd, 0xDEAD);
    r.rows32.assign(out_f32 ? (size_t)n * cols * hd : 0, -1.0f);
    r.flags.assign((size_t)n * cols, 77);
    memset(r.latch, 0, sizeof r.latch);
    uint64_t t = ptr(table.data()), ip = ptr(ids.data());
    uint64_t rows = out_f32 ? ptr(r.rows32.data()) : ptr(r.rows16.data());
    uint64_t flags = ptr(r.flags.data()), latch = ptr(r.latch);
    uint32_t of = out_f32, lid = 14, serial = 99;
    uint64_t staged_rows = 0, staged_ids = 0, staged_slots = 0; // a table in device memory
    uint64_t n_cells = (uint64_t)n * cols;
    const int rc = launch_named("engram_gather", gather_grid(n_cells, seed), 256, seed, t, table_rows, fmt, hd,
                                row_bytes, ip, id_stride, id_offset, cols, n_cells, staged_rows, staged_ids,
                                staged_slots, rows, of,
                                flags, latch, lid, serial);
    if (rc_out) {
        *rc_out = rc;
    } else {
        CHECK_RC(rc, SIMT_OK);
    }
    return r;
}

// e4m3 value of a code (not NaN), exactly, in double.
static double ref_e4m3(uint8_t c) {
    const int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    const double v = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
    return s ? -v : v;
}

static void test_gather() {
    Section sec("engram_gather: bf16/f32/f16/fp8 rows, dead, bad ids, latch");
    std::mt19937_64 rng(4);
    const uint32_t hd = 256, cols = 24, n = 5;
    const uint64_t nrows = 1000;
    // bf16 table: rows copied bit for bit.
    std::vector<uint8_t> tb(nrows * hd * 2);
    for (auto &b : tb) b = (uint8_t)rng();
    // Finite values only: a NaN or infinity in a row is invalid data (tested below).
    for (size_t i = 1; i < tb.size(); i += 2)
        if ((tb[i] & 0x7F) == 0x7F && (tb[i - 1] & 0x80)) tb[i] &= 0xFE;
    std::vector<int64_t> ids((size_t)n * cols);
    for (auto &v : ids) v = (int64_t)(rng() % nrows);
    auto expect_copy = [&](const GatherRun &g, uint32_t t, uint32_t c, int64_t id, bool f32) {
        bool ok = true;
        for (uint32_t i = 0; i < hd; i++) {
            const uint16_t want = (uint16_t)(tb[(size_t)id * hd * 2 + 2 * i] | tb[(size_t)id * hd * 2 + 2 * i + 1] << 8);
            const size_t at = ((size_t)t * cols + c) * hd + i;
            ok = ok && (f32 ? bits_of(g.rows32[at]) == (uint32_t)want << 16 : g.rows16[at] == want);
        }
        return ok;
    };
    for (bool f32 : {false, true}) {
        const GatherRun g = gather(tb, nrows, T_BF16, hd, hd * 2, ids, cols, 0, cols, n, f32, 5);
        for (uint32_t t = 0; t < n; t++)
            for (uint32_t c = 0; c < cols; c++) {
                CHECK(expect_copy(g, t, c, ids[t * cols + c], f32), "bf16 row copy (f32 out %d) t %u c %u", f32, t, c);
                CHECK(g.flags[t * cols + c] == 0, "flag LIVE");
            }
        CHECK(g.latch[0] == 0, "latch set: %u", g.latch[0]);
    }
    {
        // Device id layout [n, n_layers = 2, C]: layer 1's ids at offset C, stride 2C.
        std::vector<int64_t> dev((size_t)n * 2 * cols);
        for (uint32_t t = 0; t < n; t++)
            for (uint32_t c = 0; c < cols; c++) {
                dev[(size_t)t * 2 * cols + c] = -3; // layer 0: garbage that must not be read
                dev[(size_t)t * 2 * cols + cols + c] = ids[t * cols + c];
            }
        const GatherRun g = gather(tb, nrows, T_BF16, hd, hd * 2, dev, 2 * cols, cols, cols, n, false, 6);
        bool ok = g.latch[0] == 0;
        for (uint32_t t = 0; t < n; t++)
            for (uint32_t c = 0; c < cols; c++) ok = ok && expect_copy(g, t, c, ids[t * cols + c], false);
        CHECK(ok, "device id layout (stride 2C, offset C)");
    }
    {
        // Dead, partly dead, out of range: each alone in its call (one latch).
        struct Case {
            const char *what;
            uint32_t t;
            std::vector<std::pair<uint32_t, int64_t>> set;
            uint32_t flag, code, col;
            int64_t row;
        };
        const Case cases[] = {
            {"dead token", 2, {}, 1, 0, 0, 0},
            {"partly dead", 3, {{5, -1}, {9, -1}}, 2, 2, 5, -1},
            {"row id = rows", 1, {{3, (int64_t)nrows}}, 2, 1, 3, (int64_t)nrows},
            {"negative row id", 4, {{7, -5}, {8, 1000000}}, 2, 1, 7, -5},
            {"row id above 2^32", 0, {{23, 0x100000005ll}}, 2, 1, 23, 0x100000005ll},
            {"dead wins over range", 2, {{0, -1}, {1, (int64_t)nrows}}, 2, 2, 0, -1},
        };
        for (const Case &k : cases) {
            std::vector<int64_t> bad = ids;
            if (k.set.empty())
                for (uint32_t c = 0; c < cols; c++) bad[k.t * cols + c] = -1;
            for (auto &s : k.set) bad[k.t * cols + s.first] = s.second;
            const GatherRun g = gather(tb, nrows, T_BF16, hd, hd * 2, bad, cols, 0, cols, n, false, 7);
            bool ok = true;
            for (uint32_t t = 0; t < n; t++)
                for (uint32_t c = 0; c < cols; c++) {
                    if (t == k.t) {
                        ok = ok && g.flags[t * cols + c] == k.flag;
                        for (uint32_t i = 0; i < hd; i++) ok = ok && g.rows16[((size_t)t * cols + c) * hd + i] == 0;
                    } else {
                        ok = ok && g.flags[t * cols + c] == 0 && expect_copy(g, t, c, ids[t * cols + c], false);
                    }
                }
            CHECK(ok, "%s: rows/flags", k.what);
            const uint32_t want[8] = {k.code, k.code ? k.t : 0, k.code ? k.col : 0, 0,
                                      k.code ? (uint32_t)((uint64_t)k.row & 0xFFFFFFFFu) : 0,
                                      k.code ? (uint32_t)((uint64_t)k.row >> 32) : 0, k.code ? 14u : 0,
                                      k.code ? 99u : 0};
            CHECK(memcmp(g.latch, want, sizeof want) == 0, "%s: latch %u %u %u %u %#x %#x %u %u", k.what, g.latch[0],
                  g.latch[1], g.latch[2], g.latch[3], g.latch[4], g.latch[5], g.latch[6], g.latch[7]);
        }
    }
    {
        // Two bad tokens in one call: the latch names the first, as the CPU
        // backend does, whatever order the blocks ran in (an order key
        // lowered atomically; the details written by the key's holder).
        std::vector<int64_t> bad = ids;
        bad[1 * cols + 3] = (int64_t)nrows;
        bad[3 * cols + 5] = -1;
        for (uint64_t seed = 1; seed <= 24; seed++) {
            const GatherRun g = gather(tb, nrows, T_BF16, hd, hd * 2, bad, cols, 0, cols, n, false, seed);
            CHECK(g.latch[0] == 1 && g.latch[1] == 1 && g.latch[2] == 3, "seed %llu: latch %u token %u column %u",
                  (unsigned long long)seed, g.latch[0], g.latch[1], g.latch[2]);
        }
    }
    // fp8 e4m3 + e8m0: the f32 product rounded to bf16; extreme scales included.
    {
        const uint32_t rb = hd + hd / 32;
        const uint64_t fr = 64;
        std::vector<uint8_t> t8(fr * rb);
        // Extreme scales that keep every value finite (2^119 * 448 < bf16's
        // largest); scales that overflow are invalid data, checked below.
        const uint8_t extreme[] = {0, 1, 2, 6, 7, 8, 120, 127, 134, 240, 244, 246};
        for (uint64_t r = 0; r < fr; r++) {
            for (uint32_t i = 0; i < hd; i++) {
                uint8_t c = (uint8_t)rng();
                if ((c & 0x7F) == 0x7F) c ^= 1;
                t8[r * rb + i] = c;
            }
            for (uint32_t b = 0; b < hd / 32; b++)
                t8[r * rb + hd + b] = (r + b) % 3 == 0 ? extreme[(r * 8 + b) % sizeof extreme] : (uint8_t)(100 + rng() % 55);
        }
        std::vector<int64_t> fid((size_t)n * cols);
        for (size_t i = 0; i < fid.size(); i++) fid[i] = (int64_t)(i % fr);
        for (bool f32 : {false, true}) {
            const GatherRun g = gather(t8, fr, T_FP8, hd, rb, fid, cols, 0, cols, n, f32, 8);
            long bad = 0;
            for (size_t k = 0; k < fid.size(); k++) {
                const uint8_t *row = &t8[(size_t)fid[k] * rb];
                for (uint32_t i = 0; i < hd; i++) {
                    const double v = ref_e4m3(row[i]) * std::ldexp(1.0, (int)row[hd + i / 32] - 127);
                    const uint16_t want = ref_bf16((float)v); // one rounding to f32 (exact or overflow), then bf16
                    const size_t at = k * hd + i;
                    bad += f32 ? bits_of(g.rows32[at]) != (uint32_t)want << 16 : g.rows16[at] != want;
                }
            }
            CHECK(bad == 0 && g.latch[0] == 0, "fp8 rows (f32 out %d): %ld wrong values", f32, bad);
        }
        // NaN scale / NaN code / a value that overflows: that column's row is BAD,
        // its failing elements zero, and the latch says where (the first
        // failing element in element order; a NaN scale by its block).
        struct Nan {
            const char *what;
            std::vector<std::pair<uint32_t, uint8_t>> codes; // (element, code)
            std::vector<std::pair<uint32_t, uint8_t>> scales; // (block, code)
            uint32_t code, where;
        };
        const Nan nans[] = {
            {"NaN scale", {}, {{3, 255}}, 3, 3},
            {"NaN code 0x7F", {{77, 0x7F}}, {}, 4, 77},
            {"NaN code 0xFF", {{200, 0xFF}}, {}, 4, 200},
            {"NaN code before a NaN scale", {{40, 0xFF}}, {{3, 255}}, 4, 40},
            {"NaN scale before a NaN code of its block", {{35, 0x7F}}, {{1, 255}}, 3, 1},
            {"a scale that overflows (2^127 * 448)", {{66, 0x7E}}, {{2, 254}}, 5, 64},
        };
        for (const Nan &k : nans) {
            std::vector<uint8_t> tn = t8;
            const uint64_t badrow = 17;
            for (auto &c : k.codes) tn[badrow * rb + c.first] = c.second;
            for (auto &s : k.scales) tn[badrow * rb + hd + s.first] = s.second;
            if (k.code == 5)
                for (uint32_t i = 64; i < 66; i++) tn[badrow * rb + i] = 0x48; // 4 * 2^127: infinite too
            std::vector<int64_t> nid = fid;
            const uint32_t bt = 2, bc = 7;
            nid[bt * cols + bc] = (int64_t)badrow;
            for (size_t i = 0; i < nid.size(); i++)
                if (i != bt * cols + bc && nid[i] == (int64_t)badrow) nid[i] = 0;
            const GatherRun g = gather(tn, fr, T_FP8, hd, rb, nid, cols, 0, cols, n, false, 9);
            bool ok = true;
            for (uint32_t c = 0; c < cols; c++) ok = ok && g.flags[bt * cols + c] == (c == bc ? 2u : 0u);
            // The failing elements are zero; the row's other elements are written
            // as usual (the column is BAD, so the gate leaves the token alone).
            for (uint32_t i = 0; i < hd; i++) {
                const uint8_t c = tn[badrow * rb + i], sc = tn[badrow * rb + hd + i / 32];
                const bool nan = sc == 255 || (c & 0x7F) == 0x7F;
                const uint16_t v = nan ? 0 : ref_bf16((float)(ref_e4m3(c) * std::ldexp(1.0, (int)sc - 127)));
                const uint16_t want = (v & 0x7F80) == 0x7F80 ? 0 : v;
                ok = ok && g.rows16[((size_t)bt * cols + bc) * hd + i] == want;
            }
            CHECK(ok, "%s: flags/row", k.what);
            const uint32_t want[8] = {k.code, bt, bc, k.where, (uint32_t)badrow, 0, 14, 99};
            CHECK(memcmp(g.latch, want, sizeof want) == 0, "%s: latch %u %u %u %u %u", k.what, g.latch[0], g.latch[1],
                  g.latch[2], g.latch[3], g.latch[4]);
        }
    }
    // f32 and f16 tables: bf16 of the value (f16 decoded independently).
    {
        const uint32_t h = 64, c1 = 4, n1 = 3;
        const uint64_t rows = 20;
        std::vector<uint8_t> t32(rows * h * 4), t16(rows * h * 2);
        for (uint64_t i = 0; i < rows * h; i++) {
            uint32_t u = (uint32_t)rng();
            // Finite values only (a NaN or infinity is invalid data: the Rust
            // tests check that both backends refuse it alike).
            if ((u & 0x7F800000u) == 0x7F800000u) u &= 0xFF7FFFFFu;
            if ((u & 0x7FFFFFFFu) >= 0x7F7F8000u) u = (u & 0x80000000u) | 0x7F7F0000u; // rounds to inf in bf16
            if (i % 13 == 0) u &= 0x807FFFFFu;                           // subnormal
            if (i % 7 == 0) u = (u & 0xFFFF0000u) | 0x8000u;             // a tie
            memcpy(&t32[i * 4], &u, 4);
            uint16_t hb = (uint16_t)rng();
            if ((hb & 0x7C00u) == 0x7C00u) hb &= 0xFBFFu;
            memcpy(&t16[i * 2], &hb, 2);
        }
        std::vector<int64_t> id1((size_t)n1 * c1);
        for (size_t i = 0; i < id1.size(); i++) id1[i] = (int64_t)((i * 7) % rows);
        const GatherRun g32 = gather(t32, rows, T_F32, h, h * 4, id1, c1, 0, c1, n1, false, 10);
        const GatherRun g16 = gather(t16, rows, T_F16, h, h * 2, id1, c1, 0, c1, n1, false, 10);
        long bad = 0;
        for (size_t k = 0; k < id1.size(); k++)
            for (uint32_t i = 0; i < h; i++) {
                const size_t e = (size_t)id1[k] * h + i;
                uint32_t u;
                memcpy(&u, &t32[e * 4], 4);
                bad += g32.rows16[k * h + i] != ref_bf16(f32_of(u));
                uint16_t hb;
                memcpy(&hb, &t16[e * 2], 2);
                const int ex = (hb >> 10) & 31, man = hb & 1023;
                float fv;
                if (ex == 31)
                    fv = man ? f32_of(((uint32_t)(hb & 0x8000u) << 16) | 0x7FC00000u | ((uint32_t)man << 13))
                             : f32_of(((uint32_t)(hb & 0x8000u) << 16) | 0x7F800000u);
                else
                    fv = (float)((hb & 0x8000u ? -1.0 : 1.0) *
                                 (ex == 0 ? std::ldexp(man, -24) : std::ldexp(1024 + man, ex - 25)));
                bad += g16.rows16[k * h + i] != ref_bf16(fv);
            }
        CHECK(bad == 0, "f32/f16 rows: %ld wrong values", bad);
    }
    // Q8_0 with a NaN or infinite scale: not finite once dequantised, so invalid
    // data on both backends (ENG_ERR_NON_FINITE at the first such element, the
    // token flagged BAD); the NaN bits the GPU's __fmul_rn would give (the
    // canonical 0x7FFFFFFF, bf16 0x7FFF) never leave the kernel.
    {
        const uint32_t h = 64, rb = h / 32 * 34;
        std::vector<uint8_t> tq(2 * rb);
        for (auto &b : tq) b = (uint8_t)rng();
        const uint16_t dnan = 0xFE01, dinf = 0x7C00;
        memcpy(&tq[0], &dnan, 2);     // row 0 block 0: d = NaN
        memcpy(&tq[34], &dinf, 2);    // row 0 block 1: d = +inf
        tq[34 + 2 + 5] = 0;           // ... and q = 0 at element 32 + 5: inf * 0
        const uint16_t done = 0x3C00; // row 1: d = 1
        memcpy(&tq[rb], &done, 2);
        memcpy(&tq[rb + 34], &done, 2);
        std::vector<int64_t> qi = {0, 1};
        const GatherRun g = gather(tq, 2, T_Q8_0, h, rb, qi, 2, 0, 2, 1, false, 11);
        CHECK(g.latch[0] == 5 && g.latch[1] == 0 && g.latch[2] == 0 && g.latch[3] == 0 && g.latch[4] == 0,
              "Q8_0 with NaN/inf scales: non-finite at row 0 element 0 (latch %u %u %u %u %u)", g.latch[0],
              g.latch[1], g.latch[2], g.latch[3], g.latch[4]);
        bool ok = g.flags[0] == 2 && g.flags[1] == 0;
        for (uint32_t i = 0; i < 64; i++) ok = ok && (g.rows16[i] & 0x7F80) != 0x7F80;
        for (uint32_t i = 0; i < 64; i++) ok = ok && g.rows16[h + i] == ref_bf16((float)(int8_t)tq[rb + 2 + i % 32 + (i / 32) * 34]);
        CHECK(ok, "Q8_0 with NaN/inf scales: the bad row BAD with no NaN or inf written, the good row exact");
    }
    // bf16 rows of Hd 36 (not a multiple of 8: a value per lane at a time)
    // and Hd 40 (80-byte rows: every other row 16-byte aligned, so both the
    // vector and the per-value paths in one launch), copied bit for bit.
    for (uint32_t h : {36u, 40u}) {
        const uint32_t c2 = 3, n2 = 7, nr = 50;
        std::vector<uint8_t> t2((size_t)nr * h * 2);
        for (size_t i = 0; i < t2.size(); i++) t2[i] = (uint8_t)(i % 2 ? rng() & 0x3F : rng()); // finite
        std::vector<int64_t> i2((size_t)n2 * c2);
        for (auto &v : i2) v = (int64_t)(rng() % nr);
        for (bool f32 : {false, true}) {
            const GatherRun g = gather(t2, nr, T_BF16, h, h * 2, i2, c2, 0, c2, n2, f32, 12 + f32);
            bool ok = g.latch[0] == 0;
            for (size_t p = 0; p < (size_t)n2 * c2; p++)
                for (uint32_t i = 0; i < h; i++) {
                    const size_t b = (size_t)i2[p] * h * 2 + 2 * i;
                    const uint16_t want = (uint16_t)(t2[b] | t2[b + 1] << 8);
                    const size_t at = p * h + i;
                    ok = ok && (f32 ? bits_of(g.rows32[at]) == (uint32_t)want << 16 : g.rows16[at] == want);
                    ok = ok && g.flags[p] == 0;
                }
            CHECK(ok, "bf16 rows of Hd %u (f32 out %d): copied bit for bit", h, (int)f32);
        }
    }
}

static void bf16_fill(std::vector<uint16_t> &v, std::mt19937_64 &rng, double scale) {
    std::normal_distribution<double> nd(0.0, scale);
    for (auto &x : v) x = ref_bf16((float)nd(rng));
}

// The kernel's own order in f32 (lane strides of 8 values, then the xor butterfly).
static float gemv_order_ref(const uint16_t *w, const uint16_t *r, uint32_t k) {
    float lane[32];
    for (uint32_t l = 0; l < 32; l++) {
        float acc = 0.f;
        for (uint32_t c = l; c < k / 8; c += 32)
            for (uint32_t e = 0; e < 8; e++) acc += bf16f(w[c * 8 + e]) * bf16f(r[c * 8 + e]);
        lane[l] = acc;
    }
    for (uint32_t m = 16; m > 0; m >>= 1) {
        float nx[32];
        for (uint32_t l = 0; l < 32; l++) nx[l] = lane[l] + lane[l ^ m];
        memcpy(lane, nx, sizeof lane);
    }
    return lane[0];
}

static void test_gemv() {
    Section sec("engram_gemv_bf16_1..8 vs an f64 dot product");
    std::mt19937_64 rng(5);
    struct Shape {
        uint32_t n_out, k;
    };
    const Shape shapes[] = {{99, 512}, {16, 8}, {300, 6144}};
    for (const Shape &s : shapes) {
        for (uint32_t nt = 1; nt <= 8; nt++) {
            if (s.k == 6144 && nt != 8 && nt != 1) continue;
            std::vector<uint16_t> w((size_t)s.n_out * s.k), rows((size_t)nt * s.k), kv((size_t)nt * s.n_out, 0xBEEF);
            bf16_fill(w, rng, 0.05);
            bf16_fill(rows, rng, 1.0);
            uint64_t pw = ptr(w.data()), pr = ptr(rows.data()), pk = ptr(kv.data());
            uint32_t n_out = s.n_out, k = s.k;
            const uint32_t blocks = (s.n_out + 15) / 16; // GEMV_ROWS_PER_WARP * GEMV_THREADS / 32
            char name[32];
            snprintf(name, sizeof name, "engram_gemv_bf16_%u", nt);
            CHECK_RC(launch_named(name, blocks, 256, nt, pw, pr, pk, n_out, k), SIMT_OK);
            long outside = 0, exact = 0, order_bad = 0;
            for (uint32_t t = 0; t < nt; t++)
                for (uint32_t o = 0; o < s.n_out; o++) {
                    double dot = 0, mag = 0;
                    for (uint32_t i = 0; i < s.k; i++) {
                        const double p = (double)bf16f(w[(size_t)o * s.k + i]) * bf16f(rows[(size_t)t * s.k + i]);
                        dot += p;
                        mag += std::fabs(p);
                    }
                    const uint16_t got = kv[(size_t)t * s.n_out + o];
                    const double g = bf16f(got);
                    // f32 accumulation: k/32 sequential adds per lane and 5 butterfly
                    // levels, each off by at most 2^-24 of the running magnitude; then one
                    // rounding to bf16 (half an ulp).
                    const double bound = 0.5 * ulp_bf16(std::max(std::fabs(dot), std::fabs(g))) +
                                         (s.k / 32.0 + 6.0) * std::ldexp(mag, -24);
                    outside += std::fabs(g - dot) > bound;
                    exact += got == ref_bf16((float)dot);
                    order_bad += got != ref_bf16(gemv_order_ref(&w[(size_t)o * s.k], &rows[(size_t)t * s.k], s.k));
                }
            CHECK(outside == 0, "%s %ux%u: %ld values outside the bound", name, s.n_out, s.k, outside);
            CHECK(order_bad == 0, "%s %ux%u: %ld values differ from the kernel-order f32 sum", name, s.n_out, s.k,
                  order_bad);
            if (nt == 8 && s.k == 6144)
                printf("     gemv 8 tokens %ux%u: %ld of %u values equal bf16(f64 dot), all within the bound\n",
                       s.n_out, s.k, exact, nt * s.n_out);
        }
    }
}

// ---- the gate ---------------------------------------------------------------------------------
// The gate's grid as src/cuda/kernels.rs gate_blocks makes it: a warp per
// (token, stream), 8 a block.
static unsigned gate_grid(uint32_t streams) { return (streams + 7) / 8; }

struct GateCase {
    uint32_t n, hc, d, cols;
    bool hw_bf16, kv_f32;
    // The highway this many elements past a 16-byte boundary (not 0: no
    // 16-byte loads, a value at a time, in the same order).
    uint32_t hw_off = 0;
};

static double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
static double g_gate_worst = 0; // the largest error / bound seen

static void test_gate_case(const GateCase &gc, std::mt19937_64 &rng, bool nan_case) {
    const uint32_t n = gc.n, hc = gc.hc, d = gc.d, cols = gc.cols;
    const float eps = 1e-6f;
    const float inv_sqrt_d = 1.0f / std::sqrt((float)d);
    std::normal_distribution<double> nd(0.0, 1.0);
    std::vector<float> x32((size_t)n * hc * d), kv32((size_t)n * (hc + 1) * d), qk((size_t)hc * d);
    std::vector<uint16_t> x16(x32.size()), kv16(kv32.size());
    for (size_t i = 0; i < x32.size(); i++) {
        x32[i] = (float)(nd(rng) * 0.7 + 0.1);
        x16[i] = ref_bf16(x32[i]);
    }
    for (size_t i = 0; i < kv32.size(); i++) {
        kv32[i] = (float)nd(rng);
        kv16[i] = ref_bf16(kv32[i]);
    }
    for (auto &q : qk) q = (float)(1.0 + 0.1 * nd(rng)) * (float)(1.0 + 0.1 * nd(rng));
    // Token 0: its key is the stream's x (a large positive dot); token 1 dead;
    // token 2 has one BAD column; the rest random.
    for (uint32_t s = 0; s < hc; s++)
        for (uint32_t j = 0; j < d; j++) {
            kv32[(size_t)s * d + j] = x32[(size_t)s * d + j];
            kv16[(size_t)s * d + j] = ref_bf16(kv32[(size_t)s * d + j]);
        }
    std::vector<uint32_t> flags((size_t)n * cols, 0);
    if (n > 1)
        for (uint32_t c = 0; c < cols; c++) flags[1 * cols + c] = 1;
    if (n > 2) flags[2 * cols + cols - 1] = 2;
    const uint32_t nan_t = 3, nan_s = 1, nan_j = 7;
    if (nan_case) {
        x32[((size_t)nan_t * hc + nan_s) * d + nan_j] = f32_of(0x7FC0ABCDu);
        x16[((size_t)nan_t * hc + nan_s) * d + nan_j] = 0x7FC5;
    }
    const std::vector<float> x32_in = x32;
    const std::vector<uint16_t> x16_in = x16;
    uint32_t latch[12] = {3, 5, 6, 7, 8, 9, 10, 11, 0xAA, 0xBB, 0, 0}, mirror[12] = {0};
    std::vector<float> px32(gc.hw_off + x32.size());
    std::vector<uint16_t> px16(gc.hw_off + x16.size());
    std::copy(x32.begin(), x32.end(), px32.begin() + gc.hw_off);
    std::copy(x16.begin(), x16.end(), px16.begin() + gc.hw_off);
    uint64_t hw = gc.hw_bf16 ? ptr(px16.data() + gc.hw_off) : ptr(px32.data() + gc.hw_off);
    uint64_t kvp = gc.kv_f32 ? ptr(kv32.data()) : ptr(kv16.data());
    uint64_t qkp = ptr(qk.data()), fl = ptr(flags.data()), lp = ptr(latch), mp = ptr(mirror);
    uint32_t ucols = cols, uhc = hc, ud = d;
    float feps = eps, finv = inv_sqrt_d;
    const char *names[2][2] = {{"engram_gate_f32_bf16", "engram_gate_f32_f32"},
                               {"engram_gate_bf16_bf16", "engram_gate_bf16_f32"}};
    const char *name = names[gc.hw_bf16][gc.kv_f32];
    uint32_t streams = n * hc;
    CHECK_RC(launch_named(name, gate_grid(streams), 256, 21, hw, kvp, qkp, fl, ucols, uhc, ud, feps, finv, lp, mp,
                          streams),
             SIMT_OK);
    std::copy(px32.begin() + gc.hw_off, px32.end(), x32.begin());
    std::copy(px16.begin() + gc.hw_off, px16.end(), x16.begin());
    const uint32_t want_mirror[8] = {3, 5, 6, 7, 8, 9, 10, 11};
    CHECK(memcmp(mirror, want_mirror, sizeof want_mirror) == 0 && latch[0] == 0 && latch[1] == 5 &&
              latch[8] == 0 && latch[9] == 0 && mirror[8] == 0,
          "%s: latch moved to the mirror, its order key cleared", name);
    long far = 0, order_bad = 0, untouched_bad = 0;
    for (uint32_t t = 0; t < n; t++) {
        const bool live = t != 1 && t != 2;
        for (uint32_t s = 0; s < hc; s++) {
            const size_t xo = ((size_t)t * hc + s) * d, ko = (size_t)t * (hc + 1) * d + (size_t)s * d,
                         vo = (size_t)t * (hc + 1) * d + (size_t)hc * d;
            auto xin = [&](uint32_t j) { return gc.hw_bf16 ? bf16f(x16_in[xo + j]) : x32_in[xo + j]; };
            auto kvv = [&](size_t i) { return gc.kv_f32 ? bf16f(ref_bf16(kv32[i])) : bf16f(kv16[i]); };
            auto out_bits = [&](uint32_t j) {
                return gc.hw_bf16 ? (uint32_t)x16[xo + j] : bits_of(x32[xo + j]);
            };
            if (!live) {
                for (uint32_t j = 0; j < d; j++)
                    untouched_bad += gc.hw_bf16 ? x16[xo + j] != x16_in[xo + j] : bits_of(x32[xo + j]) != bits_of(x32_in[xo + j]);
                continue;
            }
            if (nan_case && t == nan_t && s == nan_s) {
                // The stream's gate is NaN: every output is a NaN, the GPU's
                // canonical one except (here) where x itself was the NaN.
                long not_canon = 0;
                for (uint32_t j = 0; j < d; j++) {
                    const uint32_t b = out_bits(j);
                    if (j == nan_j) continue;
                    not_canon += b != (gc.hw_bf16 ? 0x7FFFu : 0x7FFFFFFFu);
                }
                CHECK(not_canon == 0, "%s: NaN stream: %ld outputs are not the canonical NaN", name, not_canon);
                printf("     %s: NaN x = %#x in, %#x out (the GPU gives %#x)\n", name,
                       gc.hw_bf16 ? 0x7FC5u : 0x7FC0ABCDu, out_bits(nan_j), gc.hw_bf16 ? 0x7FFFu : 0x7FFFFFFFu);
                continue;
            }
            // SPEC section 1 step 6 in double.
            double hh = 0, kk = 0, dt = 0, sdt = 0;
            for (uint32_t j = 0; j < d; j++) {
                const double xv = xin(j), key = kvv(ko + j);
                hh += xv * xv;
                kk += key * key;
                dt += xv * qk[(size_t)s * d + j] * key;
                sdt += std::fabs(xv * qk[(size_t)s * d + j] * key);
            }
            const double scale = 1.0 / std::sqrt(hh / d + eps) / std::sqrt(kk / d + eps) / std::sqrt((double)d);
            const double dot = dt * scale;
            const double sg = dot > 0 ? 1.0 : (dot < 0 ? -1.0 : 0.0);
            const double gate = sigmoid(sg * std::sqrt(std::max(std::fabs(dot), 1e-6)));
            // How far the kernel's f32 evaluation may be from this (u = 2^-24): each
            // sum adds along a path of L = d/256 (per thread) + 5 (butterfly) + 8
            // (warps) terms, each add off by u of the running magnitude, the products
            // x*q*key by 2u; rstd and the four products of dot by a few u. Then
            // the gate moves by at most 1/4 (sigmoid') * 1/(2 sqrt|dot|) (the root)
            // of that, plus expf and the divisions. All doubled for slack.
            const double u = std::ldexp(1.0, -24), L = std::ceil(d / 256.0) + 5 + 8;
            const double ddot = 2 * ((L + 3) * u * sdt * scale + std::fabs(dot) * (L + 12) * u);
            const double dgate = 2 * (0.25 * ddot / (2 * std::sqrt(std::max(std::fabs(dot) - ddot, 1e-6))) + 8 * u);
            // The kernel's own order and roundings in f32 (per thread, then warps).
            // FMAD=1 builds contract a*b+c into an FMA where NVVM would.
            const bool fma = simt_build_info()[5] == '1'; // "fmad=1 ..."
            auto mac = [fma](float a, float b, float c) { return fma ? fmaf(a, b, c) : a * b + c; };
            float th[256][3];
            for (uint32_t tt = 0; tt < 256; tt++) {
                float h = 0.f, k2 = 0.f, dd = 0.f;
                for (uint32_t j = tt; j < d; j += 256) {
                    const float xv = xin(j), key = kvv(ko + j);
                    h = mac(xv, xv, h);
                    k2 = mac(key, key, k2);
                    dd = mac(xv * qk[(size_t)s * d + j], key, dd);
                }
                th[tt][0] = h;
                th[tt][1] = k2;
                th[tt][2] = dd;
            }
            float sums[3];
            for (int q = 0; q < 3; q++) {
                float acc = 0.f;
                for (uint32_t wp = 0; wp < 8; wp++) {
                    float lane[32];
                    for (uint32_t l = 0; l < 32; l++) lane[l] = th[wp * 32 + l][q];
                    for (uint32_t m = 16; m > 0; m >>= 1) {
                        float nx[32];
                        for (uint32_t l = 0; l < 32; l++) nx[l] = lane[l] + lane[l ^ m];
                        memcpy(lane, nx, sizeof lane);
                    }
                    acc += lane[0];
                }
                sums[q] = acc;
            }
            const float rx = 1.0f / sqrtf(sums[0] / (float)d + eps), rk = 1.0f / sqrtf(sums[1] / (float)d + eps);
            const float fdot = sums[2] * rx * rk * inv_sqrt_d;
            const float fsg = fdot > 0.f ? 1.f : (fdot < 0.f ? -1.f : 0.f);
            const float fg = fsg * sqrtf(fmaxf(fabsf(fdot), 1e-6f));
            const float fgate = 1.0f / (1.0f + expf(-fg));
            for (uint32_t j = 0; j < d; j++) {
                const double v = kvv(vo + j);
                const double want = xin(j) + gate * v;
                const uint32_t got_bits = out_bits(j);
                const double got = gc.hw_bf16 ? bf16f((uint16_t)got_bits) : f32_of(got_bits);
                // The gate's error times the value, the update's own rounding (an FMA or
                // a product and a sum), and for a bf16 highway half a bf16 ulp.
                const double tol = dgate * std::fabs(v) + 4 * u * (std::fabs(xin(j)) + std::fabs(gate * v)) +
                                   (gc.hw_bf16 ? 0.5 * ulp_bf16(std::max(std::fabs(want), std::fabs(got))) : 0.0);
                const double err = std::fabs(got - want);
                if (!gc.hw_bf16) g_gate_worst = std::max(g_gate_worst, err / tol);
                far += err > tol;
                const float of = mac(fgate, kvv(vo + j), xin(j));
                order_bad += got_bits != (gc.hw_bf16 ? (uint32_t)ref_bf16(of) : bits_of(of));
            }
        }
    }
    CHECK(untouched_bad == 0, "%s: %ld values of dead/bad tokens changed", name, untouched_bad);
    CHECK(far == 0, "%s d=%u: %ld values off the SPEC formula (f64) beyond the bound", name, d, far);
    CHECK(order_bad == 0, "%s d=%u: %ld values differ from the kernel-order f32 reference", name, d, order_bad);
    // A second launch with the mirror still full: the latch is cleared, the mirror kept.
    latch[0] = 4;
    CHECK_RC(launch_named(name, gate_grid(streams), 256, 22, hw, kvp, qkp, fl, ucols, uhc, ud, feps, finv, lp, mp,
                          streams),
             SIMT_OK);
    CHECK(latch[0] == 0 && mirror[0] == 3, "%s: a full mirror is kept", name);
}

static void test_gate() {
    Section sec("engram_gate_*: SPEC formula, dead/bad tokens, latch, NaN");
    std::mt19937_64 rng(6);
    for (bool hwb : {false, true})
        for (bool kvf : {false, true}) {
            test_gate_case(GateCase{5, 4, 300, 3, hwb, kvf}, rng, false);
            test_gate_case(GateCase{4, 4, 64, 4, hwb, kvf}, rng, true);
        }
    test_gate_case(GateCase{4, 2, 6400, 2, false, false}, rng, false); // d > 24 * 256: the uncached path
    test_gate_case(GateCase{4, 2, 6400, 2, true, true}, rng, false);
    // D a multiple of 8 but the highway off 16-byte alignment: a value at a time.
    test_gate_case(GateCase{5, 4, 64, 3, false, false, 1}, rng, false);
    test_gate_case(GateCase{5, 4, 64, 3, true, true, 3}, rng, false);
    printf("     gate vs the f64 formula: the largest f32-highway error is %.3f of its bound\n", g_gate_worst);
}

// engram_decode_bf16 (kernels/decode.cu): phase A alone (an ordinary launch,
// no highway) against the gather's rows and the GEMV's order, for 1 to 40
// tokens (tiles of up to ENG_DECODE_TILE = 16, so up to 3 tiles) and an odd
// number of outputs; then with an f32 highway (an ordinary launch: the last
// block done runs the gate), whose gate must give the bits of
// engram_gate_f32_bf16 on the same kv, and the count of blocks done must be
// back to zero after it.
static void test_decode() {
    Section sec("engram_decode_bf16: gather + GEMV order; its last block's gate = the gate kernel");
    std::mt19937_64 rng(8);
    const uint32_t hd = 128, cols = 4, k = cols * hd, n_out = 99, hc = 4, d = 24, nr = 300;
    // n_out is odd: the last pair's second row is past the end.
    CHECK_RC(simt_set_max_dynamic_shared("engram_decode_bf16", SIMT_MAX_SHARED_OPTIN), SIMT_OK);
    std::vector<uint16_t> table((size_t)nr * hd), w((size_t)n_out * k);
    bf16_fill(table, rng, 1.0);
    bf16_fill(w, rng, 0.05);
    for (uint32_t nt : {1u, 3u, 17u, 40u}) {
        std::vector<int64_t> ids((size_t)nt * cols);
        for (auto &v : ids) v = (int64_t)(rng() % nr);
        const uint32_t tile = nt < 16 ? nt : 16;
        std::vector<uint16_t> rows((size_t)nt * k, 0xDEAD), kv((size_t)nt * n_out, 0xBEEF);
        std::vector<uint32_t> flags((size_t)nt * cols, 77);
        uint32_t latch[12] = {0};
        uint64_t tp = ptr(table.data()), trows = nr, ip = ptr(ids.data()), zero = 0;
        uint32_t fmt = T_BF16, uhd = hd, rb = hd * 2, stride = cols, off = 0, ucols = cols;
        uint64_t ro = ptr(rows.data()), fl = ptr(flags.data()), lp = ptr(latch);
        uint32_t lid = 3, serial = 4;
        uint64_t wp = ptr(w.data());
        uint32_t br = 0, bc = 0, nbc = 0, un = n_out, uk = k, unt = nt, ut = tile;
        uint64_t kvp = ptr(kv.data());
        uint32_t hw_bf16 = 0, uhc = hc, ud = d;
        float eps = 1e-6f, inv = 1.0f / std::sqrt((float)d);
        uint64_t qk = 0, mirror = 0, barrier = 0;
        void *args[] = {&tp,  &trows, &fmt,    &uhd,  &rb,  &ip,  &stride, &off, &ucols, &zero,
                        &zero, &zero, &zero, &ro,     &fl,   &lp,  &lid, &serial, &wp,  &zero,  &br,
                        &bc,  &nbc,   &kvp,    &un,   &uk,  &unt, &ut,     &zero, &hw_bf16, &qk,
                        &uhc, &ud,    &eps,    &inv,  &mirror, &barrier};
        const unsigned grid = nt == 17 ? 1 : 3;
        CHECK_RC(simt_launch("engram_decode_bf16", grid, 1, 1, 256, 1, 1, tile * k * 2, args, nt), SIMT_OK);
        long row_bad = 0, kv_bad = 0;
        for (uint32_t t = 0; t < nt; t++) {
            for (uint32_t c = 0; c < cols; c++)
                for (uint32_t i = 0; i < hd; i++)
                    row_bad += rows[(size_t)t * k + c * hd + i] != table[(size_t)ids[t * cols + c] * hd + i] ||
                               flags[t * cols + c] != 0;
            for (uint32_t o = 0; o < n_out; o++)
                kv_bad += kv[(size_t)t * n_out + o] != ref_bf16(gemv_order_ref(&w[(size_t)o * k], &rows[(size_t)t * k], k));
        }
        CHECK(row_bad == 0 && latch[0] == 0, "%u tokens: %ld rows or flags differ from the table's", nt, row_bad);
        CHECK(kv_bad == 0, "%u tokens: %ld kv values differ from the GEMV's order", nt, kv_bad);
    }
    // With a highway: the last block done's gate against the gate kernel.
    {
        const uint32_t nt = 5, tile = 5, n_out2 = (hc + 1) * d;
        std::vector<uint16_t> w2((size_t)n_out2 * k);
        bf16_fill(w2, rng, 0.05);
        std::vector<int64_t> ids((size_t)nt * cols);
        for (auto &v : ids) v = (int64_t)(rng() % nr);
        ids[1 * cols + 2] = -1; // token 1 partly dead: left alone, the error latched
        std::vector<float> qkv((size_t)hc * d), hw((size_t)nt * hc * d);
        std::normal_distribution<double> nd(0.0, 1.0);
        for (auto &q : qkv) q = (float)(1.0 + 0.1 * nd(rng));
        for (auto &x : hw) x = (float)nd(rng);
        const std::vector<float> hw_in = hw;
        std::vector<float> hw_gate = hw;
        std::vector<uint16_t> rows((size_t)nt * k), kv((size_t)nt * n_out2);
        std::vector<uint32_t> flags((size_t)nt * cols);
        uint32_t latch[12] = {0}, mirror[12] = {0}, bar = 0;
        uint64_t tp = ptr(table.data()), trows = nr, ip = ptr(ids.data()), zero = 0;
        uint32_t fmt = T_BF16, uhd = hd, rb = hd * 2, stride = cols, off = 0, ucols = cols;
        uint64_t ro = ptr(rows.data()), fl = ptr(flags.data()), lp = ptr(latch);
        uint32_t lid = 3, serial = 4;
        uint64_t wp = ptr(w2.data());
        uint32_t br = 0, bc = 0, nbc = 0, un = n_out2, uk = k, unt = nt, ut = tile;
        uint64_t kvp = ptr(kv.data()), hwp = ptr(hw.data()), qk = ptr(qkv.data()), mp = ptr(mirror), bp = ptr(&bar);
        uint32_t hw_bf16 = 0, uhc = hc, ud = d;
        float eps = 1e-6f, inv = 1.0f / std::sqrt((float)d);
        void *args[] = {&tp,  &trows, &fmt, &uhd, &rb,  &ip,  &stride, &off, &ucols, &zero,
                        &zero, &zero, &zero, &ro,  &fl,  &lp,  &lid, &serial, &wp,  &zero,  &br,
                        &bc,  &nbc,   &kvp, &un,  &uk,  &unt, &ut,     &hwp, &hw_bf16, &qk,
                        &uhc, &ud,    &eps, &inv, &mp,  &bp};
        CHECK_RC(simt_launch("engram_decode_bf16", 3, 1, 1, 256, 1, 1, tile * k * 2, args, 9), SIMT_OK);
        CHECK(mirror[0] == 2 && mirror[1] == 1 && mirror[2] == 2 && latch[0] == 0 && bar == 0,
              "the partly dead token's error moved to the mirror (%u %u %u), the count of blocks done reset (%#x)",
              mirror[0], mirror[1], mirror[2], bar);
        // The gate kernel on the kv and flags the decode kernel left.
        uint32_t latch2[12] = {0}, mirror2[12] = {0};
        uint64_t hgp = ptr(hw_gate.data()), lp2 = ptr(latch2), mp2 = ptr(mirror2);
        uint32_t streams = nt * hc;
        CHECK_RC(launch_named("engram_gate_f32_bf16", gate_grid(streams), 256, 22, hgp, kvp, qk, fl, ucols, uhc, ud, eps,
                              inv, lp2, mp2, streams),
                 SIMT_OK);
        long differ = 0, changed = 0, touched = 0;
        for (size_t i = 0; i < hw.size(); i++) {
            differ += bits_of(hw[i]) != bits_of(hw_gate[i]);
            if (i / (hc * d) == 1) {
                touched += bits_of(hw[i]) != bits_of(hw_in[i]);
            } else {
                changed += bits_of(hw[i]) != bits_of(hw_in[i]);
            }
        }
        CHECK(differ == 0, "the decode kernel's gate: %ld values differ from the gate kernel's", differ);
        CHECK(touched == 0 && changed > (long)(hw.size() / 2),
              "the partly dead token left alone (%ld changed), the others updated (%ld)", touched, changed);
    }
}

// The same launches under other seeds and worker counts give the same bytes.
static void test_determinism() {
    Section sec("determinism across seeds and worker counts");
    std::mt19937_64 rng(7);
    const uint32_t hd = 64, cols = 4, n = 16, n_out = 5 * 64, k = cols * hd;
    std::vector<uint8_t> tb(500 * hd * 2);
    for (auto &b : tb) b = (uint8_t)rng();
    std::vector<int64_t> ids((size_t)n * cols);
    for (auto &v : ids) v = (int64_t)(rng() % 500);
    std::vector<uint16_t> w((size_t)n_out * k);
    bf16_fill(w, rng, 0.05);
    std::vector<float> qk((size_t)4 * 64, 1.0f), hw0((size_t)n * 4 * 64);
    for (auto &x : hw0) x = (float)((int)(rng() % 2001) - 1000) / 512.0f;
    auto pipeline = [&](uint64_t seed) {
        GatherRun g = gather(tb, 500, T_BF16, hd, hd * 2, ids, cols, 0, cols, n, false, seed);
        std::vector<uint16_t> kv((size_t)8 * n_out);
        std::vector<float> hw = hw0;
        for (uint32_t t0 = 0; t0 < n; t0 += 8) {
            uint64_t pw = ptr(w.data()), pr = ptr(&g.rows16[(size_t)t0 * k]), pk = ptr(kv.data());
            uint32_t no = n_out, kk = k;
            CHECK_RC(launch_named("engram_gemv_bf16_8", (n_out + 15) / 16, 256, seed, pw, pr, pk, no, kk), SIMT_OK);
            uint32_t latch[12] = {0}, mirror[12] = {0};
            uint64_t h = ptr(&hw[(size_t)t0 * 4 * 64]), kvp = ptr(kv.data()), q = ptr(qk.data());
            uint64_t fl = ptr(&g.flags[(size_t)t0 * cols]), lp = ptr(latch), mp = ptr(mirror);
            uint32_t c = cols, hc = 4, d = 64;
            float eps = 1e-6f, inv = 0.125f;
            uint32_t streams = 8 * 4;
            CHECK_RC(launch_named("engram_gate_f32_bf16", gate_grid(streams), 256, seed, h, kvp, q, fl, c, hc, d, eps,
                                  inv, lp, mp, streams),
                     SIMT_OK);
        }
        return hw;
    };
    const unsigned prev = simt_get_workers();
    simt_set_workers(1);
    const auto a = pipeline(1);
    simt_set_workers(3);
    const auto b = pipeline(2);
    const auto c = pipeline(99);
    simt_set_workers(prev);
    CHECK(memcmp(a.data(), b.data(), a.size() * 4) == 0 && memcmp(a.data(), c.data(), a.size() * 4) == 0,
          "results depend on the seed or the worker count");
}

// ---- benchmarks --------------------------------------------------------------------------------
template <class F> static double best_of(int reps, F f) {
    double best = 1e30;
    for (int i = 0; i < reps; i++) {
        const double t0 = now_s();
        f();
        best = std::min(best, now_s() - t0);
    }
    return best;
}

// bf16 values of random sign, exponent in [2^-8, 2^2), random mantissa (fast).
static void bf16_fill_fast(std::vector<uint16_t> &v, uint64_t seed) {
    uint64_t s = seed;
    for (size_t i = 0; i < v.size(); i += 4) {
        s += 0x9E3779B97F4A7C15ull;
        uint64_t z = (s ^ (s >> 31)) * 0xBF58476D1CE4E5B9ull;
        z ^= z >> 29;
        for (size_t j = 0; j < 4 && i + j < v.size(); j++) {
            const uint16_t r = (uint16_t)(z >> (16 * j));
            v[i + j] = (uint16_t)((r & 0x807Fu) | ((0x77u + (r >> 7) % 10u) << 7));
        }
    }
}

// `which`: all, real (the model's sizes) or small (a test-sized step).
static void bench(const char *which) {
    const bool real = !strcmp(which, "all") || !strcmp(which, "real");
    const bool small = !strcmp(which, "all") || !strcmp(which, "small");
    printf("workers: %u, build: %s\n", simt_get_workers(), simt_build_info());
    std::mt19937_64 rng(8);
    auto gather_bench = [&](const char *what, uint32_t fmt, uint32_t rb, uint32_t n, uint32_t cols, uint32_t hd,
                            uint64_t rows) {
        std::vector<uint8_t> table(rows * rb);
        for (auto &b : table) b = (uint8_t)(rng() & 0x3F); // no fp8 NaN codes or scales
        std::vector<int64_t> ids((size_t)n * cols);
        for (auto &v : ids) v = (int64_t)(rng() % rows);
        const double t = best_of(3, [&] { gather(table, rows, fmt, hd, rb, ids, cols, 0, cols, n, false, 4); });
        printf("gather %-36s %3u tokens x %2u cols x %3u: %8.1f ms (%u blocks)\n", what, n, cols, hd, t * 1e3,
               gather_grid((uint64_t)n * cols, 4));
    };
    auto gemv_bench = [&](uint32_t nt, uint32_t n_out, uint32_t k, int reps) {
        std::vector<uint16_t> w((size_t)n_out * k), rows((size_t)nt * k), kv((size_t)nt * n_out);
        bf16_fill_fast(w, rng());
        bf16_fill_fast(rows, rng());
        uint64_t pw = ptr(w.data()), pr = ptr(rows.data()), pk = ptr(kv.data());
        char name[32];
        snprintf(name, sizeof name, "engram_gemv_bf16_%u", nt);
        const double t = best_of(reps, [&] { launch_named(name, (n_out + 15) / 16, 256, 1, pw, pr, pk, n_out, k); });
        printf("gemv %u tokens %5ux%-5u                          : %8.1f ms (%u blocks, %.2f GB/s of wkv)\n", nt, n_out,
               k, t * 1e3, (n_out + 15) / 16, (double)n_out * k * 2 / t / 1e9);
    };
    auto gate_bench = [&](bool bf16, uint32_t n, uint32_t hc, uint32_t d, int reps) {
        std::vector<float> x((size_t)n * hc * d, 0.5f), qk((size_t)hc * d, 1.0f);
        std::vector<uint16_t> xb(x.size(), 0x3F00), kv((size_t)n * (hc + 1) * d, 0x3F00);
        std::vector<uint32_t> flags((size_t)n * 24, 0);
        uint32_t latch[12] = {0}, mirror[12] = {0};
        uint64_t h = bf16 ? ptr(xb.data()) : ptr(x.data()), kvp = ptr(kv.data()), q = ptr(qk.data());
        uint64_t fl = ptr(flags.data()), lp = ptr(latch), mp = ptr(mirror);
        uint32_t c = 24, uhc = hc, ud = d;
        float eps = 1e-6f, inv = 1.0f / std::sqrt((float)d);
        uint32_t streams = n * hc;
        const char *name = bf16 ? "engram_gate_bf16_bf16" : "engram_gate_f32_bf16";
        const double t = best_of(reps, [&] {
            launch_named(name, gate_grid(streams), 256, 1, h, kvp, q, fl, c, uhc, ud, eps, inv, lp, mp, streams);
        });
        printf("gate %-21s %3u tokens x hc %u x D %4u     : %8.1f ms (%u blocks)\n", name, n, hc, d, t * 1e3,
               gate_grid(streams));
    };
    if (real) {
        printf("-- the real model's sizes (Hd 256, C 24, wkv 25600x6144, D 5120, hc 4)\n");
        gather_bench("fp8 (264-byte rows)", T_FP8, 264, 64, 24, 256, 100000);
        gather_bench("bf16", T_BF16, 512, 64, 24, 256, 100000);
        gemv_bench(8, 25600, 6144, 2);
        gemv_bench(1, 25600, 6144, 2);
        gate_bench(false, 8, 4, 5120, 3);
        gate_bench(true, 8, 4, 5120, 3);
    }
    if (small) {
        printf("-- a test-sized step (the golden tiny model: Hd 64, C 4, D 64, hc 4; 16 tokens)\n");
        gather_bench("bf16", T_BF16, 128, 16, 4, 64, 500);
        gemv_bench(8, 320, 256, 5);
        gate_bench(false, 16, 4, 64, 5);
    }
}

static void race_demo(bool fixed) {
    std::vector<int> out(4);
    int *p = out.data();
    int f = fixed;
    const int rc = launch1(SIMT_ENTRY(k_race), 4, 256, 1, p, f);
    printf("race demo (%s): %s, sums %d %d %d %d (want %d)\n", fixed ? "with the barrier" : "no barrier",
           simt_error_name(rc), out[0], out[1], out[2], out[3], 255 * 128);
}

int main(int argc, char **argv) {
    std::vector<std::string> expect;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--expect") && i + 1 < argc) {
            expect.push_back(argv[++i]);
        } else if (!strncmp(argv[i], "--bench", 7)) {
            bench(argv[i][7] == '=' ? argv[i] + 8 : "all");
            return 0;
        } else if (!strcmp(argv[i], "--race-demo") || !strcmp(argv[i], "--race-demo=fixed")) {
            race_demo(strchr(argv[i], '=') != nullptr);
            return 0;
        } else {
            fprintf(stderr, "usage: %s [--expect NAME]... [--bench[=real|small]] [--race-demo[=fixed]]\n", argv[0]);
            return 2;
        }
    }
    printf("engram SIMT self-test: %u workers, build %s\n", simt_get_workers(), simt_build_info());
    const double t0 = now_s();
    test_registry(expect);
    test_barriers();
    test_errors();
    test_vector_access();
    test_shuffles();
    test_atomics();
    test_nan_rules();
    test_order();
    test_shared_memory();
    test_cooperative();
    test_shared_optin();
    test_gather();
    test_gemv();
    test_gate();
    test_decode();
    test_determinism();
    printf("%d checks, %d failures, %.1f s\n", g_checks, g_failures, now_s() - t0);
    return g_failures ? 1 : 0;
}
