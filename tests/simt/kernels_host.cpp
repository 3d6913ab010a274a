// The engram kernels, unmodified, as host C++: the translation unit the CUDA
// backend hands NVRTC (src/cuda/kernels.rs MODULE_MAIN: gather.cu, gate.cu,
// gemv.cu, hash.cu, gemv_q.cu, decode.cu, in that order; build.sh checks the list against it and against
// kernels/*.cu), preceded by the SIMT shim, followed by the kernel registry.
//
// Built by build.sh in two passes: the first (SIMT_REGISTRY_INC undefined)
// only lists the functions that __global__ put into the section simt_kernels;
// the second includes the registry generated from that list.
#include "simt.h"

// The kernels are compiled with -Wall -Wextra -Werror like the rest. Warnings
// they raise on the host that cannot be fixed without editing them are
// switched off here, around the includes only:
//   -Wunknown-pragmas: `#pragma unroll` is NVRTC's; g++ does not know it (it
//   unrolls on its own at -O2; the pragma changes no result). g++ 12 ignores
//   `#pragma GCC diagnostic` for this warning in C++ (GCC PR 53431, fixed in
//   13), so build.sh also passes -Wno-unknown-pragmas for this file.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunknown-pragmas"
#include "gather.cu"
#include "gate.cu"
#include "gemv.cu"
#include "hash.cu"
#include "gemv_q.cu"
#include "decode.cu"
#pragma GCC diagnostic pop

// The kernels' dynamic shared memory: each `extern __shared__` array they
// declare, defined here as SIMT_MAX_SHARED_OPTIN bytes of thread-local
// storage, whatever its element type (in assembly: a C++ definition would
// have to repeat the type), and its name listed for the runtime (which fills
// a launch's shared_bytes of it with garbage at each block start). build.sh
// writes SIMT_DYNSHARED_INC: one SIMT_DYNAMIC_SHARED(name) line per array.
#define SIMT_STR2(x) #x
#define SIMT_STR(x) SIMT_STR2(x)
#define SIMT_DYNAMIC_SHARED(name)                                                                                \
    __asm__(".section .tbss,\"awT\",@nobits\n\t.globl " #name "\n\t.hidden " #name "\n\t.type " #name       \
            ",@object\n\t.size " #name "," SIMT_STR(SIMT_MAX_SHARED_OPTIN_BYTES) "\n\t.p2align 4\n" #name        \
            ":\n\t.zero " SIMT_STR(SIMT_MAX_SHARED_OPTIN_BYTES) "\n\t.previous\n");
#define SIMT_MAX_SHARED_OPTIN_BYTES 232448
static_assert(SIMT_MAX_SHARED_OPTIN_BYTES == SIMT_MAX_SHARED_OPTIN, "the size of the arrays defined below");
#ifdef SIMT_DYNSHARED_INC
#include SIMT_DYNSHARED_INC
#endif
#undef SIMT_DYNAMIC_SHARED
#define SIMT_DYNAMIC_SHARED(name) #name,
extern "C" const char *const simt_dynamic_shared_names[] = {
#ifdef SIMT_DYNSHARED_INC
#include SIMT_DYNSHARED_INC
#endif
    nullptr};

#define SIMT_REGISTER(k)                                                                                         \
    {#k, SIMT_ENTRY(k), reinterpret_cast<const void *>(&k), simt::Thunk<decltype(&k), &k>::nparams,               \
     simt::Thunk<decltype(&k), &k>::sizes},

extern "C" const simt_registry_entry simt_registry[] = {
#ifdef SIMT_REGISTRY_INC
#include SIMT_REGISTRY_INC
#endif
    {nullptr, nullptr, nullptr, 0, nullptr}};

#if defined(__FMA__) && defined(SIMT_FMAD) && SIMT_FMAD
extern "C" const int simt_kernels_use_fma = 1;
#else
extern "C" const int simt_kernels_use_fma = 0;
#endif

#ifndef SIMT_BUILD_INFO
#define SIMT_BUILD_INFO "unknown"
#endif
extern "C" const char simt_kernels_build_info[] = SIMT_BUILD_INFO;
