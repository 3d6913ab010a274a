/*
 * The device hash's bad-input paths that need no GPU, through the C ABI
 * (docs/device-hash.md):
 *   - a CPU context cannot have a device history: engram_create with
 *     device_history > 0 is ERR_UNSUPPORTED with a message, *out untouched;
 *   - on a CPU context (host history), engram_hash_device,
 *     and every engram_seq_*_device call (copy, drop, rm, cp, keep, add,
 *     state size/write/read) are ERR_UNSUPPORTED with a message and change
 *     nothing (the host hash still gives the same ids; outputs untouched);
 *   - NULL contexts are ERR_NULL_ARGUMENT;
 *   - CUDA with a device history: ERR_DEVICE without a driver; with one, OK
 *     or ERR_DEVICE, and a ring shorter than the look-back ERR_INVALID_CONFIG
 *     (or ERR_DEVICE where the device cannot be opened);
 *   - an engram_config of the 0.1 layout (struct_size up to n_threads) is
 *     still read, device_history taking its default 0.
 */
#include "engram.h"

#include <dlfcn.h>
#include <stddef.h>
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

static void fill(engram_config *c, uint32_t backend) {
    c->backend = backend;
    c->device = 0;
    c->hidden_size = 8;
    c->hc = 2;
    c->head_dim = 32;
    c->n_heads = 2;
    c->max_ngram = 3;
    c->layer_ids = g_layers;
    c->n_layers = 1;
    c->token_map = g_token_map;
    c->token_map_len = 16;
    c->pad_id = 0;
    c->multipliers = g_mult;
    c->n_multipliers = 3;
    c->primes = g_primes;
    c->n_primes = 4;
    c->offsets = g_offsets;
    c->n_offsets = 4;
    c->max_tokens = 4;
    c->max_seqs = 2;
    c->max_positions = 16;
}

static engram_config config(uint32_t backend, uint32_t device_history) {
    engram_config c;
    engram_config_init(&c);
    fill(&c, backend);
    c.device_history = device_history;
    return c;
}

static int has_message(void) {
    const char *m = engram_last_error();
    return m != NULL && m[0] != '\0';
}

CHECK_DEPRECATED_BEGIN /* the deprecated aliases, on purpose */
int main(void) {
    for (int i = 0; i < 16; i++) g_token_map[i] = i % 7;
    void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    const int driver = drv != NULL;
    if (drv) dlclose(drv);
    engram_context *sentinel = (engram_context *)(uintptr_t)0x1234;
    const int32_t tokens[2] = {3, 4}, seqs[2] = {0, 0}, pos[2] = {0, 1};

    /* A device history on the CPU backend. */
    {
        engram_config c = config(ENGRAM_BACKEND_CPU, 8);
        engram_context *ctx = sentinel;
        int st = (int)engram_create(&c, &ctx);
        check(st == ENGRAM_STATUS_ERR_UNSUPPORTED && has_message() && ctx == sentinel,
              "CPU context with device_history 8: ERR_UNSUPPORTED, *out untouched (got %d: %s)", st,
              engram_last_error());
    }
    /* The device calls on a host-history (CPU) context change nothing. */
    {
        engram_config c = config(ENGRAM_BACKEND_CPU, 0);
        engram_context *ctx = NULL;
        int st = (int)engram_create(&c, &ctx);
        check(st == ENGRAM_STATUS_OK, "create CPU (%s)", engram_last_error());
        if (st == ENGRAM_STATUS_OK) {
            int64_t ids[2 * 4], again[2 * 4];
            check(engram_hash(ctx, tokens, seqs, pos, 2, ids, 8) == ENGRAM_STATUS_OK, "host hash");
            st = (int)engram_hash_device(ctx, tokens, seqs, pos, 2, again, NULL);
            check(st == ENGRAM_STATUS_ERR_UNSUPPORTED && has_message(),
                  "hash_device on a CPU context: ERR_UNSUPPORTED (got %d: %s)", st, engram_last_error());
            st = (int)engram_seq_copy_device(ctx, 0, 1, NULL);
            check(st == ENGRAM_STATUS_ERR_UNSUPPORTED && has_message(),
                  "seq_copy_device on a CPU context: ERR_UNSUPPORTED (got %d)", st);
            st = (int)engram_seq_drop_device(ctx, 0, NULL);
            check(st == ENGRAM_STATUS_ERR_UNSUPPORTED && has_message(),
                  "seq_drop_device on a CPU context: ERR_UNSUPPORTED (got %d)", st);
            check(engram_seq_rm_device(ctx, 0, 0, -1, NULL) == ENGRAM_STATUS_ERR_UNSUPPORTED && has_message(),
                  "seq_rm_device on a CPU context: ERR_UNSUPPORTED");
            check(engram_seq_rm_device(ctx, -1, 0, -1, NULL) == ENGRAM_STATUS_ERR_UNSUPPORTED,
                  "seq_rm_device(-1) on a CPU context: ERR_UNSUPPORTED");
            check(engram_seq_cp_device(ctx, 0, 1, 0, -1, NULL) == ENGRAM_STATUS_ERR_UNSUPPORTED && has_message(),
                  "seq_cp_device on a CPU context: ERR_UNSUPPORTED");
            check(engram_seq_keep_device(ctx, 1, NULL) == ENGRAM_STATUS_ERR_UNSUPPORTED && has_message(),
                  "seq_keep_device on a CPU context: ERR_UNSUPPORTED");
            check(engram_seq_add_device(ctx, 0, 0, -1, 3, NULL) == ENGRAM_STATUS_ERR_UNSUPPORTED && has_message(),
                  "seq_add_device on a CPU context: ERR_UNSUPPORTED");
            size_t size = 77, written = 77;
            unsigned char buf[256];
            memset(buf, 0x5A, sizeof buf);
            check(engram_seq_state_size_device(ctx, 0, &size, NULL) == ENGRAM_STATUS_ERR_UNSUPPORTED &&
                      size == 77 && has_message(),
                  "seq_state_size_device on a CPU context: ERR_UNSUPPORTED, size untouched");
            check(engram_seq_state_write_device(ctx, 0, buf, sizeof buf, &written, NULL) ==
                          ENGRAM_STATUS_ERR_UNSUPPORTED &&
                      written == 77 && buf[0] == 0x5A,
                  "seq_state_write_device on a CPU context: ERR_UNSUPPORTED, nothing written");
            /* A real host state: still refused on a host context. */
            size_t hs = 0;
            check(engram_seq_state_size(ctx, 0, &hs) == ENGRAM_STATUS_OK && hs <= sizeof buf, "host state size");
            check(engram_seq_state_write(ctx, 0, buf, sizeof buf, &written) == ENGRAM_STATUS_OK, "host state");
            check(engram_seq_state_read_device(ctx, 1, buf, written, NULL) == ENGRAM_STATUS_ERR_UNSUPPORTED &&
                      has_message(),
                  "seq_state_read_device on a CPU context: ERR_UNSUPPORTED");
            check(engram_seq_state_size_device(ctx, 0, NULL, NULL) != ENGRAM_STATUS_OK,
                  "seq_state_size_device(NULL size): refused");
            check(engram_seq_state_write_device(ctx, 0, NULL, 8, &written, NULL) != ENGRAM_STATUS_OK,
                  "seq_state_write_device(NULL buf): refused");
            check(engram_seq_state_read_device(ctx, 0, NULL, 8, NULL) != ENGRAM_STATUS_OK,
                  "seq_state_read_device(NULL buf): refused");
            /* The host history is as it was: position 1 looks back to 0. */
            const int32_t t1[1] = {4}, s1[1] = {0}, p1[1] = {1};
            check(engram_hash(ctx, t1, s1, p1, 1, again, 4) == ENGRAM_STATUS_OK &&
                      memcmp(again, ids + 4, sizeof(int64_t) * 4) == 0,
                  "the host history unchanged by the refused device calls");
            engram_free(ctx);
        }
    }
    /* NULL contexts. */
    {
        int64_t ids[8];
        check(engram_hash_device(NULL, tokens, seqs, pos, 2, ids, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT,
              "hash_device(NULL ctx): ERR_NULL_ARGUMENT");
        check(engram_seq_copy_device(NULL, 0, 1, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT,
              "seq_copy_device(NULL ctx): ERR_NULL_ARGUMENT");
        check(engram_seq_drop_device(NULL, 0, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT,
              "seq_drop_device(NULL ctx): ERR_NULL_ARGUMENT");
        size_t size = 0, written = 0;
        unsigned char buf[64] = {0};
        check(engram_seq_rm_device(NULL, 0, 0, -1, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT,
              "seq_rm_device(NULL ctx): ERR_NULL_ARGUMENT");
        check(engram_seq_cp_device(NULL, 0, 1, 0, -1, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT,
              "seq_cp_device(NULL ctx): ERR_NULL_ARGUMENT");
        check(engram_seq_keep_device(NULL, 0, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT,
              "seq_keep_device(NULL ctx): ERR_NULL_ARGUMENT");
        check(engram_seq_add_device(NULL, 0, 0, -1, 1, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT,
              "seq_add_device(NULL ctx): ERR_NULL_ARGUMENT");
        check(engram_seq_state_size_device(NULL, 0, &size, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT,
              "seq_state_size_device(NULL ctx): ERR_NULL_ARGUMENT");
        check(engram_seq_state_write_device(NULL, 0, buf, sizeof buf, &written, NULL) ==
                  ENGRAM_STATUS_ERR_NULL_ARGUMENT,
              "seq_state_write_device(NULL ctx): ERR_NULL_ARGUMENT");
        check(engram_seq_state_read_device(NULL, 0, buf, sizeof buf, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT,
              "seq_state_read_device(NULL ctx): ERR_NULL_ARGUMENT");
    }
    /* CUDA with a device history. */
    {
        engram_config c = config(ENGRAM_BACKEND_CUDA, 8);
        engram_context *ctx = sentinel;
        int st = (int)engram_create(&c, &ctx);
        if (!driver) {
            check(st == ENGRAM_STATUS_ERR_DEVICE && has_message() && ctx == sentinel,
                  "CUDA with a device history, no driver: ERR_DEVICE (got %d: %s)", st, engram_last_error());
        } else if (st == ENGRAM_STATUS_OK) {
            int64_t ids[8];
            check(engram_hash(ctx, tokens, seqs, pos, 2, ids, 8) == ENGRAM_STATUS_ERR_UNSUPPORTED,
                  "host hash on a device-history context: ERR_UNSUPPORTED");
            check(engram_hash_device(ctx, tokens, seqs, pos, 5, (int64_t *)(uintptr_t)8, NULL) ==
                      ENGRAM_STATUS_ERR_CAPACITY,
                  "hash_device of max_tokens + 1: ERR_CAPACITY");
            check(engram_seq_copy_device(ctx, 0, 2, NULL) == ENGRAM_STATUS_ERR_INVALID_SEQUENCE,
                  "seq_copy_device to a sequence outside max_seqs: ERR_INVALID_SEQUENCE");
            engram_free(ctx);
        } else {
            check(st == ENGRAM_STATUS_ERR_DEVICE && ctx == sentinel, "CUDA, failed create: ERR_DEVICE (got %d)",
                  st);
        }
        c = config(ENGRAM_BACKEND_CUDA, 1);
        ctx = sentinel;
        st = (int)engram_create(&c, &ctx);
        check((st == ENGRAM_STATUS_ERR_INVALID_CONFIG || (st == ENGRAM_STATUS_ERR_DEVICE)) && ctx == sentinel,
              "a ring of 1 < max_ngram - 1: ERR_INVALID_CONFIG, or ERR_DEVICE without a device (got %d: %s)", st,
              engram_last_error());
    }
    /* The 0.1 layout of engram_config (no device_history). */
    {
        engram_config c;
        memset(&c, 0xAB, sizeof c);
        engram_config_init_sized(&c, offsetof(engram_config, device_history));
        check(c.device_history == 0xABABABABu, "init of the 0.1 layout writes nothing past it");
        fill(&c, ENGRAM_BACKEND_CPU);
        engram_context *ctx = NULL;
        int st = (int)engram_create(&c, &ctx);
        check(st == ENGRAM_STATUS_OK, "create from the 0.1 layout: OK (got %d: %s)", st, engram_last_error());
        if (st == ENGRAM_STATUS_OK) {
            int64_t ids[8];
            check(engram_hash(ctx, tokens, seqs, pos, 2, ids, 8) == ENGRAM_STATUS_OK,
                  "the 0.1 layout's context has a host history");
            engram_free(ctx);
        }
    }
    return check_summary("test_device_hash");
}
CHECK_DEPRECATED_END
