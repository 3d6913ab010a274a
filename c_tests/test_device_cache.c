/*
 * engram_config.device_cache_bytes (docs/row-cache.md "Device tier") where
 * no GPU is needed:
 *   - engram_config_init sets it to 0;
 *   - the CPU backend ignores it (its host tables are read in place): a
 *     context created with 1, a V4.1-sized budget or UINT64_MAX applies a
 *     host table with the bits of one created with 0 (ids, highway);
 *   - an engram_config of the 0.3 layout (struct_size up to device_history)
 *     is still read, the field taking its default 0, and its init writes
 *     nothing past that layout;
 *   - engram_gguf_options and engram_safetensors_options carry it too: init
 *     gives 0, the CPU backend ignores it (tiny.gguf opens with UINT64_MAX),
 *     and their 0.3 layouts (which end before it) are still read;
 *   - CUDA: without a driver ERR_DEVICE at create, *out untouched, whatever
 *     the budget (with a driver, create is OK or ERR_DEVICE; the budget is
 *     checked at engram_set_layer, which tests/cuda_device_cache.rs covers).
 */
#include "engram.h"

#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "mini_model.h"

static uint16_t g_table[MM_ROWS * MM_HD];
static float g_wkv[MM_K_OUT * MM_K_IN], g_q[MM_HW], g_k[MM_HW];

/* Create a CPU context from `c`, set the layer, hash and apply 8 tokens;
 * the ids and highway out. Returns the first failing status. */
static engram_status run(engram_config *c, int64_t *ids, float *hw) {
    engram_context *ctx = NULL;
    engram_status st = engram_create(c, &ctx);
    if (st != ENGRAM_STATUS_OK) return st;
    engram_layer_weights w = mm_weights(g_table, g_wkv, g_q, g_k);
    int32_t tok[8], seq[8] = {0}, pos[8];
    for (int i = 0; i < 8; i++) {
        tok[i] = (int32_t)((i * 5 + 3) % MM_VOCAB);
        pos[i] = i;
    }
    mm_fill_highway(hw, 8);
    st = engram_set_layer(ctx, &w);
    if (st == ENGRAM_STATUS_OK) st = engram_hash(ctx, tok, seq, pos, 8, ids, 8 * MM_C);
    if (st == ENGRAM_STATUS_OK) st = engram_prefetch(ctx, MM_LAYER, ids, 8);
    if (st == ENGRAM_STATUS_OK) st = engram_apply(ctx, MM_LAYER, ids, 8, hw, ENGRAM_TYPE_F32, NULL);
    engram_free(ctx);
    return st;
}

int main(void) {
    mm_fill_table(g_table, 0);
    mm_fill_wkv(g_wkv, 0);
    mm_fill_qk(g_q, g_k);
    {
        engram_config c;
        memset(&c, 0xAB, sizeof c);
        engram_config_init(&c);
        check(c.device_cache_bytes == 0, "engram_config_init: device_cache_bytes 0");
    }
    static int64_t ids0[8 * MM_C], ids[8 * MM_C];
    static float hw0[8 * MM_HW], hw[8 * MM_HW];
    engram_config c0 = mm_config(2, 8, 2);
    check(run(&c0, ids0, hw0) == ENGRAM_STATUS_OK, "CPU, device_cache_bytes 0 (%s)", engram_last_error());
    const uint64_t budgets[3] = {1, UINT64_C(64) << 30, UINT64_MAX};
    for (int b = 0; b < 3; b++) {
        engram_config c = mm_config(2, 8, 2);
        c.device_cache_bytes = budgets[b];
        engram_status st = run(&c, ids, hw);
        check(st == ENGRAM_STATUS_OK, "CPU ignores device_cache_bytes %llu (got %d: %s)",
              (unsigned long long)budgets[b], (int)st, engram_last_error());
        check(memcmp(ids, ids0, sizeof ids) == 0 && memcmp(hw, hw0, sizeof hw) == 0,
              "CPU with device_cache_bytes %llu: the bits of 0", (unsigned long long)budgets[b]);
    }
    /* The 0.3 layout: no device_cache_bytes. */
    {
        engram_config c;
        memset(&c, 0xCD, sizeof c);
        engram_config_init_sized(&c, offsetof(engram_config, device_cache_bytes));
        check(c.device_cache_bytes == UINT64_C(0xCDCDCDCDCDCDCDCD), "init of the 0.3 layout writes nothing past it");
        engram_config full = mm_config(2, 8, 2);
        memcpy(&c, &full, offsetof(engram_config, device_cache_bytes));
        c.struct_size = offsetof(engram_config, device_cache_bytes);
        engram_status st = run(&c, ids, hw);
        check(st == ENGRAM_STATUS_OK, "create from the 0.3 layout (past it: 0xCD bytes): OK (got %d: %s)", (int)st,
              engram_last_error());
        check(memcmp(hw, hw0, sizeof hw) == 0, "the 0.3 layout's context: the same bits");
    }
    /* The loaders' options carry it too (CPU: ignored). */
    {
        engram_gguf_options o;
        memset(&o, 0xEE, sizeof o);
        engram_gguf_options_init(&o);
        check(o.device_cache_bytes == 0, "engram_gguf_options_init: device_cache_bytes 0");
        engram_safetensors_options so;
        memset(&so, 0xEE, sizeof so);
        engram_safetensors_options_init(&so);
        check(so.device_cache_bytes == 0, "engram_safetensors_options_init: device_cache_bytes 0");
        o.device_cache_bytes = UINT64_MAX;
        engram_context *ctx = NULL;
        engram_status st = engram_create_from_gguf("tests/golden/data/tiny.gguf", &o, &ctx);
        check(st == ENGRAM_STATUS_OK, "GGUF on the CPU with device_cache_bytes UINT64_MAX: OK (got %d: %s)", (int)st,
              engram_last_error());
        if (st == ENGRAM_STATUS_OK) engram_free(ctx);
        /* The 0.3 layouts, which end before row_cache_bytes (the two cache
           budgets came together): still read. */
        memset(&o, 0xEE, sizeof o);
        engram_gguf_options_init_sized(&o, offsetof(engram_gguf_options, row_cache_bytes));
        check(o.device_cache_bytes == UINT64_C(0xEEEEEEEEEEEEEEEE), "init of the 0.3 GGUF layout writes nothing past it");
        ctx = NULL;
        st = engram_create_from_gguf("tests/golden/data/tiny.gguf", &o, &ctx);
        check(st == ENGRAM_STATUS_OK, "GGUF options of the 0.3 layout: OK (got %d: %s)", (int)st, engram_last_error());
        if (st == ENGRAM_STATUS_OK) engram_free(ctx);
        memset(&so, 0xEE, sizeof so);
        engram_safetensors_options_init_sized(&so, offsetof(engram_safetensors_options, row_cache_bytes));
        check(so.device_cache_bytes == UINT64_C(0xEEEEEEEEEEEEEEEE),
              "init of the 0.3 safetensors layout writes nothing past it");
        ctx = NULL;
        st = engram_create_from_safetensors("c_tests/no-such-checkpoint-dir", &so, &ctx);
        check(st == ENGRAM_STATUS_ERR_IO && ctx == NULL,
              "safetensors options of the 0.3 layout are read (the missing directory is what fails: got %d: %s)",
              (int)st, engram_last_error());
    }
    /* CUDA: the budget is no reason to crash without a driver. */
    {
        void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        const int driver = drv != NULL;
        if (drv) dlclose(drv);
        engram_config c = mm_config(2, 8, 2);
        c.backend = ENGRAM_BACKEND_CUDA;
        c.device_cache_bytes = UINT64_MAX;
        engram_context *sentinel = (engram_context *)(uintptr_t)0x1234, *ctx = sentinel;
        int st = (int)engram_create(&c, &ctx);
        if (!driver) {
            check(st == ENGRAM_STATUS_ERR_DEVICE && ctx == sentinel,
                  "CUDA without a driver: ERR_DEVICE, *out untouched (got %d: %s)", st, engram_last_error());
        } else {
            check(st == ENGRAM_STATUS_OK || st == ENGRAM_STATUS_ERR_DEVICE, "CUDA with a driver: OK or ERR_DEVICE (got %d)",
                  st);
            if (st == ENGRAM_STATUS_OK) engram_free(ctx);
        }
    }
    return check_summary("test_device_cache");
}
