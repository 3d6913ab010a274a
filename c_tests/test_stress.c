/*
 * One context, several threads, bounded: engram_set_layer replacing the
 * layer again and again (and the engine taking the old weights away as soon
 * as it returns, which docs/abi.md allows on the CPU backend), against
 * engram_apply with and without engram_prefetch, prefetches never applied,
 * and engram_hash / seq_copy / seq_drop on other sequences.
 *
 * - A read of replaced weights after set_layer returned: each version of the
 *   table and wkv lives in its own mapping, made PROT_NONE right after the
 *   set_layer that replaced it returns (and kept mapped until the end, so
 *   its address is not reused): a late read faults (SIGSEGV), which fails
 *   the test. Under ASan the mappings are outside the heap; ASan checks the
 *   C side.
 * - A wrong answer (one version's rows with another's wkv, a stale staged
 *   gather): every apply's highway must equal, bit for bit, the reference of
 *   one of the versions current while it ran.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "engram.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "check.h"
#include "mini_model.h"

#define VERSIONS 3
#define SETS 1500
#define TOKENS 24
#define APPLIERS 3

static engram_context *g_ctx;
static float g_q[MM_HW], g_k[MM_HW];
static int64_t g_ids[TOKENS * MM_C];
static int32_t g_tok[TOKENS], g_pos[TOKENS];
static float g_base_hw[TOKENS * MM_HW];
static float g_expected[VERSIONS][TOKENS * MM_HW];

/* How many set_layer calls have returned (version i holds values i % VERSIONS). */
static long g_published;
static int g_done;
static int g_errors, g_wrong;
static char g_first_error[512], g_first_wrong[512];

static long load_published(void) { return __atomic_load_n(&g_published, __ATOMIC_SEQ_CST); }

static void problem(int *counter, const char *fmt, const char *detail) {
    char *first = counter == &g_errors ? g_first_error : g_first_wrong;
    if (__atomic_fetch_add(counter, 1, __ATOMIC_SEQ_CST) == 0) snprintf(first, 512, fmt, detail);
}

/* One mapping per version: the table at 0, wkv at 4096 (page aligned). */
#define MAP_BYTES (4096 + MM_WKV_BYTES)
static void *g_maps[SETS + 1];

static void *map_version(int v) {
    void *m = mmap(NULL, MAP_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return NULL;
    mm_fill_table((uint16_t *)m, v);
    mm_fill_wkv((float *)((char *)m + 4096), v);
    return m;
}

static int set_mapping(void *m) {
    engram_layer_weights w = mm_weights((const uint16_t *)m, (const float *)((char *)m + 4096), g_q, g_k);
    return (int)engram_set_layer(g_ctx, &w);
}

/* Whether `hw` is the result of a version current at some point in [lo, hi]. */
static int matches_a_version(const float *hw, long lo, long hi) {
    for (long v = lo; v <= hi && v < lo + VERSIONS; v++)
        if (memcmp(hw, g_expected[v % VERSIONS], sizeof g_expected[0]) == 0) return 1;
    return 0;
}

static void *setter(void *arg) {
    (void)arg;
    for (int i = 1; i <= SETS; i++) {
        g_maps[i] = map_version(i % VERSIONS);
        if (!g_maps[i] || set_mapping(g_maps[i]) != ENGRAM_STATUS_OK) {
            problem(&g_errors, "set_layer: %s", engram_last_error());
            break;
        }
        __atomic_store_n(&g_published, (long)i, __ATOMIC_SEQ_CST);
        /* The engine takes the replaced weights away at once (and the
         * memory back: the mapping stays, PROT_NONE, so that its addresses
         * are not reused). */
        mprotect(g_maps[i - 1], MAP_BYTES, PROT_NONE);
        madvise(g_maps[i - 1], MAP_BYTES, MADV_DONTNEED);
    }
    __atomic_store_n(&g_done, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

static void *applier(void *arg) {
    int prefetching = (int)(intptr_t)arg;
    float *hw = (float *)malloc(sizeof g_base_hw);
    long iter = 0;
    while (hw && !__atomic_load_n(&g_done, __ATOMIC_SEQ_CST)) {
        iter++;
        long lo = load_published();
        if (prefetching && iter % 3 == 0) {
            /* A prefetch nobody applies: its slot is reused later. */
            if (engram_prefetch(g_ctx, MM_LAYER, g_ids, TOKENS / 2) != ENGRAM_STATUS_OK)
                problem(&g_errors, "prefetch: %s", engram_last_error());
            continue;
        }
        if (prefetching && engram_prefetch(g_ctx, MM_LAYER, g_ids, TOKENS) != ENGRAM_STATUS_OK) {
            problem(&g_errors, "prefetch: %s", engram_last_error());
            continue;
        }
        memcpy(hw, g_base_hw, sizeof g_base_hw);
        if (engram_apply(g_ctx, MM_LAYER, g_ids, TOKENS, hw, ENGRAM_TYPE_F32, NULL) != ENGRAM_STATUS_OK) {
            problem(&g_errors, "apply: %s", engram_last_error());
            continue;
        }
        /* A set_layer may have returned after the apply took the layer but
         * before it published: the version after `hi` counts too. */
        long hi = load_published() + 1;
        if (!matches_a_version(hw, lo, hi)) problem(&g_wrong, "%s", prefetching ? "apply after prefetch" : "apply");
    }
    free(hw);
    return NULL;
}

/* Prefetches that nobody applies, back to back: their gathers are still
 * queued or running on the context's workers when a set_layer comes. */
static void *prefetcher(void *arg) {
    (void)arg;
    long iter = 0;
    while (!__atomic_load_n(&g_done, __ATOMIC_SEQ_CST)) {
        uint32_t n = (uint32_t)(++iter % 2 ? TOKENS : TOKENS / 3);
        if (engram_prefetch(g_ctx, MM_LAYER, g_ids, n) != ENGRAM_STATUS_OK)
            problem(&g_errors, "prefetch: %s", engram_last_error());
    }
    return NULL;
}

CHECK_DEPRECATED_BEGIN /* the deprecated aliases, on purpose */
static void *sequences(void *arg) {
    (void)arg;
    int64_t ids[TOKENS * MM_C];
    int32_t seq[TOKENS];
    int s = 1;
    while (!__atomic_load_n(&g_done, __ATOMIC_SEQ_CST)) {
        for (int i = 0; i < TOKENS; i++) seq[i] = s;
        if (engram_hash(g_ctx, g_tok, seq, g_pos, TOKENS, ids, TOKENS * MM_C) != ENGRAM_STATUS_OK ||
            memcmp(ids, g_ids, sizeof ids) != 0)
            problem(&g_wrong, "%s", "hash of another sequence");
        if (engram_seq_copy(g_ctx, s, s + 1) != ENGRAM_STATUS_OK || engram_seq_drop(g_ctx, s) != ENGRAM_STATUS_OK)
            problem(&g_errors, "seq_copy/seq_drop: %s", engram_last_error());
        s = s % 6 + 1;
    }
    return NULL;
}
CHECK_DEPRECATED_END

int main(void) {
    mm_fill_qk(g_q, g_k);
    engram_config c = mm_config(4, TOKENS, 8);
    if (!check(engram_create(&c, &g_ctx) == ENGRAM_STATUS_OK, "create a context with 4 threads")) {
        note("%s", engram_last_error());
        return check_summary("test_stress");
    }
    int32_t seq0[TOKENS] = {0};
    for (int i = 0; i < TOKENS; i++) {
        g_tok[i] = (int32_t)((i * 7 + 2) % MM_VOCAB);
        g_pos[i] = i;
    }
    mm_fill_highway(g_base_hw, TOKENS);
    int ok = engram_hash(g_ctx, g_tok, seq0, g_pos, TOKENS, g_ids, TOKENS * MM_C) == ENGRAM_STATUS_OK;
    /* The references: each version applied alone. */
    for (int v = 0; v < VERSIONS && ok; v++) {
        void *m = map_version(v);
        memcpy(g_expected[v], g_base_hw, sizeof g_base_hw);
        ok = m && set_mapping(m) == ENGRAM_STATUS_OK &&
             engram_apply(g_ctx, MM_LAYER, g_ids, TOKENS, g_expected[v], ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_OK;
        if (v == 0) {
            g_maps[0] = m; /* version 0 stays set: the setter replaces it first */
        } else {
            /* Back to version 0 for the start. */
            ok = ok && set_mapping(g_maps[0]) == ENGRAM_STATUS_OK;
            if (m) munmap(m, MAP_BYTES);
        }
    }
    int differ = ok && memcmp(g_expected[0], g_expected[1], sizeof g_expected[0]) != 0 &&
                 memcmp(g_expected[1], g_expected[2], sizeof g_expected[0]) != 0 &&
                 memcmp(g_expected[0], g_expected[2], sizeof g_expected[0]) != 0;
    if (!check(ok && differ, "the references: three versions, three different results")) {
        note("%s", engram_last_error());
        engram_free(g_ctx);
        return check_summary("test_stress");
    }

    pthread_t th[APPLIERS + 3];
    int started = 0;
    for (int i = 0; i < APPLIERS; i++)
        if (pthread_create(&th[started], NULL, applier, (void *)(intptr_t)(i == 0)) == 0) started++;
    if (pthread_create(&th[started], NULL, prefetcher, NULL) == 0) started++;
    if (pthread_create(&th[started], NULL, sequences, NULL) == 0) started++;
    if (pthread_create(&th[started], NULL, setter, NULL) == 0) started++;
    check(started == APPLIERS + 3,
          "started %d threads: %d appliers (one prefetching first), a prefetcher, hash/seq_*, set_layer",
          APPLIERS + 3, APPLIERS);
    if (started < APPLIERS + 3) __atomic_store_n(&g_done, 1, __ATOMIC_SEQ_CST);
    for (int i = 0; i < started; i++) pthread_join(th[i], NULL);

    check(load_published() == SETS, "%d set_layer calls, each old table and wkv protected once it returned",
          SETS);
    check(g_errors == 0, "no call failed (%d failures; first: %s)", g_errors, g_errors ? g_first_error : "-");
    check(g_wrong == 0, "every apply equals a version current while it ran (%d wrong; first: %s)", g_wrong,
          g_wrong ? g_first_wrong : "-");
    engram_free(g_ctx);
    for (int i = 0; i <= SETS; i++)
        if (g_maps[i]) munmap(g_maps[i], MAP_BYTES);
    return check_summary("test_stress");
}
