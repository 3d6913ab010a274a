/*
 * Process and thread teardown:
 *
 * - engram_free joins the context's threads (the projection's pool and the
 *   prefetch workers): after many create/free cycles of contexts with many
 *   threads, /proc/self/task holds as many threads as before, right after
 *   each free (rayon's pool used to let its threads exit later, on their own).
 * - A failing call and engram_last_error() from an atexit handler, from a
 *   pthread-key destructor, and (C++) from a static object's destructor,
 *   after the calling thread's destructible storage is gone: no abort, the
 *   call returns its status, engram_last_error() its message, and nothing
 *   leaks (LeakSanitizer) when such a handler is a thread's first call.
 *   Contexts with threads are created, used and freed in those handlers.
 *
 * Checks printed from the exit handlers are counted like the others; a
 * failed one also makes the exit status nonzero.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "engram.h"

#include <dirent.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "mini_model.h"

static int count_threads(void) {
    DIR *d = opendir("/proc/self/task");
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n;
}

static uint16_t g_table[MM_ROWS * MM_HD];
static float g_wkv[MM_K_OUT * MM_K_IN], g_q[MM_HW], g_k[MM_HW];

/* A context with `n_threads` threads that has run an apply, after a
 * prefetch when `prefetch` (so that every kind of worker thread was
 * started); NULL on failure. */
static engram_context *busy_context(uint32_t n_threads, int prefetch) {
    engram_config c = mm_config(n_threads, 8, 2);
    engram_context *ctx = NULL;
    if (engram_create(&c, &ctx) != ENGRAM_STATUS_OK) return NULL;
    engram_layer_weights w = mm_weights(g_table, g_wkv, g_q, g_k);
    int32_t tok[8], seq[8] = {0}, pos[8];
    for (int i = 0; i < 8; i++) {
        tok[i] = (int32_t)((i * 5 + 3) % MM_VOCAB);
        pos[i] = i;
    }
    int64_t ids[8 * MM_C];
    static float hw[8 * MM_HW];
    mm_fill_highway(hw, 8);
    if (engram_set_layer(ctx, &w) != ENGRAM_STATUS_OK || engram_hash(ctx, tok, seq, pos, 8, ids, 8 * MM_C) ||
        (prefetch && engram_prefetch(ctx, MM_LAYER, ids, 8) != ENGRAM_STATUS_OK) ||
        engram_apply(ctx, MM_LAYER, ids, 8, hw, ENGRAM_TYPE_F32, NULL) != ENGRAM_STATUS_OK) {
        note("busy_context: %s", engram_last_error());
        engram_free(ctx);
        return NULL;
    }
    return ctx;
}

static void test_threads_joined(void) {
    const int cycles = 24;
    const uint32_t threads = 256;
    int base = count_threads();
    if (!check(base > 0, "/proc/self/task lists this process's threads (%d)", base)) return;
    int worst = 0, most_alive = 0, failed = 0;
    for (int i = 0; i < cycles; i++) {
        engram_context *ctx = busy_context(threads, 1);
        if (!ctx) {
            failed = 1;
            break;
        }
        int alive = count_threads();
        if (alive > most_alive) most_alive = alive;
        engram_free(ctx);
        int left = count_threads() - base;
        if (left > worst) worst = left;
    }
    check(!failed, "%d create/prefetch/apply/free cycles with n_threads = %u", cycles, threads);
    check(most_alive >= base + (int)threads, "the contexts started their threads (%d alive, %d before)",
          most_alive, base);
    check(worst == 0, "right after each engram_free every context thread is gone (at most %d left over)", worst);
}

/* ------------------------------------------------------------------------ */
/* Calls after the thread's storage is gone.                                  */

static int g_sentinel;
#define OUT_SENTINEL ((engram_context *)(void *)&g_sentinel)

/* A failing call (NULL cfg) and engram_last_error() in a teardown handler:
 * the status, and the call's own message (the message buffer has no
 * destructor, so it outlives the thread's other storage). */
static void failing_call_in(const char *where) {
    engram_context *out = OUT_SENTINEL;
    engram_status s = engram_create(NULL, &out);
    check(s == ENGRAM_STATUS_ERR_NULL_ARGUMENT && out == OUT_SENTINEL,
          "%s: a failing call returns its status (ERR_NULL_ARGUMENT), *out untouched", where);
    const char *m = engram_last_error();
    check(m != NULL && strcmp(m, "config is NULL") == 0, "%s: engram_last_error() is the call's message (\"%s\")",
          where, m ? m : "(null)");
    check(strcmp(engram_status_str(ENGRAM_STATUS_ERR_IO), "I/O error") == 0 && engram_version() != NULL,
          "%s: the static strings still work", where);
}

static void exit_if_failed(void) {
    if (g_checks_failed) {
        printf("# %d failed (in an exit handler)\n", g_checks_failed);
        fflush(stdout);
        _exit(1);
    }
}

/* The pthread-key destructor runs after the thread's own storage was torn
 * down (glibc runs the thread_local destructors first). */
static pthread_key_t g_key;
static int g_key_touched;

static void key_destructor(void *p) {
    (void)p;
    failing_call_in(g_key_touched ? "pthread-key destructor (the thread had failed a call)"
                                  : "pthread-key destructor (the thread's first call)");
    /* Single-threaded and no prefetch: a thread started from a thread-exit
     * destructor makes Rust's std register a thread-local destructor there,
     * which glibc never runs (64 bytes that LeakSanitizer reports). */
    engram_context *ctx = busy_context(1, 0);
    check(ctx != NULL, "pthread-key destructor: a context is created, used ...");
    engram_free(ctx);
    check(1, "pthread-key destructor: ... and freed");
}

static void *key_thread(void *arg) {
    (void)arg;
    if (g_key_touched) {
        engram_context *out = NULL;
        engram_create(NULL, &out); /* sets the thread's last error */
    }
    pthread_setspecific(g_key, (void *)&g_key);
    return NULL;
}

static void test_key_destructor(void) {
    if (!check(pthread_key_create(&g_key, key_destructor) == 0, "pthread_key_create")) return;
    for (g_key_touched = 1; g_key_touched >= 0; g_key_touched--) {
        pthread_t t;
        if (check(pthread_create(&t, NULL, key_thread, NULL) == 0, "start a thread with a key destructor"))
            pthread_join(t, NULL);
    }
    pthread_key_delete(g_key);
}

static engram_context *g_exit_ctx;
static int g_base_threads;

static void at_exit_handler(void) {
    failing_call_in("atexit handler");
    engram_free(g_exit_ctx);
    check(count_threads() == g_base_threads,
          "atexit handler: engram_free of a context with threads joins them (%d threads, %d before)",
          count_threads(), g_base_threads);
    exit_if_failed();
}

#ifdef __cplusplus
/* Destroyed after the atexit handler (registered later, run earlier). */
struct StaticDestructor {
    engram_context *ctx = nullptr;
    ~StaticDestructor() {
        failing_call_in("C++ static destructor");
        engram_free(ctx);
        check(1, "C++ static destructor: engram_free of a context with threads returns");
        exit_if_failed();
    }
};
static StaticDestructor g_static_destructor;
#endif

int main(void) {
    mm_fill_table(g_table, 0);
    mm_fill_wkv(g_wkv, 0);
    mm_fill_qk(g_q, g_k);
    test_threads_joined();
    test_key_destructor();

    /* The main thread fails a call, so that its storage is in use before
     * the exit handlers run. */
    engram_context *out = NULL;
    check(engram_create(NULL, &out) == ENGRAM_STATUS_ERR_NULL_ARGUMENT && engram_last_error()[0] != '\0',
          "main: a failing call sets the last error");
#ifdef __cplusplus
    g_static_destructor.ctx = busy_context(8, 1);
    check(g_static_destructor.ctx != NULL, "main: a context for the static destructor to free");
#endif
    g_base_threads = count_threads();
    g_exit_ctx = busy_context(8, 1);
    check(g_exit_ctx != NULL, "main: a context for the atexit handler to free");
    check(atexit(at_exit_handler) == 0, "atexit");
    return check_summary("test_teardown");
}
