// The SIMT runtime: runs a grid of blocks of emulated CUDA threads on the CPU.
//
// - A pool of OS threads ("workers") takes blocks in a seeded pseudo-random
//   order; each worker runs one block at a time, to completion.
// - A block's threads are fibers on its worker (user-level contexts with their
//   own stacks), scheduled cooperatively: a fiber runs until it reaches
//   __syncthreads, a warp intrinsic, a failed atomicCAS or its end, then the
//   next ready fiber runs. Barriers and warp operations release their waiters
//   in a seeded pseudo-random order.
// - __shared__ variables are thread_local statics (simt.h), so every block on a
//   worker gets the same storage; the runtime fills it with seeded garbage at
//   each block start (it finds it in the kernel module's symbol table).
//
// Under ThreadSanitizer this file is compiled without instrumentation: its own
// bookkeeping is serialised by the cooperative scheduling, and it tells TSan
// about fibers and the happens-before edges of barriers (see README.md).
#include "simt_rt.h"

#include <atomic>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#if !defined(__x86_64__) && !defined(SIMT_UCONTEXT)
#define SIMT_UCONTEXT 1
#endif
#if defined(SIMT_UCONTEXT) && SIMT_UCONTEXT
#include <ucontext.h>
#define SIMT_USE_UCONTEXT 1
#else
#define SIMT_USE_UCONTEXT 0
#endif

#if defined(__SANITIZE_ADDRESS__)
#define SIMT_ASAN 1
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#else
#define SIMT_ASAN 0
#endif
#if defined(SIMT_TSAN) && SIMT_TSAN
#include <sanitizer/tsan_interface.h>
#else
#undef SIMT_TSAN
#define SIMT_TSAN 0
#endif

// ---- per-OS-thread state (all TLS of this file is named simt_*: the shared
// memory poisoning leaves such symbols alone) ------------------------------------
extern "C" {
SIMT_API __thread const simt_builtins *simt_tl_builtins = nullptr;
SIMT_API unsigned simt_fence_word = 0;
}
static __thread char simt_tl_err[1024];
static __thread void *simt_tl_worker = nullptr;

static void set_last_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void set_last_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(simt_tl_err, sizeof simt_tl_err, fmt, ap);
    va_end(ap);
}

namespace {

// ---- random numbers ------------------------------------------------------------
inline uint64_t splitmix(uint64_t &s) {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// A seeded permutation of [0, n): a bijection of k-bit words (odd multiply,
// xor-shift, add; four rounds) restricted to [0, n) by cycle walking.
struct Perm {
    uint64_t n = 1, mask = 0;
    unsigned shift = 1, k = 0;
    uint64_t mul[4] = {}, add[4] = {};
    void init(uint64_t total, uint64_t seed) {
        n = total;
        k = n <= 1 ? 0 : 64 - (unsigned)__builtin_clzll(n - 1);
        mask = k >= 64 ? ~0ull : ((1ull << k) - 1);
        shift = k / 2 + 1;
        uint64_t s = seed ^ 0x5DEECE66Dull;
        for (int r = 0; r < 4; r++) {
            mul[r] = splitmix(s) | 1u;
            add[r] = splitmix(s);
        }
    }
    uint64_t f(uint64_t x) const {
        for (int r = 0; r < 4; r++) {
            x = (x * mul[r]) & mask;
            x ^= x >> shift;
            x = (x + add[r]) & mask;
        }
        return x;
    }
    uint64_t operator()(uint64_t i) const {
        if (k == 0) return 0;
        uint64_t x = i;
        do {
            x = f(x);
        } while (x >= n);
        return x;
    }
};

// ---- configuration ---------------------------------------------------------------
bool env_is(const char *name, const char *value) {
    const char *v = getenv(name);
    return v && strcmp(v, value) == 0;
}

uint64_t effective_seed(uint64_t seed) {
    const char *v = getenv("SIMT_SEED");
    if (v && *v) return strtoull(v, nullptr, 0);
    return seed;
}

std::atomic<unsigned> g_workers{0};

unsigned default_workers() {
    const char *v = getenv("SIMT_WORKERS");
    if (v && *v) {
        long n = strtol(v, nullptr, 10);
        if (n >= 1 && n <= 256) return (unsigned)n;
    }
    unsigned hw = std::thread::hardware_concurrency();
    if (hw == 0) hw = 1;
    return hw > 8 ? 8 : hw;
}

// The emulated device's multiprocessors (simt_sm_count).
std::atomic<unsigned> g_sms{0};

unsigned default_sms() {
    const char *v = getenv("SIMT_SMS");
    if (v && *v) {
        long n = strtol(v, nullptr, 10);
        if (n >= 1 && n <= 1024) return (unsigned)n;
    }
    return 4;
}

unsigned sm_count() {
    const unsigned n = g_sms.load();
    return n ? n : default_sms();
}

// An sm_90's limits per multiprocessor (simt_max_active_blocks).
const unsigned SM_THREADS = 2048, SM_BLOCKS = 32, SM_SHARED = 228u * 1024u, BLOCK_RESERVED_SHARED = 1024u;

unsigned max_active_blocks(unsigned threads, unsigned shared) {
    if (threads == 0 || threads > 1024 || shared > SIMT_MAX_SHARED_OPTIN) return 0;
    unsigned n = SM_THREADS / threads;
    if (n > SM_BLOCKS) n = SM_BLOCKS;
    const unsigned by_shared = SM_SHARED / (shared + BLOCK_RESERVED_SHARED);
    return n < by_shared ? n : by_shared;
}

// How long a block of a cooperative launch may wait for others (ms).
std::atomic<unsigned> g_spin_limit_ms{0};

unsigned spin_limit_ms() {
    const unsigned n = g_spin_limit_ms.load();
    if (n) return n;
    const char *v = getenv("SIMT_SPIN_LIMIT_MS");
    if (v && *v) {
        long ms = strtol(v, nullptr, 10);
        if (ms >= 1) return (unsigned)ms;
    }
    return 300000;
}

// Each kernel's most dynamic shared memory (cuFuncSetAttribute), by entry point.
std::mutex &attr_mutex() {
    static std::mutex *m = new std::mutex();
    return *m;
}
std::map<simt_kernel_fn, unsigned> &max_dynamic_shared() {
    static std::map<simt_kernel_fn, unsigned> *m = new std::map<simt_kernel_fn, unsigned>();
    return *m;
}

unsigned max_dynamic_shared_of(simt_kernel_fn fn) {
    std::lock_guard<std::mutex> g(attr_mutex());
    const auto it = max_dynamic_shared().find(fn);
    return it == max_dynamic_shared().end() ? SIMT_DEFAULT_DYNAMIC_SHARED : it->second;
}

double mono_s() {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

size_t stack_bytes() {
    static const size_t b = [] {
        const char *v = getenv("SIMT_STACK_KB");
        long kb = v && *v ? strtol(v, nullptr, 10) : 0;
        if (kb <= 0) kb = SIMT_ASAN ? 512 : 64;
        return (size_t)kb * 1024;
    }();
    return b;
}

// ---- contexts ----------------------------------------------------------------------
struct Ctx {
    void *sp = nullptr;
    const void *stack_lo = nullptr; // for ASan
    size_t stack_size = 0;
    void *tsan = nullptr;
#if SIMT_USE_UCONTEXT
    ucontext_t uc;
#endif
};

} // namespace

#if !SIMT_USE_UCONTEXT
// simt_ctx_switch(save, load): push the callee-saved registers, store the stack
// pointer in *save, switch to `load`, pop, return into the other context.
// MXCSR and the x87 control word are not switched: every fiber of a worker
// runs with the worker's (round to nearest, no FTZ/DAZ; set at its start).
extern "C" void simt_ctx_switch(void **save, void *load);
extern "C" void simt_ctx_trampoline();
__asm__(R"(
    .text
    .p2align 4
    .globl simt_ctx_switch
    .hidden simt_ctx_switch
    .type simt_ctx_switch,@function
simt_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size simt_ctx_switch, .-simt_ctx_switch

    .p2align 4
    .globl simt_ctx_trampoline
    .hidden simt_ctx_trampoline
    .type simt_ctx_trampoline,@function
simt_ctx_trampoline:
    .cfi_startproc
    .cfi_undefined rip
    movq %r12, %rdi
    callq *%r13
    ud2
    .cfi_endproc
    .size simt_ctx_trampoline, .-simt_ctx_trampoline
)");
#endif

namespace {

// The kernel module's __shared__ variables: thread-local symbols (offset and
// size in the module's TLS block) other than the runtime's own (simt_*).
struct ModuleInfo {
    uintptr_t base = 0;
    size_t modid = 0;
    std::vector<std::pair<uint64_t, uint64_t>> shared;
    // `extern __shared__` arrays (simt_dynamic_shared_names): offsets; a
    // launch's shared_bytes of each are poisoned.
    std::vector<uint64_t> dynamic;
};

struct Launch {
    simt_kernel_fn fn = nullptr;
    void **args = nullptr;
    const char *name = "";
    dim3 grid, block;
    unsigned shared_bytes = 0;
    uint64_t seed = 0, total = 0;
    bool linear = false, shuffle = true, poison = true;
    // A cooperative launch: every block at once, blocks may wait for others.
    bool coop = false;
    unsigned spin_limit_ms = 0;
    Perm perm;
    const ModuleInfo *mod = nullptr;
    std::atomic<uint64_t> next{0};
    std::atomic<int> err{0};
    std::mutex mu;
    char msg[1024] = {0};
};

enum FState : int { F_READY, F_RUNNING, F_WAIT_BAR, F_WAIT_WARP, F_DONE };

struct Worker;

struct Fiber {
    simt_builtins b; // first: simt_tl_builtins points here
    Ctx ctx;
    char *map = nullptr; // the mapping: guard page, then the stack
    size_t map_size = 0;
    Worker *w = nullptr;
    unsigned idx = 0, warp = 0, lane = 0;
    int state = F_DONE;
    bool in_kernel = false; // between the start of a thread and its final park: reset on errors
};

struct Warp {
    unsigned exists = 0, exited = 0, arrived = 0;
    int kind = 0, width = 32;
    unsigned mask = 0;
    unsigned gen = 0;
    unsigned long long in[32], out[32];
    int arg[32];
    char tsan_sync[2];
};

struct Launch;

struct Worker {
    std::vector<Fiber *> fibers;
    Ctx sched;
    Launch *L = nullptr;
    // The block being run.
    unsigned n = 0, alive = 0, done = 0;
    uint64_t lin = 0;
    uint3 bid{0, 0, 0};
    // __syncthreads.
    unsigned bar_arrived = 0, bar_acc = 0, bar_gen = 0;
    int bar_kind = 0, bar_result = 0;
    void *bar_site = nullptr;
    std::vector<unsigned> bar_waiters;
    std::vector<Warp> warps;
    std::vector<unsigned> order;
    // Ready fibers (a ring: each fiber is in it at most once).
    unsigned ring[1024];
    unsigned head = 0, count = 0;
    uint64_t rng = 0;
    bool shuffle = true;
    // The first error of this block.
    int err = 0;
    char msg[768];
    unsigned char *dyn = nullptr; // dynamic shared memory, SIMT_MAX_SHARED_OPTIN
    // Lonely waits in a row in a cooperative launch (simt_yield with nothing
    // else of the block ready) and when the run began.
    uint64_t spin_n = 0;
    double spin_t0 = 0;
    const simt_builtins **tl_slot = nullptr; // &simt_tl_builtins of the worker's thread
    char tsan_block_start, tsan_block_done, tsan_bar[2];
};

inline Fiber *cur_fiber() { return reinterpret_cast<Fiber *>(const_cast<simt_builtins *>(simt_tl_builtins)); }
// Through the worker's cached address of its simt_tl_builtins (a global-dynamic
// TLS access costs a call to __tls_get_addr).
inline void set_cur(Worker *w, Fiber *f) { *w->tl_slot = f ? &f->b : nullptr; }

inline void ctx_switch(Ctx *from, Ctx *to) {
#if SIMT_ASAN
    void *fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, to->stack_lo, to->stack_size);
#endif
#if SIMT_TSAN
    __tsan_switch_to_fiber(to->tsan, __tsan_switch_to_fiber_no_sync);
#endif
#if SIMT_USE_UCONTEXT
    swapcontext(&from->uc, &to->uc);
#else
    simt_ctx_switch(&from->sp, to->sp);
#endif
#if SIMT_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

void fiber_main(Fiber *f);

#if SIMT_USE_UCONTEXT
void uc_entry(unsigned lo, unsigned hi) {
    fiber_main(reinterpret_cast<Fiber *>((uintptr_t)lo | ((uintptr_t)hi << 32)));
}
#endif

// Give `f` a fresh context that starts in fiber_main.
void init_context(Fiber *f) {
    char *lo = f->map + getpagesize();
    const size_t size = f->map_size - getpagesize();
    f->ctx.stack_lo = lo;
    f->ctx.stack_size = size;
#if SIMT_ASAN
    __asan_unpoison_memory_region(lo, size);
#endif
#if SIMT_USE_UCONTEXT
    getcontext(&f->ctx.uc);
    f->ctx.uc.uc_stack.ss_sp = lo;
    f->ctx.uc.uc_stack.ss_size = size;
    f->ctx.uc.uc_link = nullptr;
    const uintptr_t p = (uintptr_t)f;
    makecontext(&f->ctx.uc, (void (*)())uc_entry, 2, (unsigned)(p & 0xFFFFFFFFu), (unsigned)(p >> 32));
#else
    // Pops r15 r14 r13 r12 rbx rbp, then returns into the trampoline, which
    // calls r13(r12) with a 16-byte aligned stack.
    uintptr_t top = ((uintptr_t)lo + size) & ~(uintptr_t)15;
    uint64_t *sp = reinterpret_cast<uint64_t *>(top - 72);
    sp[0] = 0;                                                          // r15
    sp[1] = 0;                                                          // r14
    sp[2] = (uint64_t)(uintptr_t)&fiber_main;                           // r13
    sp[3] = (uint64_t)(uintptr_t)f;                                     // r12
    sp[4] = 0;                                                          // rbx
    sp[5] = 0;                                                          // rbp (ends frame chains)
    sp[6] = (uint64_t)(uintptr_t)&simt_ctx_trampoline;                  // return address
    f->ctx.sp = sp;
#endif
    f->in_kernel = false;
}

Fiber *new_fiber(Worker *w, unsigned idx) {
    const size_t page = (size_t)getpagesize();
    const size_t size = (stack_bytes() + page - 1) / page * page + page;
    void *m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK,
                   -1, 0);
    if (m == MAP_FAILED) return nullptr;
    mprotect(m, page, PROT_NONE); // guard page below the stack
    Fiber *f = new Fiber();
    f->map = static_cast<char *>(m);
    f->map_size = size;
    f->w = w;
    f->idx = idx;
#if SIMT_TSAN
    f->ctx.tsan = __tsan_create_fiber(0);
#endif
    init_context(f);
    return f;
}

// ---- the ready ring ---------------------------------------------------------------
inline void push_ready(Worker *w, unsigned i) {
    w->ring[(w->head + w->count) & 1023u] = i;
    w->count++;
    w->fibers[i]->state = F_READY;
}

inline Fiber *pop_ready(Worker *w) {
    if (w->count == 0) return nullptr;
    const unsigned i = w->ring[w->head];
    w->head = (w->head + 1) & 1023u;
    w->count--;
    return w->fibers[i];
}

void shuffle(Worker *w, unsigned *a, unsigned n) {
    if (!w->shuffle) return;
    for (unsigned i = n; i > 1; i--) {
        const unsigned j = (unsigned)(((splitmix(w->rng) >> 32) * i) >> 32); // in [0, i)
        const unsigned t = a[i - 1];
        a[i - 1] = a[j];
        a[j] = t;
    }
}

// Switch away from `self` (which has recorded why it waits, or is done) to the
// next ready fiber, or to the scheduler when none is.
void park(Fiber *self) {
    Worker *w = self->w;
    w->spin_n = 0;
#if SIMT_TSAN
    // For the scheduler (which acquires this at the block's end) only, so that
    // a block abandoned after an error still happens before what follows it.
    __tsan_release(&w->tsan_block_done);
#endif
    Fiber *next = pop_ready(w);
    if (next == self) {
        self->state = F_RUNNING;
        return;
    }
    Ctx *to;
    if (next) {
        next->state = F_RUNNING;
        set_cur(w, next);
        to = &next->ctx;
    } else {
        set_cur(w, nullptr);
        to = &w->sched;
    }
    ctx_switch(&self->ctx, to);
}

// End the block with an error (the first one is kept); never returns.
[[noreturn]] void fail(Fiber *self, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
[[noreturn]] void fail(Fiber *self, int code, const char *fmt, ...) {
    Worker *w = self->w;
    if (!w->err) {
        w->err = code;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(w->msg, sizeof w->msg, fmt, ap);
        va_end(ap);
    }
#if SIMT_TSAN
    __tsan_release(&w->tsan_block_done);
#endif
    set_cur(w, nullptr);
    ctx_switch(&self->ctx, &w->sched);
    abort(); // the scheduler never resumes a failed fiber
}

Fiber *need_fiber(const char *what) {
    Fiber *f = cur_fiber();
    if (!f) {
        fprintf(stderr, "simt: %s called outside a kernel launch\n", what);
        abort();
    }
    return f;
}

// ---- barriers and warps -----------------------------------------------------------------
void release_barrier(Worker *w) {
    switch (w->bar_kind) {
    case SIMT_B_COUNT: w->bar_result = (int)w->bar_acc; break;
    case SIMT_B_AND: w->bar_result = w->bar_acc == w->bar_arrived; break;
    case SIMT_B_OR: w->bar_result = w->bar_acc != 0; break;
    default: w->bar_result = 0; break;
    }
    w->bar_arrived = 0;
    w->bar_gen++;
    shuffle(w, w->bar_waiters.data(), (unsigned)w->bar_waiters.size());
    for (unsigned i : w->bar_waiters) push_ready(w, i);
    w->bar_waiters.clear();
}

const char *warp_kind_name(int k) {
    static const char *const names[] = {"__shfl_sync",   "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
                                        "__ballot_sync", "__any_sync",     "__all_sync",       "__syncwarp"};
    return k >= 0 && k < 8 ? names[k] : "?";
}

void release_warp(Worker *w, Warp &W, Fiber *self) {
    const unsigned arrived = W.arrived;
    const unsigned wd = (unsigned)W.width;
    unsigned lanes[32], nl = 0;
    unsigned long long vote = 0;
    bool any = false, all = true;
    for (unsigned l = 0; l < 32; l++) {
        if (!(arrived >> l & 1u)) continue;
        lanes[nl++] = l;
        if (W.in[l]) {
            vote |= 1ull << l;
            any = true;
        } else {
            all = false;
        }
    }
    for (unsigned q = 0; q < nl; q++) {
        const unsigned l = lanes[q];
        const unsigned a = (unsigned)W.arg[l];
        const unsigned group = l & ~(wd - 1u), pos = l & (wd - 1u);
        unsigned src = l;
        switch (W.kind) {
        case SIMT_W_SHFL_IDX: src = group | (a & (wd - 1u)); break;
        case SIMT_W_SHFL_UP: src = pos >= a ? l - a : l; break;
        case SIMT_W_SHFL_DOWN: src = (unsigned long long)pos + a < wd ? l + a : l; break;
        case SIMT_W_SHFL_XOR:
            src = l ^ (a & 31u);
            if ((src & ~(wd - 1u)) > group) src = l;
            break;
        case SIMT_W_BALLOT: W.out[l] = vote; continue;
        case SIMT_W_ANY: W.out[l] = any; continue;
        case SIMT_W_ALL: W.out[l] = all; continue;
        default: W.out[l] = 0; continue;
        }
        if (src != l && !(arrived >> src & 1u)) {
            fail(self, SIMT_ERR_WARP,
                 "%s: lane %u of warp %u reads lane %u, which is not taking part (it exited, does not exist or is "
                 "not in the mask %#x): an undefined value on the GPU",
                 warp_kind_name(W.kind), l, (unsigned)(&W - w->warps.data()), src, W.mask);
        }
        W.out[l] = W.in[src];
    }
    W.arrived = 0;
    W.gen++;
    shuffle(w, lanes, nl);
    const unsigned base = (unsigned)(&W - w->warps.data()) * 32u;
    for (unsigned q = 0; q < nl; q++) push_ready(w, base + lanes[q]);
}

void thread_exited(Fiber *f) {
    Worker *w = f->w;
    w->alive--;
    w->done++;
    Warp &W = w->warps[f->warp];
    W.exited |= 1u << f->lane;
    if (w->bar_arrived && w->bar_arrived == w->alive) release_barrier(w);
    if (W.arrived && W.arrived == (W.exists & ~W.exited)) release_warp(w, W, f);
}

void fiber_main(Fiber *f) {
#if SIMT_ASAN
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
    for (;;) {
        Worker *w = f->w;
#if SIMT_TSAN
        __tsan_acquire(&w->tsan_block_start);
#endif
        f->in_kernel = true;
        w->L->fn(w->L->args);
        thread_exited(f);
#if SIMT_TSAN
        __tsan_release(&w->tsan_block_done);
#endif
        f->state = F_DONE;
        f->in_kernel = false;
        park(f); // resumed when the fiber is given a thread of another block
    }
}

} // namespace

// ---- ELF symbol tables -----------------------------------------------------------------
namespace {

struct ElfSym {
    std::string name;
    uint64_t value, size;
    unsigned char type, bind;
    uint16_t shndx;
};

struct ElfInfo {
    bool ok = false;
    std::string why;
    std::vector<std::string> sections;
    std::vector<ElfSym> syms;
};

// The symbols of an ELF64 file: .symtab if it has one, else .dynsym.
ElfInfo read_elf(const char *path) {
    ElfInfo e;
    const int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        e.why = std::string("cannot open ") + path;
        return e;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size < (off_t)sizeof(Elf64_Ehdr)) {
        close(fd);
        e.why = std::string("cannot stat ") + path;
        return e;
    }
    const size_t size = (size_t)st.st_size;
    void *m = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (m == MAP_FAILED) {
        e.why = std::string("cannot map ") + path;
        return e;
    }
    const unsigned char *b = static_cast<const unsigned char *>(m);
    auto done = [&](const char *why) {
        munmap(m, size);
        if (why) e.why = std::string(path) + ": " + why;
        return e;
    };
    Elf64_Ehdr eh;
    memcpy(&eh, b, sizeof eh);
    if (memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0 || eh.e_ident[EI_CLASS] != ELFCLASS64) return done("not ELF64");
    if (eh.e_shoff == 0 || eh.e_shentsize != sizeof(Elf64_Shdr) ||
        eh.e_shoff + (uint64_t)eh.e_shnum * sizeof(Elf64_Shdr) > size || eh.e_shstrndx >= eh.e_shnum)
        return done("no usable section headers");
    std::vector<Elf64_Shdr> sh(eh.e_shnum);
    memcpy(sh.data(), b + eh.e_shoff, sh.size() * sizeof(Elf64_Shdr));
    auto str = [&](const Elf64_Shdr &s, uint32_t off) -> std::string {
        if (s.sh_offset + off >= size) return "";
        const char *p = reinterpret_cast<const char *>(b + s.sh_offset + off);
        return std::string(p, strnlen(p, size - s.sh_offset - off));
    };
    for (const Elf64_Shdr &s : sh) e.sections.push_back(str(sh[eh.e_shstrndx], s.sh_name));
    int symtab = -1;
    for (size_t i = 0; i < sh.size(); i++)
        if (sh[i].sh_type == SHT_SYMTAB) symtab = (int)i;
    if (symtab < 0)
        for (size_t i = 0; i < sh.size(); i++)
            if (sh[i].sh_type == SHT_DYNSYM) symtab = (int)i;
    if (symtab < 0) return done("no symbol table");
    const Elf64_Shdr &ss = sh[(size_t)symtab];
    if (ss.sh_link >= sh.size() || ss.sh_offset + ss.sh_size > size || ss.sh_entsize != sizeof(Elf64_Sym))
        return done("bad symbol table");
    const Elf64_Shdr &strs = sh[ss.sh_link];
    for (uint64_t off = 0; off + sizeof(Elf64_Sym) <= ss.sh_size; off += sizeof(Elf64_Sym)) {
        Elf64_Sym y;
        memcpy(&y, b + ss.sh_offset + off, sizeof y);
        e.syms.push_back(
            ElfSym{str(strs, y.st_name), y.st_value, y.st_size, (unsigned char)ELF64_ST_TYPE(y.st_info),
                   (unsigned char)ELF64_ST_BIND(y.st_info), y.st_shndx});
    }
    e.ok = true;
    return done(nullptr);
}

struct FindModule {
    uintptr_t addr;
    bool found = false;
    std::string path;
    uintptr_t base = 0;
    size_t modid = 0;
    uint64_t tls_size = 0;
};

int find_module_cb(struct dl_phdr_info *info, size_t, void *data) {
    FindModule *fm = static_cast<FindModule *>(data);
    bool hit = false;
    uint64_t tls = 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) &p = info->dlpi_phdr[i];
        if (p.p_type == PT_LOAD && fm->addr >= info->dlpi_addr + p.p_vaddr &&
            fm->addr < info->dlpi_addr + p.p_vaddr + p.p_memsz)
            hit = true;
        if (p.p_type == PT_TLS) tls = p.p_memsz;
    }
    if (!hit) return 0;
    fm->found = true;
    fm->path = info->dlpi_name && info->dlpi_name[0] ? info->dlpi_name : "/proc/self/exe";
    fm->base = info->dlpi_addr;
    fm->modid = info->dlpi_tls_modid;
    fm->tls_size = tls;
    return 1;
}

// The module holding `addr` and its __shared__ variables (cached per module).
const ModuleInfo *module_info(const void *addr) {
    static std::mutex mu;
    static std::vector<ModuleInfo *> &cache = *new std::vector<ModuleInfo *>(); // kept to the end
    FindModule fm;
    fm.addr = (uintptr_t)addr;
    dl_iterate_phdr(find_module_cb, &fm);
    if (!fm.found) return nullptr;
    std::lock_guard<std::mutex> g(mu);
    for (ModuleInfo *m : cache)
        if (m->base == fm.base) return m;
    ModuleInfo *m = new ModuleInfo();
    m->base = fm.base;
    m->modid = fm.modid;
    if (fm.modid != 0) {
        const ElfInfo e = read_elf(fm.path.c_str());
        for (const ElfSym &y : e.syms) {
            if (y.type != STT_TLS || y.shndx == SHN_UNDEF || y.size == 0) continue;
            if (y.name.compare(0, 5, "simt_") == 0) continue;
            if (y.value + y.size > fm.tls_size) continue;
            bool dynamic = false;
            for (const char *const *d = simt_dynamic_shared_names; *d; d++) dynamic = dynamic || y.name == *d;
            if (dynamic) {
                if (y.size >= SIMT_MAX_SHARED_OPTIN) m->dynamic.push_back(y.value);
            } else {
                m->shared.emplace_back(y.value, y.size);
            }
        }
    }
    cache.push_back(m);
    return m;
}

} // namespace

extern "C" void *__tls_get_addr(void *);

namespace {

// Fill this block's shared memory (static and dynamic) with seeded garbage.
void poison_shared(Worker *w) {
    const Launch *L = w->L;
    if (!L->poison) return;
    uint64_t s = w->rng ^ 0xA5A5A5A5A5A5A5A5ull;
    auto fill = [&](unsigned char *p, uint64_t n) {
        for (uint64_t i = 0; i < n; i += 8) {
            const uint64_t r = splitmix(s);
            memcpy(p + i, &r, n - i < 8 ? n - i : 8);
        }
    };
    if (L->mod && L->mod->modid && (!L->mod->shared.empty() || !L->mod->dynamic.empty())) {
        struct {
            unsigned long modid, offset;
        } ti = {L->mod->modid, 0};
        unsigned char *base = static_cast<unsigned char *>(__tls_get_addr(&ti));
        for (const auto &v : L->mod->shared) fill(base + v.first, v.second);
        for (const uint64_t off : L->mod->dynamic) fill(base + off, L->shared_bytes);
    }
    if (L->shared_bytes) fill(w->dyn, L->shared_bytes);
}

void describe_deadlock(Worker *w) {
    unsigned at_bar = 0, at_warp = 0;
    std::string warps;
    for (unsigned i = 0; i < w->n; i++) {
        const int st = w->fibers[i]->state;
        at_bar += st == F_WAIT_BAR;
        at_warp += st == F_WAIT_WARP;
    }
    for (size_t k = 0; k < w->warps.size() && warps.size() < 300; k++) {
        const Warp &W = w->warps[k];
        if (!W.arrived) continue;
        char b[160];
        snprintf(b, sizeof b, " warp %zu: lanes %#x at %s(mask %#x), live lanes %#x;", k, W.arrived,
                 warp_kind_name(W.kind), W.mask, W.exists & ~W.exited);
        warps += b;
    }
    snprintf(w->msg, sizeof w->msg,
             "deadlock: %u of %u threads wait at __syncthreads, %u at warp operations, %u exited;%s "
             "(a barrier or warp operation that some live threads never reach)",
             at_bar, w->n, at_warp, w->done, warps.c_str());
    w->err = SIMT_ERR_DEADLOCK;
}

bool run_block(Worker *w, uint64_t lin) {
    Launch *L = w->L;
    const unsigned bx = L->block.x, by = L->block.y;
    const unsigned n = L->block.x * L->block.y * L->block.z;
    while (w->fibers.size() < n) {
        Fiber *f = new_fiber(w, (unsigned)w->fibers.size());
        if (!f) {
            w->err = SIMT_ERR_RESOURCE;
            snprintf(w->msg, sizeof w->msg, "cannot map a fiber stack of %zu bytes", stack_bytes());
            return false;
        }
        w->fibers.push_back(f);
    }
    w->n = n;
    w->alive = n;
    w->done = 0;
    w->bar_arrived = 0;
    w->bar_acc = 0;
    w->bar_waiters.clear();
    w->bar_waiters.reserve(n);
    w->err = 0;
    w->msg[0] = 0;
    w->head = 0;
    w->count = 0;
    w->lin = lin;
    const unsigned nw = (n + 31) / 32;
    w->warps.resize(nw);
    for (unsigned k = 0; k < nw; k++) {
        Warp &W = w->warps[k];
        W.exists = (k == nw - 1 && n % 32) ? ((1u << (n % 32)) - 1u) : 0xFFFFFFFFu;
        W.exited = 0;
        W.arrived = 0;
    }
    const uint64_t gx = L->grid.x, gy = L->grid.y;
    w->bid = uint3{(unsigned)(lin % gx), (unsigned)(lin / gx % gy), (unsigned)(lin / (gx * gy))};
    uint64_t s = L->seed ^ (lin * 0xD1B54A32D192ED03ull);
    w->rng = splitmix(s);
    w->shuffle = L->shuffle;
    std::vector<unsigned> &order = w->order;
    order.resize(n);
    for (unsigned i = 0; i < n; i++) {
        Fiber *f = w->fibers[i];
        f->b.tid = uint3{i % bx, i / bx % by, i / (bx * by)};
        f->b.bid = w->bid;
        f->b.bdim = L->block;
        f->b.gdim = L->grid;
        f->warp = i / 32;
        f->lane = i % 32;
        order[i] = i;
    }
    shuffle(w, order.data(), n);
    for (unsigned i = 0; i < n; i++) push_ready(w, order[i]);
    poison_shared(w);
#if SIMT_TSAN
    __tsan_release(&w->tsan_block_start);
#endif
    while (Fiber *f = pop_ready(w)) {
        f->state = F_RUNNING;
        set_cur(w, f);
        ctx_switch(&w->sched, &f->ctx);
        if (w->err) break;
    }
    set_cur(w, nullptr);
    if (!w->err && w->done != n) describe_deadlock(w);
#if SIMT_TSAN
    __tsan_acquire(&w->tsan_block_done);
#endif
    if (!w->err) return true;
    // Threads stopped inside the kernel get fresh contexts (their frames are
    // dropped: no destructors run).
    for (unsigned i = 0; i < n; i++) {
        Fiber *f = w->fibers[i];
        if (f->in_kernel) init_context(f);
        f->state = F_DONE;
    }
    w->head = w->count = 0;
    return false;
}

void work(Worker *w, Launch *L) {
    w->L = L;
    for (;;) {
        if (L->err.load(std::memory_order_relaxed)) break;
        const uint64_t i = L->next.fetch_add(1, std::memory_order_relaxed);
        if (i >= L->total) break;
        const uint64_t lin = L->linear ? i : L->perm(i);
        if (!run_block(w, lin)) {
            std::lock_guard<std::mutex> g(L->mu);
            if (!L->err.load()) {
                snprintf(L->msg, sizeof L->msg, "kernel %s, block (%u,%u,%u): %s", L->name, w->bid.x, w->bid.y,
                         w->bid.z, w->msg);
                L->err.store(w->err);
            }
            break;
        }
    }
    w->L = nullptr;
}

void set_fp_env() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_ldmxcsr(0x1F80); // round to nearest, no FTZ/DAZ, exceptions masked
    unsigned short cw = 0x037F;
    __asm__ volatile("fldcw %0" : : "m"(cw));
#endif
}

struct Pool {
    std::mutex mu;
    std::condition_variable go, finished_cv;
    unsigned nthreads = 0, want = 0, finished = 0;
    uint64_t gen = 0;
    Launch *L = nullptr;

    void ensure(unsigned n) {
        std::lock_guard<std::mutex> g(mu);
        while (nthreads < n) {
            std::thread(&Pool::loop, this, nthreads, gen).detach();
            nthreads++;
        }
    }

    void loop(unsigned idx, uint64_t seen) {
        set_fp_env();
        Worker *w = new Worker();
        simt_tl_worker = w;
        w->tl_slot = &simt_tl_builtins;
        w->dyn = static_cast<unsigned char *>(aligned_alloc(64, SIMT_MAX_SHARED_OPTIN));
#if SIMT_ASAN
        pthread_attr_t attr;
        if (pthread_getattr_np(pthread_self(), &attr) == 0) {
            void *a = nullptr;
            size_t sz = 0;
            pthread_attr_getstack(&attr, &a, &sz);
            w->sched.stack_lo = a;
            w->sched.stack_size = sz;
            pthread_attr_destroy(&attr);
        }
#endif
#if SIMT_TSAN
        w->sched.tsan = __tsan_get_current_fiber();
#endif
        for (;;) {
            Launch *l;
            {
                std::unique_lock<std::mutex> lk(mu);
                go.wait(lk, [&] { return gen != seen; });
                seen = gen;
                if (idx >= want) continue;
                l = L;
            }
            work(w, l);
            std::lock_guard<std::mutex> g(mu);
            if (++finished == want) finished_cv.notify_all();
        }
    }

    void run(Launch *l, unsigned n) {
        ensure(n);
        std::unique_lock<std::mutex> lk(mu);
        L = l;
        want = n;
        finished = 0;
        gen++;
        go.notify_all();
        finished_cv.wait(lk, [&] { return finished == want; });
        L = nullptr;
    }
};

Pool &pool() {
    static Pool *p = new Pool(); // never destroyed: its threads wait for work until exit
    return *p;
}

std::mutex &launch_mutex() {
    static std::mutex *m = new std::mutex();
    return *m;
}

int launch(simt_kernel_fn fn, const char *name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
           unsigned bz, unsigned shared_bytes, void **args, unsigned long long seed, bool coop) {
    simt_tl_err[0] = 0;
    if (simt_tl_worker || simt_tl_builtins) {
        set_last_error("simt_launch called from inside a kernel (no dynamic parallelism)");
        return SIMT_ERR_NESTED;
    }
    if (gx < 1 || gx > 0x7FFFFFFFu || gy < 1 || gy > 65535 || gz < 1 || gz > 65535) {
        set_last_error("%s: grid (%u,%u,%u) outside CUDA's limits ([1, 2^31-1] x [1, 65535] x [1, 65535])", name,
                       gx, gy, gz);
        return SIMT_ERR_INVALID_VALUE;
    }
    if (bx < 1 || bx > 1024 || by < 1 || by > 1024 || bz < 1 || bz > 64 || (uint64_t)bx * by * bz > 1024) {
        set_last_error("%s: block (%u,%u,%u) outside CUDA's limits (x, y <= 1024, z <= 64, 1024 threads)", name, bx,
                       by, bz);
        return SIMT_ERR_INVALID_VALUE;
    }
    const unsigned max_dyn = max_dynamic_shared_of(fn);
    if (shared_bytes > max_dyn) {
        set_last_error("%s: %u bytes of dynamic shared memory, the kernel's limit is %u (%s)", name, shared_bytes,
                       max_dyn,
                       max_dyn == SIMT_DEFAULT_DYNAMIC_SHARED
                           ? "48 KiB without an opt-in: simt_set_max_dynamic_shared, as cuFuncSetAttribute"
                           : "simt_set_max_dynamic_shared");
        return SIMT_ERR_INVALID_VALUE;
    }
    const uint64_t total_blocks = (uint64_t)gx * gy * gz;
    if (coop) {
        const uint64_t fit = (uint64_t)sm_count() * max_active_blocks(bx * by * bz, shared_bytes);
        if (total_blocks > fit) {
            set_last_error("%s: a cooperative launch of %llu blocks; the emulated device holds %llu such blocks at "
                           "once (%u SMs x %u)",
                           name, (unsigned long long)total_blocks, (unsigned long long)fit, sm_count(),
                           max_active_blocks(bx * by * bz, shared_bytes));
            return SIMT_ERR_COOP_TOO_LARGE;
        }
    }
#if defined(__x86_64__)
    if (simt_kernels_use_fma && !__builtin_cpu_supports("fma")) {
        set_last_error("the kernels were built with FMAD=1 (FMA instructions) and this CPU has no FMA: rebuild "
                       "with FMAD=0");
        return SIMT_ERR_RESOURCE;
    }
#endif
    Launch L;
    L.fn = fn;
    L.args = args;
    L.name = name;
    L.grid = dim3(gx, gy, gz);
    L.block = dim3(bx, by, bz);
    L.shared_bytes = shared_bytes;
    L.seed = effective_seed(seed);
    L.total = (uint64_t)gx * gy * gz;
    L.linear = env_is("SIMT_ORDER", "linear");
    L.shuffle = !env_is("SIMT_THREAD_ORDER", "linear");
    L.poison = !env_is("SIMT_POISON", "0");
    L.perm.init(L.total, L.seed);
    L.mod = module_info(reinterpret_cast<const void *>(fn));
    L.coop = coop;
    L.spin_limit_ms = spin_limit_ms();
    std::lock_guard<std::mutex> g(launch_mutex());
    unsigned nw = g_workers.load();
    if (nw == 0) nw = default_workers();
    // A cooperative grid runs all at once: a worker (OS thread) per block. A
    // worker runs its block to the end before it takes another, so with as
    // many workers as blocks, a block that waits for others never keeps one
    // from starting.
    if (coop) nw = (unsigned)total_blocks;
    if (nw > L.total) nw = (unsigned)L.total;
    pool().run(&L, nw);
    if (const int e = L.err.load()) {
        set_last_error("%s", L.msg);
        return e;
    }
    return SIMT_OK;
}

const simt_registry_entry *find_kernel(const char *name) {
    if (!name) return nullptr;
    for (const simt_registry_entry *e = simt_registry; e->name; e++)
        if (strcmp(e->name, name) == 0) return e;
    return nullptr;
}

} // namespace

// ---- the C ABI ------------------------------------------------------------------------
extern "C" {

SIMT_API int simt_launch(const char *kernel_name, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                         unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes, void **args,
                         unsigned long long seed) {
    const simt_registry_entry *e = find_kernel(kernel_name);
    if (!e) {
        set_last_error("no kernel named %s%s%s (simt_kernel_name lists them)", kernel_name ? "\"" : "",
                       kernel_name ? kernel_name : "NULL", kernel_name ? "\"" : "");
        return SIMT_ERR_UNKNOWN_KERNEL;
    }
    if (e->nparams > 0 && !args) {
        set_last_error("%s takes %u parameters and args is NULL", e->name, e->nparams);
        return SIMT_ERR_INVALID_VALUE;
    }
    for (unsigned i = 0; i < e->nparams; i++) {
        if (!args[i]) {
            set_last_error("%s: args[%u] is NULL (it must point to the parameter's value)", e->name, i);
            return SIMT_ERR_INVALID_VALUE;
        }
    }
    return launch(e->fn, e->name, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes, args, seed, false);
}

SIMT_API int simt_launch_fn(simt_kernel_fn fn, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                            unsigned block_y, unsigned block_z, unsigned shared_bytes, void **args,
                            unsigned long long seed) {
    if (!fn) {
        set_last_error("simt_launch_fn: no entry point");
        return SIMT_ERR_UNKNOWN_KERNEL;
    }
    return launch(fn, "(entry point)", grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes, args, seed,
                  false);
}

SIMT_API int simt_launch_cooperative(const char *kernel_name, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                                     unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                                     void **args, unsigned long long seed) {
    const simt_registry_entry *e = find_kernel(kernel_name);
    if (!e) {
        set_last_error("no kernel named %s%s%s (simt_kernel_name lists them)", kernel_name ? "\"" : "",
                       kernel_name ? kernel_name : "NULL", kernel_name ? "\"" : "");
        return SIMT_ERR_UNKNOWN_KERNEL;
    }
    for (unsigned i = 0; i < e->nparams; i++) {
        if (!args || !args[i]) {
            set_last_error("%s: args[%u] is NULL (it must point to the parameter's value)", e->name, i);
            return SIMT_ERR_INVALID_VALUE;
        }
    }
    return launch(e->fn, e->name, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes, args, seed, true);
}

SIMT_API int simt_launch_fn_cooperative(simt_kernel_fn fn, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                                        unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                                        void **args, unsigned long long seed) {
    if (!fn) {
        set_last_error("simt_launch_fn_cooperative: no entry point");
        return SIMT_ERR_UNKNOWN_KERNEL;
    }
    return launch(fn, "(entry point)", grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes, args, seed,
                  true);
}

SIMT_API unsigned simt_sm_count(void) { return sm_count(); }

SIMT_API void simt_set_sm_count(unsigned n) { g_sms.store(n > 1024 ? 1024 : n); }

SIMT_API unsigned simt_max_active_blocks(unsigned block_threads, unsigned shared_bytes) {
    return max_active_blocks(block_threads, shared_bytes);
}

SIMT_API int simt_set_max_dynamic_shared_fn(simt_kernel_fn fn, unsigned bytes) {
    if (!fn) {
        set_last_error("simt_set_max_dynamic_shared_fn: no entry point");
        return SIMT_ERR_UNKNOWN_KERNEL;
    }
    if (bytes > SIMT_MAX_SHARED_OPTIN) {
        set_last_error("%u bytes of dynamic shared memory: at most %u (an sm_90's opt-in)", bytes,
                       SIMT_MAX_SHARED_OPTIN);
        return SIMT_ERR_INVALID_VALUE;
    }
    std::lock_guard<std::mutex> g(attr_mutex());
    max_dynamic_shared()[fn] = bytes;
    return SIMT_OK;
}

SIMT_API int simt_set_max_dynamic_shared(const char *kernel_name, unsigned bytes) {
    const simt_registry_entry *e = find_kernel(kernel_name);
    if (!e) {
        set_last_error("no kernel named %s", kernel_name ? kernel_name : "NULL");
        return SIMT_ERR_UNKNOWN_KERNEL;
    }
    return simt_set_max_dynamic_shared_fn(e->fn, bytes);
}

SIMT_API void simt_set_spin_limit_ms(unsigned ms) { g_spin_limit_ms.store(ms); }

SIMT_API unsigned simt_kernel_count(void) {
    unsigned n = 0;
    while (simt_registry[n].name) n++;
    return n;
}

SIMT_API const char *simt_kernel_name(unsigned i) { return i < simt_kernel_count() ? simt_registry[i].name : nullptr; }

SIMT_API int simt_kernel_params(const char *name, unsigned *sizes, unsigned max_sizes) {
    const simt_registry_entry *e = find_kernel(name);
    if (!e) return -1;
    for (unsigned i = 0; sizes && i < e->nparams && i < max_sizes; i++) sizes[i] = e->sizes[i];
    return (int)e->nparams;
}

SIMT_API int simt_check_registry(char *buf, size_t len) {
    std::string out;
    int problems = 0;
    auto note = [&](const std::string &s) {
        problems++;
        out += s;
        out += '\n';
    };
    Dl_info di;
    if (!dladdr(reinterpret_cast<void *>(&simt_check_registry), &di) || !di.dli_fname) {
        if (buf && len) snprintf(buf, len, "dladdr failed");
        return -1;
    }
    const ElfInfo e = read_elf(di.dli_fname);
    if (!e.ok) {
        if (buf && len) snprintf(buf, len, "%s", e.why.c_str());
        return -1;
    }
    size_t sec = 0;
    for (size_t i = 0; i < e.sections.size(); i++)
        if (e.sections[i] == "simt_kernels") sec = i;
    std::vector<const ElfSym *> kernels;
    for (const ElfSym &y : e.syms)
        if (sec && y.shndx == sec && y.type == STT_FUNC && y.name.find('.') == std::string::npos)
            kernels.push_back(&y);
    if (!sec) note("the library has no section simt_kernels: no kernel was compiled with simt.h's __global__");
    for (const ElfSym *k : kernels) {
        if (k->name.compare(0, 2, "_Z") == 0) {
            note("kernel " + k->name + " is not extern \"C\" (the CUDA backend looks kernels up by plain name)");
            continue;
        }
        const simt_registry_entry *r = find_kernel(k->name.c_str());
        if (!r) {
            note("kernel " + k->name + " (in the sources) has no registry entry");
        } else if ((uintptr_t)r->addr != (uintptr_t)di.dli_fbase + k->value) {
            note("registry entry " + k->name + " does not point at the kernel of that name");
        }
    }
    for (const simt_registry_entry *r = simt_registry; r->name; r++) {
        bool found = false;
        for (const ElfSym *k : kernels) found = found || k->name == r->name;
        if (!found) note(std::string("registry entry ") + r->name + " is not a __global__ function of the sources");
        for (const simt_registry_entry *q = simt_registry; q != r; q++)
            if (strcmp(q->name, r->name) == 0) note(std::string("registry entry ") + r->name + " is listed twice");
    }
    char head[128];
    snprintf(head, sizeof head, "%zu kernels in section simt_kernels, %u registered, %d problems\n", kernels.size(),
             simt_kernel_count(), problems);
    out = head + out;
    if (buf && len) snprintf(buf, len, "%s", out.c_str());
    return problems;
}

SIMT_API const char *simt_last_error(void) { return simt_tl_err; }

SIMT_API const char *simt_error_name(int code) {
    switch (code) {
    case SIMT_OK: return "SIMT_OK";
    case SIMT_ERR_UNKNOWN_KERNEL: return "SIMT_ERR_UNKNOWN_KERNEL";
    case SIMT_ERR_INVALID_VALUE: return "SIMT_ERR_INVALID_VALUE";
    case SIMT_ERR_DEADLOCK: return "SIMT_ERR_DEADLOCK";
    case SIMT_ERR_BARRIER: return "SIMT_ERR_BARRIER";
    case SIMT_ERR_WARP: return "SIMT_ERR_WARP";
    case SIMT_ERR_TRAP: return "SIMT_ERR_TRAP";
    case SIMT_ERR_RESOURCE: return "SIMT_ERR_RESOURCE";
    case SIMT_ERR_NESTED: return "SIMT_ERR_NESTED";
    case SIMT_ERR_COOP_TOO_LARGE: return "SIMT_ERR_COOP_TOO_LARGE";
    default: return "SIMT_ERR_?";
    }
}

SIMT_API unsigned long long simt_block_order(unsigned long long total, unsigned long long seed, unsigned long long i) {
    if (total == 0 || i >= total) return 0;
    if (env_is("SIMT_ORDER", "linear")) return i;
    Perm p;
    p.init(total, seed);
    return p(i);
}

SIMT_API unsigned long long simt_effective_seed(unsigned long long seed) { return effective_seed(seed); }

SIMT_API void simt_set_workers(unsigned n) { g_workers.store(n > 256 ? 256 : n); }

SIMT_API unsigned simt_get_workers(void) {
    const unsigned n = g_workers.load();
    return n ? n : default_workers();
}

SIMT_API void *simt_dynamic_shared(void) {
    Fiber *f = need_fiber("simt_dynamic_shared");
    return f->w->dyn;
}

SIMT_API const char *simt_build_info(void) { return simt_kernels_build_info; }

// ---- hooks called by kernel code (simt.h) ---------------------------------------------------
SIMT_API int simt_block_sync(int kind, int pred) {
    void *site = __builtin_return_address(0);
    Fiber *f = need_fiber("__syncthreads");
    Worker *w = f->w;
    if (w->bar_arrived == 0) {
        w->bar_site = site;
        w->bar_kind = kind;
        w->bar_acc = 0;
    } else if (site != w->bar_site || kind != w->bar_kind) {
        fail(f, SIMT_ERR_BARRIER,
             "thread (%u,%u,%u) reached a __syncthreads variant at %p while %u threads wait at %p: "
             "undefined on the GPU (a barrier in divergent code)",
             f->b.tid.x, f->b.tid.y, f->b.tid.z, site, w->bar_arrived, w->bar_site);
    }
    w->bar_acc += pred != 0;
    w->bar_arrived++;
    w->bar_waiters.push_back(f->idx);
    f->state = F_WAIT_BAR;
    const unsigned gen = w->bar_gen;
#if SIMT_TSAN
    __tsan_release(&w->tsan_bar[gen & 1]);
#endif
    if (w->bar_arrived == w->alive) release_barrier(w);
    park(f);
#if SIMT_TSAN
    __tsan_acquire(&w->tsan_bar[gen & 1]);
#else
    (void)gen;
#endif
    return w->bar_result;
}

SIMT_API unsigned long long simt_warp_op(int kind, unsigned mask, unsigned long long value, int arg, int width) {
    Fiber *f = need_fiber("a warp intrinsic");
    Worker *w = f->w;
    Warp &W = w->warps[f->warp];
    const unsigned bit = 1u << f->lane;
    if (width < 1 || width > 32 || (width & (width - 1)) != 0)
        fail(f, SIMT_ERR_WARP, "%s: width %d is not a power of two in [1, 32]", warp_kind_name(kind), width);
    if (!(mask & bit))
        fail(f, SIMT_ERR_WARP, "%s: lane %u of warp %u is not in its own mask %#x", warp_kind_name(kind), f->lane,
             f->warp, mask);
    const unsigned live = W.exists & ~W.exited;
    if ((mask & live) != live)
        fail(f, SIMT_ERR_WARP,
             "%s with mask %#x while lanes %#x of warp %u are live: partial-warp masks are not modelled",
             warp_kind_name(kind), mask, live, f->warp);
    if (W.arrived == 0) {
        W.kind = kind;
        W.mask = mask;
        W.width = width;
    } else if (W.kind != kind || W.mask != mask || W.width != width) {
        fail(f, SIMT_ERR_WARP, "lane %u of warp %u called %s(mask %#x, width %d) while lanes %#x wait in %s(mask %#x, "
             "width %d)", f->lane, f->warp, warp_kind_name(kind), mask, width, W.arrived, warp_kind_name(W.kind),
             W.mask, W.width);
    }
    W.in[f->lane] = value;
    W.arg[f->lane] = arg;
    W.arrived |= bit;
    f->state = F_WAIT_WARP;
    const unsigned gen = W.gen;
#if SIMT_TSAN
    if (kind == SIMT_W_SYNCWARP) __tsan_release(&W.tsan_sync[gen & 1]);
#endif
    if (W.arrived == live) release_warp(w, W, f);
    park(f);
#if SIMT_TSAN
    if (kind == SIMT_W_SYNCWARP) __tsan_acquire(&W.tsan_sync[gen & 1]);
#else
    (void)gen;
#endif
    return W.out[f->lane];
}

SIMT_API unsigned simt_active_mask(void) {
    Fiber *f = need_fiber("__activemask");
    const Warp &W = f->w->warps[f->warp];
    return W.exists & ~W.exited;
}

SIMT_API void simt_yield(void) {
    Fiber *f = cur_fiber();
    if (!f) return;
    Worker *w = f->w;
    if (w->count == 0) {
        // Nothing else of the block can run. In a cooperative launch the
        // thread waits for another block: let the other workers run, and end
        // the wait when a block failed or when it lasts too long.
        const Launch *L = w->L;
        if (!L->coop) return;
        if (L->err.load(std::memory_order_relaxed))
            fail(f, SIMT_ERR_DEADLOCK, "thread (%u,%u,%u) waits for other blocks and another block failed",
                 f->b.tid.x, f->b.tid.y, f->b.tid.z);
        if (w->spin_n++ == 0) {
            w->spin_t0 = mono_s();
        } else if (w->spin_n % 256 == 0 && (mono_s() - w->spin_t0) * 1e3 > (double)L->spin_limit_ms) {
            fail(f, SIMT_ERR_DEADLOCK,
                 "thread (%u,%u,%u) waited %u ms for other blocks (nothing else of its block could run): a grid "
                 "barrier some block never reaches?",
                 f->b.tid.x, f->b.tid.y, f->b.tid.z, L->spin_limit_ms);
        }
        sched_yield();
        return;
    }
    push_ready(w, f->idx);
    park(f);
}

SIMT_API void simt_trap(const char *what) {
    Fiber *f = cur_fiber();
    if (!f) {
        fprintf(stderr, "simt: %s outside a kernel launch\n", what);
        abort();
    }
    fail(f, SIMT_ERR_TRAP, "thread (%u,%u,%u): %s", f->b.tid.x, f->b.tid.y, f->b.tid.z, what);
}

} // extern "C"
