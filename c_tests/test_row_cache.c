/*
 * The host row cache (docs/row-cache.md) and its statistics through the C
 * ABI, on the golden's tiny GGUF model read with pread: row_cache_bytes in
 * engram_gguf_options and engram_safetensors_options (defaults, older
 * layouts), engram_cache_stats_init / _read / _reset, every bad input (NULL
 * ctx or stats, a bad struct_size, a layer out of range, an unknown or
 * unkept tier), budgets of 0, SIZE_MAX and more than the machine's memory
 * (ERR_CAPACITY at create, nothing leaked), applies through the cache equal
 * to an uncached context's bit for bit, a thread polling the statistics
 * while the main thread prefetches and applies, the file cut short under a
 * cached context (ERR_IO, never a signal), and how the misses are read
 * (each ENGRAM_ROW_IO mode, a file on tmpfs read buffered, an unknown mode
 * refused), each reported in the statistics. Run under ASan + UBSan
 * by c_tests/run.sh.
 */
#define _POSIX_C_SOURCE 200809L
#include "engram.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "filler.h"

#define DATA "tests/golden/data/"
#define SCRATCH "target/c_row_cache"
#define N 8
#define COLS 4           /* row ids per token per layer: (N-1)*H = 2 x 2 */
#define IDS_PER_TOKEN 8 /* 2 layers */

static engram_context *open_tiny(const char *path, uint64_t budget, engram_status *st) {
    engram_gguf_options o;
    engram_gguf_options_init(&o);
    o.n_threads = 2;
    o.row_cache_bytes = budget;
    engram_context *c = NULL;
    *st = engram_create_from_gguf(path, &o, &c);
    return c;
}

static engram_cache_stats stats_of(engram_context *c, uint32_t layer) {
    engram_cache_stats s;
    engram_cache_stats_init(&s);
    if (engram_cache_stats_read(c, layer, ENGRAM_CACHE_TIER_HOST, &s) != ENGRAM_STATUS_OK) {
        memset(&s, 0xFF, sizeof s);
    }
    return s;
}

/* Step `k`'s tokens hashed on `c` (sequence 0, positions 0 to N-1: the
 * caller removes the sequence after each step). */
static void hash_step(engram_context *c, int k, int64_t *ids) {
    int32_t tok[N], seq[N], pos[N];
    for (int i = 0; i < N; i++) {
        tok[i] = (k * 5 + i * 3) % 40 + 1;
        seq[i] = 0;
        pos[i] = i;
    }
    if (engram_hash(c, tok, seq, pos, N, ids, (size_t)N * IDS_PER_TOKEN) != ENGRAM_STATUS_OK) {
        check(0, "hash step %d", k);
    }
}

static void test_options_and_bad_input(void) {
    engram_gguf_options o;
    engram_gguf_options_init(&o);
    check(o.row_cache_bytes == 0, "engram_gguf_options_init: row_cache_bytes = 0 (no cache)");
    engram_safetensors_options so;
    engram_safetensors_options_init(&so);
    check(so.row_cache_bytes == 0, "engram_safetensors_options_init: row_cache_bytes = 0");
    /* An older caller's options, which end before row_cache_bytes: no cache. */
    engram_gguf_options old;
    memset(&old, 0x5A, sizeof old);
    engram_gguf_options_init_sized(&old, offsetof(engram_gguf_options, row_cache_bytes));
    old.n_threads = 1;
    engram_context *c = NULL;
    check(engram_create_from_gguf(DATA "tiny.gguf", &old, &c) == ENGRAM_STATUS_OK,
          "a 0.3 engram_gguf_options (ending before row_cache_bytes) is read");
    engram_cache_stats s = stats_of(c, 0);
    check(s.policy == ENGRAM_CACHE_POLICY_NONE && s.capacity_rows == 0 && s.budget == 0 &&
              strcmp(s.policy_name, "none") == 0 && s.read_mode == ENGRAM_READ_MODE_NONE &&
              strcmp(s.read_mode_name, "none") == 0,
          "... and its layers have no cache (policy none, no reader)");
    engram_free(c);

    engram_status st;
    c = open_tiny(DATA "tiny.gguf", 0, &st);
    check(st == ENGRAM_STATUS_OK, "row_cache_bytes = 0 opens");
    engram_cache_stats init;
    engram_cache_stats_init(&init);
    check(init.struct_size == sizeof init && init.policy == ENGRAM_CACHE_POLICY_NONE,
          "engram_cache_stats_init sets struct_size and no policy");
    engram_cache_stats_init(NULL); /* ignored */
    engram_cache_stats x;
    memset(&x, 0x77, sizeof x);
    x.struct_size = sizeof x;
    engram_cache_stats keep = x;
    check(engram_cache_stats_read(NULL, 0, ENGRAM_CACHE_TIER_HOST, &x) == ENGRAM_STATUS_ERR_NULL_ARGUMENT,
          "NULL ctx: ERR_NULL_ARGUMENT");
    check(engram_cache_stats_read(c, 0, ENGRAM_CACHE_TIER_HOST, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT,
          "NULL stats: ERR_NULL_ARGUMENT");
    check(engram_cache_stats_read(c, 2, ENGRAM_CACHE_TIER_HOST, &x) == ENGRAM_STATUS_ERR_INVALID_ARGUMENT,
          "layer index 2 of 2: ERR_INVALID_ARGUMENT");
    check(engram_cache_stats_read(c, 0, 0, &x) == ENGRAM_STATUS_ERR_INVALID_ARGUMENT &&
              engram_cache_stats_read(c, 0, 99, &x) == ENGRAM_STATUS_ERR_INVALID_ARGUMENT,
          "tiers 0 and 99: ERR_INVALID_ARGUMENT");
    check(engram_cache_stats_read(c, 0, ENGRAM_CACHE_TIER_STORAGE, &x) == ENGRAM_STATUS_ERR_UNSUPPORTED,
          "the storage tier (not kept apart yet): ERR_UNSUPPORTED");
    x.struct_size = 3;
    keep.struct_size = 3;
    check(engram_cache_stats_read(c, 0, ENGRAM_CACHE_TIER_HOST, &x) == ENGRAM_STATUS_ERR_STRUCT_SIZE,
          "struct_size 3: ERR_STRUCT_SIZE");
    check(memcmp(&x, &keep, sizeof x) == 0, "nothing written by the refused calls");
    engram_cache_stats dev;
    engram_cache_stats_init(&dev);
    dev.lookups = 77;
    check(engram_cache_stats_read(c, 0, ENGRAM_CACHE_TIER_DEVICE, &dev) == ENGRAM_STATUS_OK && dev.lookups == 0 &&
              dev.capacity_rows == 0 && dev.policy == ENGRAM_CACHE_POLICY_NONE,
          "the device tier of a CPU context: zeros, no policy");
    check(engram_cache_stats_reset(NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "reset(NULL): ERR_NULL_ARGUMENT");
    int64_t ids[N * IDS_PER_TOKEN];
    hash_step(c, 0, ids);
    size_t nh = (size_t)N * TINY_HC * TINY_D;
    float *h = (float *)build_values("c.rc.h", nh, 1.0, 0.0, 0);
    check(engram_apply(c, 1, ids, N, h, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_OK, "apply without a cache");
    s = stats_of(c, 0);
    check(s.lookups == 0 && s.reads == 0 && s.policy == ENGRAM_CACHE_POLICY_NONE,
          "budget 0: the stats say no cache, nothing looked up");
    free(h);
    engram_free(c);
}

static void test_budgets_out_of_reach(void) {
    engram_status st;
    engram_context *c = open_tiny(DATA "tiny.gguf", (uint64_t)SIZE_MAX, &st);
    check(st == ENGRAM_STATUS_ERR_CAPACITY && c == NULL, "row_cache_bytes = SIZE_MAX: ERR_CAPACITY, no context");
    const char *m = engram_last_error();
    check(m != NULL && strstr(m, "row cache") != NULL, "the message names the row cache");
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    uint64_t ram = (uint64_t)pages * (uint64_t)page;
    /* Twice the machine's memory for each of the 2 layers. */
    c = open_tiny(DATA "tiny.gguf", 4 * ram, &st);
    check(st == ENGRAM_STATUS_ERR_CAPACITY && c == NULL, "a budget larger than memory: ERR_CAPACITY");
    engram_safetensors_options so;
    engram_safetensors_options_init(&so);
    so.row_cache_bytes = (uint64_t)SIZE_MAX;
    so.tokenizer_json = DATA "deepseek_v4_tokenizer.json";
    /* (No checkpoint here: the option is read, the directory refused.) */
    check(engram_create_from_safetensors(SCRATCH "_none", &so, &c) != ENGRAM_STATUS_OK && c == NULL,
          "engram_safetensors_options with row_cache_bytes: read (the missing directory refused)");
}

struct poller {
    engram_context *ctx;
    int stop, polls, bad;
};

static void *poll_stats(void *arg) {
    struct poller *p = (struct poller *)arg;
    while (!__atomic_load_n(&p->stop, __ATOMIC_SEQ_CST)) {
        for (uint32_t l = 0; l < 2; l++) {
            engram_cache_stats s;
            engram_cache_stats_init(&s);
            if (engram_cache_stats_read(p->ctx, l, ENGRAM_CACHE_TIER_HOST, &s) != ENGRAM_STATUS_OK ||
                s.hits > s.lookups || s.rows_held > s.capacity_rows) {
                p->bad++;
            }
        }
        if (p->polls % 64 == 0) engram_cache_stats_reset(p->ctx);
        p->polls++;
    }
    return NULL;
}

/* Steps through a cached context (a tiny cache that evicts and a big one)
 * equal an uncached one's, with a thread polling and resetting the stats. */
static void test_cached_equals_uncached(uint64_t budget) {
    engram_status st;
    engram_context *c = open_tiny(DATA "tiny.gguf", budget, &st);
    engram_context *u = open_tiny(DATA "tiny.gguf", 0, &st);
    if (!check(c != NULL && u != NULL, "open cached (%llu bytes) and uncached", (unsigned long long)budget)) return;
    engram_cache_stats s = stats_of(c, 0);
    check(s.policy == ENGRAM_CACHE_POLICY_LRU && strcmp(s.policy_name, "lru") == 0 && s.budget == budget / 2 &&
              s.capacity_rows > 0 && s.capacity_rows * s.row_bytes <= s.budget &&
              s.memory_bytes <= s.capacity_rows * (s.row_bytes + 64) + 6144,
          "budget %llu: LRU (the default), half a layer, rows within the budget and memory within the stated overhead",
          (unsigned long long)budget);
    static const char *const modes[] = {"none", "io_uring", "pread_pool", "buffered"};
    check(s.read_mode >= ENGRAM_READ_MODE_IO_URING && s.read_mode <= ENGRAM_READ_MODE_BUFFERED &&
              strcmp(s.read_mode_name, modes[s.read_mode]) == 0,
          "budget %llu: a file table's misses have a batched reader (%u, %s)", (unsigned long long)budget,
          (unsigned)s.read_mode, s.read_mode_name);
    struct poller p = {c, 0, 0, 0};
    pthread_t t;
    int started = pthread_create(&t, NULL, poll_stats, &p) == 0;
    size_t nh = (size_t)N * TINY_HC * TINY_D;
    float *x = (float *)build_values("c.rc.h", nh, 1.0, 0.0, 0);
    float *a = (float *)malloc(nh * sizeof(float)), *b = (float *)malloc(nh * sizeof(float));
    int same = 1, ok = 1;
    for (int k = 0; k < 24; k++) {
        int64_t ids[N * IDS_PER_TOKEN], ids_u[N * IDS_PER_TOKEN];
        hash_step(c, k % 6, ids);
        hash_step(u, k % 6, ids_u);
        for (uint32_t lid = 1; lid <= 3; lid += 2) {
            if (k % 2 == 0) ok &= engram_prefetch(c, lid, ids, N) == ENGRAM_STATUS_OK;
            memcpy(a, x, nh * sizeof(float));
            memcpy(b, x, nh * sizeof(float));
            ok &= engram_apply(c, lid, ids, N, a, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_OK;
            ok &= engram_apply(u, lid, ids_u, N, b, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_OK;
            same &= memcmp(a, b, nh * sizeof(float)) == 0;
        }
        engram_seq_rm(c, 0, -1, -1);
        engram_seq_rm(u, 0, -1, -1);
    }
    __atomic_store_n(&p.stop, 1, __ATOMIC_SEQ_CST);
    if (started) pthread_join(t, NULL);
    check(started && ok, "24 steps prefetched and applied while a thread polls");
    check(same, "every highway through the cache equals the uncached context's, bit for bit");
    check(p.polls > 0 && p.bad == 0, "%d polls, each OK and consistent", p.polls);
    engram_cache_stats_reset(c);
    int64_t ids[N * IDS_PER_TOKEN];
    hash_step(c, 0, ids);
    memcpy(a, x, nh * sizeof(float));
    engram_apply(c, 1, ids, N, a, ENGRAM_TYPE_F32, NULL);
    engram_apply(c, 1, ids, N, a, ENGRAM_TYPE_F32, NULL);
    s = stats_of(c, 0);
    /* The batched reader reads whole blocks (at most 4 KiB), several rows a
       read where their blocks touch. */
    check(s.lookups == 2 * N * COLS && s.hits + s.misses == s.lookups && s.reads <= s.misses &&
              s.bytes_read >= s.reads && s.bytes_read <= s.misses * (s.row_bytes + 2 * 4096) && s.hits > 0,
          "after a reset, two applies of one step: %llu lookups, %llu hits, %llu reads",
          (unsigned long long)s.lookups, (unsigned long long)s.hits, (unsigned long long)s.reads);
    free(x);
    free(a);
    free(b);
    engram_free(c);
    engram_free(u);
}

/* The end of blk.1.engram_embd's data in tiny.gguf (as in test_dialects.c). */
#define TINY_LAYER1_TABLE_END 61408

static void test_cut_short(void) {
    const char *p = SCRATCH "_cut.gguf";
    if (!check(copy_whole_file(DATA "tiny.gguf", p), "copy tiny.gguf")) return;
    engram_status st;
    engram_context *c = open_tiny(p, 1 << 20, &st);
    if (!check(c != NULL, "open the copy with a cache")) return;
    int64_t ids[N * IDS_PER_TOKEN];
    hash_step(c, 0, ids);
    size_t nh = (size_t)N * TINY_HC * TINY_D;
    float *h = (float *)build_values("c.rc.h", nh, 1.0, 0.0, 0);
    float *x = (float *)build_values("c.rc.h", nh, 1.0, 0.0, 0);
    check(truncate(p, TINY_LAYER1_TABLE_END) == 0, "truncate the file under the context");
    check(engram_apply(c, 1, ids, N, h, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_OK, "layer 1 still applies");
    memcpy(h, x, nh * sizeof(float));
    check(engram_apply(c, 3, ids, N, h, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_ERR_IO &&
              memcmp(h, x, nh * sizeof(float)) == 0,
          "layer 3 (cut off) through the cache: ERR_IO, the highway untouched");
    check(engram_prefetch(c, 3, ids, N) == ENGRAM_STATUS_OK &&
              engram_apply(c, 3, ids, N, h, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_ERR_IO,
          "prefetched: ERR_IO too");
    engram_cache_stats s = stats_of(c, 1);
    check(s.insertions == 0 && s.misses > 0, "nothing of the failed reads was taken in");
    engram_free(c);
    free(h);
    free(x);
    remove(p);
}

/* Layer 1 and 3 applied on `c` and on `u` from the same highway: equal bits. */
static int same_applies(engram_context *c, engram_context *u) {
    int64_t ids[N * IDS_PER_TOKEN];
    hash_step(c, 1, ids);
    engram_seq_rm(c, 0, -1, -1);
    size_t nh = (size_t)N * TINY_HC * TINY_D;
    float *a = (float *)build_values("c.rc.m", nh, 1.0, 0.0, 0);
    float *b = (float *)build_values("c.rc.m", nh, 1.0, 0.0, 0);
    int ok = a && b;
    for (uint32_t l = 1; ok && l <= 3; l += 2) {
        ok = engram_apply(c, l, ids, N, a, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_OK &&
             engram_apply(u, l, ids, N, b, ENGRAM_TYPE_F32, NULL) == ENGRAM_STATUS_OK &&
             memcmp(a, b, nh * sizeof(float)) == 0;
    }
    free(a);
    free(b);
    return ok;
}

/* How the misses are read: each mode ENGRAM_ROW_IO forces (io_uring may be
 * refused here: then the pool, reported), a file on tmpfs (read buffered,
 * reported), an unknown mode refused at create; every mode's applies equal
 * an uncached context's. */
static void test_read_modes(void) {
    static const char *const names[] = {"none", "io_uring", "pread_pool", "buffered"};
    static const struct {
        const char *env;
        uint32_t want, or_else;
    } modes[] = {
        {"uring", ENGRAM_READ_MODE_IO_URING, ENGRAM_READ_MODE_PREAD_POOL},
        {"pool", ENGRAM_READ_MODE_PREAD_POOL, ENGRAM_READ_MODE_PREAD_POOL},
        {"buffered", ENGRAM_READ_MODE_BUFFERED, ENGRAM_READ_MODE_BUFFERED},
    };
    engram_status st;
    engram_context *u = open_tiny(DATA "tiny.gguf", 0, &st);
    if (!check(u != NULL, "open uncached")) return;
    for (size_t i = 0; i < sizeof modes / sizeof modes[0]; i++) {
        setenv("ENGRAM_ROW_IO", modes[i].env, 1);
        engram_context *c = open_tiny(DATA "tiny.gguf", 1 << 16, &st);
        unsetenv("ENGRAM_ROW_IO");
        if (!check(c != NULL, "ENGRAM_ROW_IO=%s opens", modes[i].env)) continue;
        engram_cache_stats s = stats_of(c, 0);
        check((s.read_mode == modes[i].want || s.read_mode == modes[i].or_else) && s.read_mode <= 3 &&
                  strcmp(s.read_mode_name, names[s.read_mode]) == 0,
              "ENGRAM_ROW_IO=%s: read mode %s", modes[i].env, s.read_mode <= 3 ? s.read_mode_name : "?");
        check(same_applies(c, u), "ENGRAM_ROW_IO=%s: applies equal the uncached context's", modes[i].env);
        engram_free(c);
    }
    setenv("ENGRAM_ROW_IO", "mmap", 1);
    engram_context *bad = open_tiny(DATA "tiny.gguf", 1 << 16, &st);
    unsetenv("ENGRAM_ROW_IO");
    check(bad == NULL && st == ENGRAM_STATUS_ERR_INVALID_CONFIG && strstr(engram_last_error(), "ENGRAM_ROW_IO"),
          "ENGRAM_ROW_IO=mmap: ERR_INVALID_CONFIG naming it");
    if (bad) engram_free(bad);
    const char *shm = "/dev/shm/engram_c_row_cache.gguf";
    if (access("/dev/shm", W_OK) == 0 && copy_whole_file(DATA "tiny.gguf", shm)) {
        engram_context *c = open_tiny(shm, 1 << 16, &st);
        if (check(c != NULL, "a copy on tmpfs opens")) {
            engram_cache_stats s = stats_of(c, 0);
            check(s.read_mode == ENGRAM_READ_MODE_BUFFERED && strcmp(s.read_mode_name, "buffered") == 0,
                  "a file on tmpfs: its misses are read buffered (reported)");
            check(same_applies(c, u), "tmpfs: applies equal the uncached context's");
            engram_free(c);
        }
        remove(shm);
    } else {
        printf("SKIP no writable /dev/shm: the tmpfs fallback is not checked here\n");
    }
    engram_free(u);
}

int main(void) {
    test_options_and_bad_input();
    test_budgets_out_of_reach();
    test_cached_equals_uncached(2 * 3 * 4 * 64); /* 3 f32-wide rows a layer: evicts constantly */
    test_cached_equals_uncached(1 << 20);
    test_cut_short();
    test_read_modes();
    return check_summary("test_row_cache");
}
