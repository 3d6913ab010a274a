/*
 * The CUDA backend's error paths that need no GPU, through the C ABI:
 *   - engram_create with ENGRAM_BACKEND_CUDA on a machine without the driver
 *     (libcuda.so.1 not loadable) returns ENGRAM_STATUS_ERR_DEVICE with a
 *     message, leaves *out untouched, and does not crash; with a driver it
 *     either succeeds or says why not (ERR_DEVICE: no device, no NVRTC, ...);
 *   - a device ordinal that does not exist is ERR_DEVICE;
 *   - a bad configuration is still ERR_INVALID_CONFIG (checked first);
 *   - on a CPU context, engram_apply_device_ids is ERR_UNSUPPORTED and
 *     engram_check is OK; NULL contexts are ERR_NULL_ARGUMENT.
 * The GPU itself is tested by c_tests/cuda/test_cuda_apply.c (scripts/gpu-check.sh).
 */
#include "engram.h"

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"

static const uint32_t g_layers[1] = {10};
static int32_t g_token_map[16];
static const uint64_t g_mult[3] = {UINT64_C(0x1f3a5c7e9b2d4f61), UINT64_C(0x0123456789abcdef),
                                   UINT64_C(0x7edcba9876543211)};
static const uint64_t g_primes[4] = {11, 13, 17, 19};
static const uint64_t g_offsets[4] = {0, 11, 24, 41};

static engram_config config(uint32_t backend) {
    engram_config c;
    engram_config_init(&c);
    c.backend = backend;
    c.device = 0;
    c.hidden_size = 8;
    c.hc = 2;
    c.head_dim = 32;
    c.n_heads = 2;
    c.max_ngram = 3;
    c.layer_ids = g_layers;
    c.n_layers = 1;
    c.token_map = g_token_map;
    c.token_map_len = 16;
    c.pad_id = 0;
    c.multipliers = g_mult;
    c.n_multipliers = 3;
    c.primes = g_primes;
    c.n_primes = 4;
    c.offsets = g_offsets;
    c.n_offsets = 4;
    c.max_tokens = 4;
    c.max_seqs = 1;
    c.max_positions = 16;
    return c;
}

static int has_message(void) {
    const char *m = engram_last_error();
    return m != NULL && m[0] != '\0';
}

int main(void) {
    for (int i = 0; i < 16; i++) g_token_map[i] = i % 7;
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    const int driver = drv != NULL;
    if (drv) dlclose(drv);
    printf("# libcuda.so.1 %s\n", driver ? "loads: the CUDA backend may work here" : "is absent: no driver");

    engram_context *sentinel = (engram_context *)(uintptr_t)0x1234;

    /* CUDA backend, device 0. */
    {
        engram_config c = config(ENGRAM_BACKEND_CUDA);
        engram_context *ctx = sentinel;
        int st = (int)engram_create(&c, &ctx);
        if (!driver) {
            check(st == ENGRAM_STATUS_ERR_DEVICE, "create CUDA without a driver: ERR_DEVICE (got %d)", st);
            check(has_message(), "create CUDA without a driver: a message (%s)", engram_last_error());
            check(strstr(engram_last_error(), "libcuda") != NULL, "the message names libcuda");
            check(ctx == sentinel, "create CUDA without a driver: *out untouched");
        } else if (st == ENGRAM_STATUS_OK) {
            check(ctx != sentinel && ctx != NULL, "create CUDA with a driver: a context");
            check(engram_check(ctx, NULL) == ENGRAM_STATUS_OK, "engram_check on a fresh CUDA context");
            int64_t ids[4] = {0, 11, 24, 41};
            int st2 = (int)engram_apply(ctx, 10, ids, 1, NULL, ENGRAM_TYPE_F32, NULL);
            check(st2 == ENGRAM_STATUS_ERR_NO_WEIGHTS || st2 == ENGRAM_STATUS_ERR_NULL_ARGUMENT,
                  "apply before set_layer on CUDA: an error (%d: %s)", st2, engram_last_error());
            engram_free(ctx);
        } else {
            check(st == ENGRAM_STATUS_ERR_DEVICE, "create CUDA with a driver: OK or ERR_DEVICE (got %d)", st);
            check(has_message(), "create CUDA with a driver, failed: a message (%s)", engram_last_error());
            check(ctx == sentinel, "failed create: *out untouched");
        }
    }
    /* Device ordinals that do not exist. */
    {
        const int32_t bad[3] = {-1, 1000, INT32_MAX};
        for (int i = 0; i < 3; i++) {
            engram_config c = config(ENGRAM_BACKEND_CUDA);
            c.device = bad[i];
            engram_context *ctx = sentinel;
            int st = (int)engram_create(&c, &ctx);
            check(st == ENGRAM_STATUS_ERR_DEVICE && has_message() && ctx == sentinel,
                  "create CUDA on device %d: ERR_DEVICE with a message (got %d: %s)", (int)bad[i], st,
                  engram_last_error());
        }
    }
    /* A bad configuration is reported as such, before the device is looked at. */
    {
        engram_config c = config(ENGRAM_BACKEND_CUDA);
        c.hidden_size = 0;
        engram_context *ctx = sentinel;
        int st = (int)engram_create(&c, &ctx);
        check(st == ENGRAM_STATUS_ERR_INVALID_CONFIG && ctx == sentinel,
              "create CUDA with D = 0: ERR_INVALID_CONFIG (got %d)", st);
    }
    /* The CUDA-only calls on a CPU context, and NULL contexts. */
    {
        engram_config c = config(ENGRAM_BACKEND_CPU);
        engram_context *ctx = NULL;
        int st = (int)engram_create(&c, &ctx);
        check(st == ENGRAM_STATUS_OK, "create CPU");
        if (st == ENGRAM_STATUS_OK) {
            int64_t ids[4] = {0, 11, 24, 41};
            float hw[16] = {0};
            st = (int)engram_apply_device_ids(ctx, 10, ids, 1, hw, ENGRAM_TYPE_F32, NULL);
            check(st == ENGRAM_STATUS_ERR_UNSUPPORTED && has_message(),
                  "apply_device_ids on a CPU context: ERR_UNSUPPORTED (got %d: %s)", st, engram_last_error());
            check(engram_check(ctx, NULL) == ENGRAM_STATUS_OK, "engram_check on a CPU context: OK");
            engram_free(ctx);
        }
        st = (int)engram_check(NULL, NULL);
        check(st == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "engram_check(NULL): ERR_NULL_ARGUMENT");
        st = (int)engram_apply_device_ids(NULL, 10, NULL, 0, NULL, ENGRAM_TYPE_F32, NULL);
        check(st == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "apply_device_ids(NULL ctx): ERR_NULL_ARGUMENT");
    }
    return check_summary("test_cuda_errors");
}
