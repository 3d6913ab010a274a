/*
 * engram_free racing a call (issue 34): a thread frees a context while
 * another thread's engram_apply on it is in flight. The free must wait for
 * the call to return before it frees anything (before, it freed the context
 * under the running call: a crash, a hang, or a sanitizer report), and the
 * call in flight completes normally. Rounds: each creates a context, starts
 * a long apply (16384 tokens) on a second thread, frees the context from the
 * main thread 2 ms later, and checks that when engram_free returns the
 * highway already holds the apply's whole result (computed beforehand by an
 * apply nothing raced): every write of the call was done before the free
 * went on. Run under ASan + UBSan by c_tests/run.sh.
 */
#define _POSIX_C_SOURCE 200809L
#include "engram.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "mini_model.h"

#define TOKENS 16384
#define ROUNDS 4

static uint16_t g_table[MM_ROWS * MM_HD];
static float g_wkv[MM_K_OUT * MM_K_IN], g_q[MM_HW], g_k[MM_HW];
static int64_t *g_ids;
static float *g_hw, *g_want;

struct call {
    engram_context *ctx;
    int started, returned, status;
};

static void *applier(void *arg) {
    struct call *c = (struct call *)arg;
    __atomic_store_n(&c->started, 1, __ATOMIC_SEQ_CST);
    int st = (int)engram_apply(c->ctx, MM_LAYER, g_ids, TOKENS, g_hw, ENGRAM_TYPE_F32, NULL);
    c->status = st;
    __atomic_store_n(&c->returned, 1, __ATOMIC_SEQ_CST);
    return NULL;
}

int main(void) {
    g_ids = (int64_t *)malloc(sizeof(int64_t) * TOKENS * MM_C);
    g_hw = (float *)malloc(sizeof(float) * TOKENS * MM_HW);
    g_want = (float *)malloc(sizeof(float) * TOKENS * MM_HW);
    if (!g_ids || !g_hw || !g_want) return 1;
    for (int i = 0; i < TOKENS; i++) {
        g_ids[i * MM_C] = i % 7;           /* column 0: rows [0, 7) */
        g_ids[i * MM_C + 1] = 7 + i % 11;  /* column 1: rows [7, 18) */
    }
    mm_fill_table(g_table, 0);
    mm_fill_wkv(g_wkv, 0);
    mm_fill_qk(g_q, g_k);
    {
        /* The result an apply nothing races gives. */
        engram_config cfg = mm_config(1, TOKENS, 1);
        engram_context *ctx = NULL;
        engram_layer_weights w = mm_weights(g_table, g_wkv, g_q, g_k);
        mm_fill_highway(g_want, TOKENS);
        if (!check(engram_create(&cfg, &ctx) == ENGRAM_STATUS_OK && engram_set_layer(ctx, &w) == ENGRAM_STATUS_OK &&
                       engram_apply(ctx, MM_LAYER, g_ids, TOKENS, g_want, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_OK,
                   "the reference apply"))
            return 1;
        engram_free(ctx);
    }
    int in_flight = 0;
    for (int round = 0; round < ROUNDS; round++) {
        engram_config cfg = mm_config(1, TOKENS, 1);
        engram_context *ctx = NULL;
        if (!check(engram_create(&cfg, &ctx) == ENGRAM_STATUS_OK, "round %d: create", round)) return 1;
        engram_layer_weights w = mm_weights(g_table, g_wkv, g_q, g_k);
        check(engram_set_layer(ctx, &w) == ENGRAM_STATUS_OK, "round %d: set the layer", round);
        mm_fill_highway(g_hw, TOKENS);
        struct call c = {ctx, 0, 0, -1};
        pthread_t t;
        if (pthread_create(&t, NULL, applier, &c) != 0) return 1;
        while (!__atomic_load_n(&c.started, __ATOMIC_SEQ_CST)) {
        }
        struct timespec ms2 = {0, 2000000};
        nanosleep(&ms2, NULL);
        int was_running = !__atomic_load_n(&c.returned, __ATOMIC_SEQ_CST);
        engram_free(ctx);
        int whole = memcmp(g_hw, g_want, sizeof(float) * TOKENS * MM_HW) == 0;
        pthread_join(t, NULL);
        in_flight += was_running;
        check(whole, "round %d: when engram_free returned, the apply in flight had written its whole result%s", round,
              was_running ? "" : " (it had already finished: nothing to wait for)");
        check(c.status == ENGRAM_STATUS_OK, "round %d: the apply in flight completed normally (got %d: %s)", round,
              c.status, engram_last_error());
    }
    check(in_flight > 0, "the free began while the apply was in flight in %d of %d rounds (at least one)", in_flight,
          ROUNDS);
    free(g_ids);
    free(g_hw);
    free(g_want);
    return check_summary("test_free_race");
}
