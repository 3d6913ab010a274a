/*
 * engram_context_info, engram_layer_gate_weights and engram_set_threads
 * through the C ABI: the context describes the geometry, layers and limits
 * it was created with; the gate weights are q * k; the thread count changes
 * at run time without changing a bit of the result; every bad input is its
 * status and writes nothing.
 */
#include "engram.h"

#include <dirent.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "mini_model.h"

static uint16_t g_table[MM_ROWS * MM_HD];
static float g_wkv[MM_K_OUT * MM_K_IN], g_q[MM_HW], g_k[MM_HW];

static void test_info(void) {
    engram_config c = mm_config(3, 16, 2);
    engram_context *ctx = NULL;
    if (!check(engram_create(&c, &ctx) == ENGRAM_STATUS_OK, "create a context")) return;

    engram_info info;
    engram_info_init(&info);
    check(info.struct_size == sizeof info && info.layer_ids == NULL, "engram_info_init sets struct_size, NULL arrays");
    check(engram_context_info(NULL, &info) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "context_info(NULL ctx)");
    check(engram_context_info(ctx, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "context_info(NULL info)");
    engram_info wrong = info;
    wrong.struct_size = sizeof wrong + 8;
    check(engram_context_info(ctx, &wrong) == ENGRAM_STATUS_ERR_STRUCT_SIZE, "a larger struct_size is ERR_STRUCT_SIZE");
    wrong.struct_size = 12;
    check(engram_context_info(ctx, &wrong) == ENGRAM_STATUS_ERR_STRUCT_SIZE, "an unknown struct_size is ERR_STRUCT_SIZE");

    uint32_t ids[2] = {99, 99}, tt[2] = {99, 99}, wt[2] = {99, 99}, qt[2] = {99, 99};
    uint64_t rows[2] = {99, 99}, need[2] = {99, 99};
    info.layer_ids = ids;
    info.layers_cap = 0;
    check(engram_context_info(ctx, &info) == ENGRAM_STATUS_ERR_INVALID_ARGUMENT && ids[0] == 99 &&
              info.hidden_size == 0,
          "an array with layers_cap below n_layers is ERR_INVALID_ARGUMENT, nothing written");

    info.table_types = tt;
    info.table_rows = rows;
    info.rows_needed = need;
    info.wkv_types = wt;
    info.qk_types = qt;
    info.layers_cap = 2;
    check(engram_context_info(ctx, &info) == ENGRAM_STATUS_OK, "context_info");
    check(info.hidden_size == MM_D && info.hc == MM_HC && info.head_dim == MM_HD && info.n_heads == MM_H &&
              info.max_ngram == MM_N && info.cols == MM_C && info.n_layers == 1,
          "the geometry: D, hc, Hd, H, N, C, n_layers");
    check(info.eps == 1e-6f && info.max_tokens == 16 && info.max_seqs == 2 && info.max_positions == 4096 &&
              info.token_map_len == MM_VOCAB && info.pad_id == 0 && info.row_ids_per_token == MM_C,
          "eps, the limits, the token map's length, the pad id, row ids per token");
    check(info.backend == ENGRAM_BACKEND_CPU && info.n_threads == 3, "the backend and thread count");
    check(ids[0] == MM_LAYER && ids[1] == 99 && need[0] == 18 && rows[0] == 0 && tt[0] == ENGRAM_INFO_NO_TYPE &&
              wt[0] == ENGRAM_INFO_NO_TYPE && qt[0] == ENGRAM_INFO_NO_TYPE,
          "an unset layer: its id, rows needed (18), no rows, no types; past n_layers untouched");
    check(info.table_fingerprint != 0, "the table fingerprint");
    const char *names[] = {"portable", "avx2", "avx512", "avx512bf16", "amx"};
    int named = 0;
    for (int i = 0; i < 5; i++)
        if (info.cpu_kernel && strcmp(info.cpu_kernel, names[i]) == 0) named = 1;
    check(named, "the CPU kernel: %s", info.cpu_kernel ? info.cpu_kernel : "NULL");
    /* The note is empty exactly where amx can run, and names amx otherwise. */
    check(info.cpu_kernel_note != NULL &&
              (info.cpu_kernel_note[0] == 0 || strncmp(info.cpu_kernel_note, "amx: ", 5) == 0) &&
              (strcmp(info.cpu_kernel, "amx") != 0 || info.cpu_kernel_note[0] == 0),
          "the kernel note: \"%s\"", info.cpu_kernel_note ? info.cpu_kernel_note : "NULL");

    /* Gate weights: bad inputs, then q * k. */
    float qk[MM_HW + 1];
    qk[0] = 42.0f;
    check(engram_layer_gate_weights(ctx, MM_LAYER, qk, MM_HW) == ENGRAM_STATUS_ERR_NO_WEIGHTS && qk[0] == 42.0f,
          "gate weights of a layer never set: ERR_NO_WEIGHTS");
    mm_fill_table(g_table, 0);
    mm_fill_wkv(g_wkv, 0);
    mm_fill_qk(g_q, g_k);
    engram_layer_weights w = mm_weights(g_table, g_wkv, g_q, g_k);
    check(engram_set_layer(ctx, &w) == ENGRAM_STATUS_OK, "set the layer");
    check(engram_layer_gate_weights(NULL, MM_LAYER, qk, MM_HW) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "(NULL ctx)");
    check(engram_layer_gate_weights(ctx, MM_LAYER, NULL, MM_HW) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "(NULL out)");
    check(engram_layer_gate_weights(ctx, MM_LAYER, qk, MM_HW - 1) == ENGRAM_STATUS_ERR_INVALID_ARGUMENT &&
              qk[0] == 42.0f,
          "a short buffer is ERR_INVALID_ARGUMENT, nothing written");
    check(engram_layer_gate_weights(ctx, 77, qk, MM_HW) == ENGRAM_STATUS_ERR_UNKNOWN_LAYER, "an unknown layer");
    check(engram_layer_gate_weights(ctx, MM_LAYER, qk, MM_HW + 1) == ENGRAM_STATUS_OK, "gate weights");
    int same = 1;
    for (int i = 0; i < MM_HW; i++)
        if (qk[i] != g_q[i] * g_k[i]) same = 0;
    check(same, "the gate weights are q * k");
    check(engram_context_info(ctx, &info) == ENGRAM_STATUS_OK && rows[0] == MM_ROWS &&
              tt[0] == ENGRAM_TYPE_BF16 && wt[0] == ENGRAM_TYPE_F32 && qt[0] == ENGRAM_TYPE_F32,
          "a set layer: its rows and types");

    /* An older, smaller struct is written only as far as it goes. */
    struct {
        engram_info info;
        unsigned char tail[8];
    } big;
    memset(&big, 0xAB, sizeof big);
    engram_info_init_sized(&big.info, sizeof big.info);
    check(engram_context_info(ctx, &big.info) == ENGRAM_STATUS_OK && big.tail[0] == 0xAB && big.tail[7] == 0xAB,
          "nothing written past struct_size");
    /* 0.3's engram_info ended at table_fingerprint: read, and the kernel
     * fields past it left as they were. */
    memset(&big, 0xAB, sizeof big);
    engram_info_init_sized(&big.info, offsetof(engram_info, cpu_kernel));
    check(big.info.struct_size == offsetof(engram_info, cpu_kernel) &&
              engram_context_info(ctx, &big.info) == ENGRAM_STATUS_OK && big.info.hidden_size == MM_D &&
              ((unsigned char *)&big.info.cpu_kernel)[0] == 0xAB && big.tail[0] == 0xAB,
          "the 0.3 layout (up to table_fingerprint) is read and written as far as it goes");
    engram_free(ctx);
}

/* Threads of this process (Linux: /proc/self/task). */
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

static void apply_with(engram_context *ctx, float *hw) {
    int32_t tok[16], seq[16] = {0}, pos[16];
    for (int i = 0; i < 16; i++) {
        tok[i] = (int32_t)((i * 7 + 2) % MM_VOCAB);
        pos[i] = i;
    }
    int64_t ids[16 * MM_C];
    engram_seq_rm(ctx, 0, -1, -1);
    engram_hash(ctx, tok, seq, pos, 16, ids, sizeof ids / sizeof ids[0]);
    mm_fill_highway(hw, 16);
    engram_apply(ctx, MM_LAYER, ids, 16, hw, ENGRAM_TYPE_F32, NULL);
}

static void test_threads(void) {
    engram_config c = mm_config(1, 16, 2);
    engram_context *ctx = NULL;
    if (!check(engram_create(&c, &ctx) == ENGRAM_STATUS_OK, "create a one-thread context")) return;
    engram_layer_weights w = mm_weights(g_table, g_wkv, g_q, g_k);
    engram_set_layer(ctx, &w);
    static float one[16 * MM_HW], many[16 * MM_HW];
    apply_with(ctx, one);
    int base = count_threads();
    check(engram_set_threads(NULL, 4) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "set_threads(NULL)");
    check(engram_set_threads(ctx, 2000) == ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "set_threads(2000) is refused");
    check(engram_set_threads(ctx, 4) == ENGRAM_STATUS_OK, "set_threads(4)");
    check(count_threads() == base + 4, "set_threads(4) started 4 workers (%d threads, %d before)", count_threads(),
          base);
    engram_info info;
    engram_info_init(&info);
    check(engram_context_info(ctx, &info) == ENGRAM_STATUS_OK && info.n_threads == 4, "info says 4 threads");
    apply_with(ctx, many);
    check(memcmp(one, many, sizeof one) == 0, "4 threads give the bits of 1");
    check(engram_set_threads(ctx, 0) == ENGRAM_STATUS_OK && engram_context_info(ctx, &info) == ENGRAM_STATUS_OK &&
              info.n_threads == 1,
          "set_threads(0) is one thread");
    check(count_threads() == base, "and joined the 4 workers before it returned (%d threads)", count_threads());
    apply_with(ctx, many);
    check(memcmp(one, many, sizeof one) == 0, "and back to the same bits");
    engram_free(ctx);
}

/* A context opened from tests/golden/data/tiny.gguf describes itself; the
 * options leave eps 0 (the file's: this file has no key, so 1e-6). */
static void test_from_gguf(void) {
    engram_gguf_options o;
    engram_gguf_options_init(&o);
    check(o.eps == 0.0f, "engram_gguf_options_init: eps 0 (the file's)");
    engram_safetensors_options so;
    engram_safetensors_options_init(&so);
    check(so.eps == 0.0f, "engram_safetensors_options_init: eps 0 (the file's)");
    engram_context *ctx = NULL;
    if (!check(engram_create_from_gguf("tests/golden/data/tiny.gguf", &o, &ctx) == ENGRAM_STATUS_OK,
               "open tiny.gguf"))
        return;
    engram_info info;
    engram_info_init(&info);
    check(engram_context_info(ctx, &info) == ENGRAM_STATUS_OK && info.n_layers >= 1 && info.n_layers <= 8,
          "context_info of a GGUF context: %u layers", info.n_layers);
    uint32_t ids[8], tt[8], wt[8];
    uint64_t rows[8], need[8];
    info.layer_ids = ids;
    info.table_types = tt;
    info.wkv_types = wt;
    info.table_rows = rows;
    info.rows_needed = need;
    info.layers_cap = 8;
    check(engram_context_info(ctx, &info) == ENGRAM_STATUS_OK, "context_info with the layer arrays");
    int ok = info.eps == 1e-6f && info.max_tokens == 4096 && info.max_seqs == 64 && info.hidden_size > 0 &&
             info.cols == (info.max_ngram - 1) * info.n_heads && info.row_ids_per_token == info.n_layers * info.cols;
    for (uint32_t i = 0; i < info.n_layers; i++)
        ok = ok && rows[i] >= need[i] && need[i] > 0 && tt[i] != ENGRAM_INFO_NO_TYPE && wt[i] != ENGRAM_INFO_NO_TYPE;
    check(ok, "eps 1e-6 (no key in the file), the options' limits, every layer set with rows >= rows needed");
    float qk[1];
    check(engram_layer_gate_weights(ctx, ids[0], qk, 1) == ENGRAM_STATUS_ERR_INVALID_ARGUMENT,
          "gate weights into 1 float: ERR_INVALID_ARGUMENT");
    engram_free(ctx);
}

int main(void) {
    test_info();
    test_from_gguf();
    test_threads();
    return check_summary("test_info");
}
