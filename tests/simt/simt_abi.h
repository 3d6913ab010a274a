/* The C ABI of libengram_simt.so: the engram CUDA kernels (the .cu files of
 * kernels/, unmodified) compiled as host C++ with a SIMT shim (simt.h), launched with
 * cuLaunchKernel's conventions. Device pointers are plain host pointers.
 * See tests/simt/README.md. Plain C; every function is thread-safe (launches
 * from several host threads run one at a time). */
#ifndef ENGRAM_SIMT_ABI_H
#define ENGRAM_SIMT_ABI_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define SIMT_API __attribute__((visibility("default")))
#else
#define SIMT_API
#endif

/* Return codes of simt_launch / simt_launch_fn. */
#define SIMT_OK 0
#define SIMT_ERR_UNKNOWN_KERNEL 1 /* no kernel of that name is registered */
#define SIMT_ERR_INVALID_VALUE 2  /* grid/block dims, shared bytes or args out of CUDA's limits */
#define SIMT_ERR_DEADLOCK 3       /* every live thread of a block waits and none can proceed */
#define SIMT_ERR_BARRIER 4        /* __syncthreads* reached at different call sites or variants */
#define SIMT_ERR_WARP 5           /* warp intrinsic misuse (partial mask, inactive source lane, ...) */
#define SIMT_ERR_TRAP 6           /* __trap() in a kernel */
#define SIMT_ERR_RESOURCE 7       /* fiber stacks could not be allocated; or no FMA on this CPU
                                     for a library built with FMAD=1 */
#define SIMT_ERR_NESTED 8         /* simt_launch called from inside a kernel */
#define SIMT_ERR_COOP_TOO_LARGE 9 /* a cooperative launch of more blocks than the emulated device holds
                                     at once (CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE) */

/* Most dynamic shared memory a block can have once its kernel opts in
   (simt_set_max_dynamic_shared): an sm_90's 227 KiB. Without the opt-in, 48 KiB. */
#define SIMT_MAX_SHARED_OPTIN (227u * 1024u)
#define SIMT_DEFAULT_DYNAMIC_SHARED (48u * 1024u)

/* A kernel entry point in the emulation: unpacks cuLaunchKernel-style
 * `args` (an array of pointers to each argument's value) and calls the
 * kernel body for the current emulated thread. */
typedef void (*simt_kernel_fn)(void **args);

/* Launch `kernel_name` (an extern "C" __global__ name, as cuModuleGetFunction
 * takes it) on a grid of blocks and wait for it to finish. `args` follows
 * cuLaunchKernel's kernelParams: args[i] points to the value of parameter i
 * (its size must be the parameter's; simt_kernel_params lists them).
 * `shared_bytes` is the dynamic shared memory (simt_dynamic_shared()); at most
 * 48 KiB. `seed` sets the (reproducible) order in which blocks start and
 * threads of a block are resumed; the environment variable SIMT_SEED, when
 * set, replaces it. Returns SIMT_OK or a SIMT_ERR_* code; simt_last_error()
 * then says what happened. */
SIMT_API int simt_launch(const char *kernel_name, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                         unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                         void **args, unsigned long long seed);

/* As simt_launch, for a kernel entry point compiled elsewhere against simt.h
 * (the self-test's own kernels); `fn` is e.g. SIMT_ENTRY(my_kernel). */
SIMT_API int simt_launch_fn(simt_kernel_fn fn, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                            unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                            void **args, unsigned long long seed);

/* A cooperative launch (cuLaunchCooperativeKernel): as simt_launch, with every
 * block of the grid running at once (each on its own OS thread), so that
 * blocks may wait for each other (a grid-wide barrier). A grid of more blocks
 * than simt_sm_count() * simt_max_active_blocks(block threads, shared_bytes)
 * is refused with SIMT_ERR_COOP_TOO_LARGE, nothing run. A block that waits
 * (spins with __nanosleep or a failed atomicCAS, nothing else of its block
 * able to run) gives the other blocks' OS threads the CPU; it ends the launch
 * with SIMT_ERR_DEADLOCK when another block failed, or when it has waited for
 * simt_set_spin_limit_ms (default 300 s; SIMT_SPIN_LIMIT_MS) without a break. */
SIMT_API int simt_launch_cooperative(const char *kernel_name, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                                     unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                                     void **args, unsigned long long seed);
SIMT_API int simt_launch_fn_cooperative(simt_kernel_fn fn, unsigned grid_x, unsigned grid_y, unsigned grid_z,
                                        unsigned block_x, unsigned block_y, unsigned block_z, unsigned shared_bytes,
                                        void **args, unsigned long long seed);

/* The emulated device's multiprocessors (SIMT_SMS, default 4; 1 .. 1024), and
 * how many blocks of `block_threads` threads and `shared_bytes` of dynamic
 * shared memory (plus 1 KiB each, as the GPU reserves) one of them holds at
 * once, as cuOccupancyMaxActiveBlocksPerMultiprocessor says: at most 2048
 * threads, 32 blocks and 228 KiB of shared memory (an sm_90's); 0 when one
 * block does not fit. Registers are not modelled. */
SIMT_API unsigned simt_sm_count(void);
SIMT_API void simt_set_sm_count(unsigned n); /* 0: back to the default */
SIMT_API unsigned simt_max_active_blocks(unsigned block_threads, unsigned shared_bytes);

/* cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES): the
 * most dynamic shared memory launches of kernel `name` may ask for (default
 * SIMT_DEFAULT_DYNAMIC_SHARED; at most SIMT_MAX_SHARED_OPTIN). SIMT_OK, or
 * SIMT_ERR_UNKNOWN_KERNEL / SIMT_ERR_INVALID_VALUE. simt_set_max_dynamic_shared_fn
 * is the same for an entry point of simt_launch_fn. */
SIMT_API int simt_set_max_dynamic_shared(const char *kernel_name, unsigned bytes);
SIMT_API int simt_set_max_dynamic_shared_fn(simt_kernel_fn fn, unsigned bytes);

/* How long a block of a cooperative launch may wait for other blocks (see
 * simt_launch_cooperative); 0 restores the default. */
SIMT_API void simt_set_spin_limit_ms(unsigned ms);

/* The registered kernels: count, and name i (NULL past the end). */
SIMT_API unsigned simt_kernel_count(void);
SIMT_API const char *simt_kernel_name(unsigned i);

/* Parameter count of kernel `name` (-1 if unknown); the first `max_sizes`
 * parameter sizes in bytes go to `sizes` (which may be NULL). */
SIMT_API int simt_kernel_params(const char *name, unsigned *sizes, unsigned max_sizes);

/* Compare the registry with the kernels compiled into this library (every
 * function the shim's __global__ placed in the ELF section "simt_kernels", read
 * from the library's own symbol table). Returns the number of problems (0: the
 * registry lists exactly those kernels, at their addresses; -1: the symbol table
 * could not be read) and writes a description into buf. */
SIMT_API int simt_check_registry(char *buf, size_t len);

/* The message of the last failed simt_* call on this thread ("" if none). */
SIMT_API const char *simt_last_error(void);
/* The name of a SIMT_* code ("SIMT_ERR_DEADLOCK", ...). */
SIMT_API const char *simt_error_name(int code);

/* The linear index (x fastest, then y, then z) of the i-th block to start, of
 * `total` blocks, under `seed` (honours SIMT_ORDER=linear but not SIMT_SEED:
 * pass the effective seed, simt_effective_seed(seed)). */
SIMT_API unsigned long long simt_block_order(unsigned long long total, unsigned long long seed,
                                             unsigned long long i);
/* The seed a launch given `seed` uses: SIMT_SEED from the environment if set. */
SIMT_API unsigned long long simt_effective_seed(unsigned long long seed);

/* OS threads that run blocks in parallel (each runs whole blocks, one at a
 * time, each block's threads as fibers). 0 restores the default: SIMT_WORKERS
 * from the environment, else the number of CPUs, at most 8. */
SIMT_API void simt_set_workers(unsigned n);
SIMT_API unsigned simt_get_workers(void);

/* Inside a kernel: this block's dynamic shared memory (shared_bytes of the
 * launch, 16-byte aligned, garbage-filled at block start), for kernels
 * compiled outside the library (the self-test's). The library's kernels
 * declare it as CUDA does, `extern __shared__ T name[];` (see README.md). */
SIMT_API void *simt_dynamic_shared(void);

/* How the library was built: a static string, e.g. "fmad=1 sanitize=address,undefined". */
SIMT_API const char *simt_build_info(void);

#ifdef __cplusplus
}
#endif

#endif
