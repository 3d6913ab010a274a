/*
 * The C ABI on the CUDA backend, as an engine uses it: the program makes its
 * own CUDA stream and device buffers with the CUDA runtime, hands engram the
 * device pointers and the stream, and checks the results against the CPU
 * backend of the same library on the same data:
 *   - engram_apply (host row ids) and engram_apply_device_ids, f32 and bf16
 *     highways, a dead token untouched, engram_check;
 *   - the same step captured in a CUDA graph (device row ids) and replayed
 *     gives the same bits as the direct call;
 *   - tables (and wkv) in host memory: engram_prefetch + engram_apply, and a
 *     captured graph replayed after engram_stage of each step; a row that was
 *     not staged is reported;
 *   - engram_create_from_gguf with the CUDA backend (tables stay on the host);
 *   - bad input: a host pointer as the highway, host ids while capturing,
 *     engram_stage's NULLs and capture.
 * Run from the repository root (it reads tests/golden/data/tiny.gguf).
 * Not run by c_tests/run.sh (it needs a GPU and the CUDA toolkit):
 * scripts/gpu-check.sh builds it with
 *   cc -std=c11 -I include -I c_tests -I $CUDA_HOME/include c_tests/cuda/test_cuda_apply.c \
 *      -L target/release -lengram -L $CUDA_HOME/lib64 -lcudart -lm
 */
#include "engram.h"

#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define T_D 64u
#define T_HC 4u
#define T_HD 64u
#define T_H 2u
#define T_N 3u
#define T_C ((T_N - 1u) * T_H)
#define T_LAYERS 2u
#define T_PER (T_LAYERS * T_C)
#define T_KIN (T_C * T_HD)
#define T_KOUT (T_D * (T_HC + 1u))
#define T_HW (T_HC * T_D)
#define T_VOCAB 32u
#define T_TOKENS 12u
#define FP8_ROW (T_HD + T_HD / 32u)

static const uint32_t g_layers[T_LAYERS] = {1, 3};
static int32_t g_token_map[T_VOCAB];
static const uint64_t g_mult[T_LAYERS * T_N] = {
    UINT64_C(0x1f3a5c7e9b2d4f61), UINT64_C(0x0123456789abcdef), UINT64_C(0x7edcba9876543211),
    UINT64_C(0x2468ace013579bdf), UINT64_C(0x5555555555555555), UINT64_C(0xfedcba9876543211),
};
static const uint64_t g_primes[T_LAYERS * T_C] = {101, 103, 107, 109, 113, 127, 131, 137};
static const uint64_t g_offsets[T_LAYERS * T_C] = {0, 101, 204, 311, 0, 113, 240, 371};
#define ROWS_A 420u /* 101+103+107+109 */
#define ROWS_B 508u /* 113+127+131+137 */

static uint64_t g_state = 0x9e3779b97f4a7c15u;
static double unit(void) { /* in [-1, 1) */
    g_state = g_state * UINT64_C(6364136223846793005) + UINT64_C(1442695040888963407);
    return (double)(g_state >> 40) / (double)(1u << 23) - 1.0;
}

static uint16_t bf16(float f) { /* round to nearest even (no NaN here) */
    uint32_t x;
    memcpy(&x, &f, 4);
    x += 0x7FFFu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

static float from_bf16(uint16_t b) {
    uint32_t x = (uint32_t)b << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}

static int cuda_ok(cudaError_t e, const char *what) {
    if (e != cudaSuccess) {
        printf("FAIL %s: %s\n", what, cudaGetErrorString(e));
        exit(1);
    }
    return 1;
}

static void *to_device(const void *host, size_t bytes) {
    void *p = NULL;
    cuda_ok(cudaMalloc(&p, bytes), "cudaMalloc");
    cuda_ok(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
    /* A copy from pageable memory may return before the DMA has landed;
     * engram reads these buffers on a non-blocking stream, which does not wait
     * for the legacy stream: finish the copy here. */
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize after an upload");
    return p;
}

static engram_config config(uint32_t backend) {
    engram_config c;
    engram_config_init(&c);
    c.backend = backend;
    c.device = 0;
    c.hidden_size = T_D;
    c.hc = T_HC;
    c.head_dim = T_HD;
    c.n_heads = T_H;
    c.max_ngram = T_N;
    c.layer_ids = g_layers;
    c.n_layers = T_LAYERS;
    c.token_map = g_token_map;
    c.token_map_len = T_VOCAB;
    c.pad_id = 2;
    c.multipliers = g_mult;
    c.n_multipliers = T_LAYERS * T_N;
    c.primes = g_primes;
    c.n_primes = T_LAYERS * T_C;
    c.offsets = g_offsets;
    c.n_offsets = T_LAYERS * T_C;
    c.max_tokens = 64;
    c.max_seqs = 2;
    c.max_positions = 64;
    c.n_threads = 1;
    return c;
}

static void must(int st, const char *what) {
    if (st != ENGRAM_STATUS_OK) {
        printf("FAIL %s: %d (%s): %s\n", what, st, engram_status_str(st), engram_last_error());
        exit(1);
    }
}

/* Host and device copies of one layer's weights. */
struct layer {
    uint32_t id;
    uint32_t table_type, wkv_type;
    void *table, *wkv, *q, *k;
    void *d_table, *d_wkv, *d_q, *d_k;
    size_t table_bytes, wkv_bytes, qk_bytes;
    uint64_t rows;
};

static void build(struct layer *l, uint32_t id, int fp8_table, int f32_wkv, uint64_t rows) {
    l->id = id;
    l->rows = rows;
    l->table_type = fp8_table ? ENGRAM_TYPE_FP8_E4M3_E8M0 : ENGRAM_TYPE_BF16;
    l->wkv_type = f32_wkv ? ENGRAM_TYPE_F32 : ENGRAM_TYPE_BF16;
    l->table_bytes = rows * (fp8_table ? FP8_ROW : 2u * T_HD);
    uint8_t *t = (uint8_t *)malloc(l->table_bytes);
    if (fp8_table) {
        for (uint64_t r = 0; r < rows; r++) {
            for (uint32_t i = 0; i < T_HD; i++) {
                uint8_t c = (uint8_t)(g_state >> 56);
                (void)unit();
                t[r * FP8_ROW + i] = (c & 0x7Fu) == 0x7Fu ? (uint8_t)(c ^ 1u) : c;
            }
            for (uint32_t b = 0; b < T_HD / 32u; b++) t[r * FP8_ROW + T_HD + b] = (uint8_t)(124u + r % 6u);
        }
    } else {
        uint16_t *v = (uint16_t *)t;
        for (uint64_t i = 0; i < rows * T_HD; i++) v[i] = bf16((float)unit());
    }
    l->table = t;
    size_t nw = (size_t)T_KOUT * T_KIN;
    if (f32_wkv) {
        float *w = (float *)malloc(nw * 4);
        for (size_t i = 0; i < nw; i++) w[i] = (float)(unit() / 16.0);
        l->wkv = w;
        l->wkv_bytes = nw * 4;
    } else {
        uint16_t *w = (uint16_t *)malloc(nw * 2);
        for (size_t i = 0; i < nw; i++) w[i] = bf16((float)(unit() / 16.0));
        l->wkv = w;
        l->wkv_bytes = nw * 2;
    }
    uint16_t *q = (uint16_t *)malloc(T_HW * 2), *k = (uint16_t *)malloc(T_HW * 2);
    for (uint32_t i = 0; i < T_HW; i++) {
        q[i] = bf16((float)(1.0 + unit() / 8.0));
        k[i] = bf16((float)(1.0 + unit() / 8.0));
    }
    l->q = q;
    l->k = k;
    l->qk_bytes = T_HW * 2;
    l->d_table = to_device(l->table, l->table_bytes);
    l->d_wkv = to_device(l->wkv, l->wkv_bytes);
    l->d_q = to_device(l->q, l->qk_bytes);
    l->d_k = to_device(l->k, l->qk_bytes);
}

static void set_layer(engram_context *ctx, const struct layer *l, int device) {
    engram_layer_weights w;
    engram_layer_weights_init(&w);
    w.layer_id = l->id;
    w.table_type = l->table_type;
    w.table = device ? l->d_table : l->table;
    w.table_rows = l->rows;
    w.wkv = device ? l->d_wkv : l->wkv;
    w.wkv_type = l->wkv_type;
    w.q = device ? l->d_q : l->q;
    w.k = device ? l->d_k : l->k;
    w.qk_type = ENGRAM_TYPE_BF16;
    must((int)engram_set_layer(ctx, &w), device ? "set_layer (CUDA)" : "set_layer (CPU)");
}

/* |gpu - cpu| within 2% of the token's largest update (kv may differ by a
 * bf16 ulp: the sums run in another order), plus a few f32 ulps of x. */
static int close_enough(const float *gpu, const float *cpu, const float *in, uint32_t t) {
    double big = 0;
    for (uint32_t i = 0; i < T_HW; i++) big = fmax(big, fabs((double)cpu[t * T_HW + i] - in[t * T_HW + i]));
    for (uint32_t i = 0; i < T_HW; i++) {
        double e = fabs((double)gpu[t * T_HW + i] - cpu[t * T_HW + i]);
        if (e > 0.02 * big + 1e-6 * fabs((double)in[t * T_HW + i])) {
            note("token %u value %u: gpu %.9g cpu %.9g (largest update %.3g)", t, i, gpu[t * T_HW + i],
                 cpu[t * T_HW + i], big);
            return 0;
        }
    }
    return 1;
}

int main(void) {
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev < 1) {
        printf("FAIL no CUDA device (this test needs one)\n");
        return 1;
    }
    cuda_ok(cudaSetDevice(0), "cudaSetDevice");
    cudaStream_t stream;
    cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    for (uint32_t i = 0; i < T_VOCAB; i++) g_token_map[i] = (int32_t)((i * 7u + 3u) % 29u);
    g_token_map[5] = -1;

    struct layer layers[T_LAYERS];
    build(&layers[0], 1, 1, 0, ROWS_A); /* fp8 table, bf16 wkv */
    build(&layers[1], 3, 0, 1, ROWS_B); /* bf16 table, f32 wkv */

    engram_config cc = config(ENGRAM_BACKEND_CPU), gc = config(ENGRAM_BACKEND_CUDA);
    engram_context *cpu = NULL, *gpu = NULL;
    must((int)engram_create(&cc, &cpu), "create CPU");
    must((int)engram_create(&gc, &gpu), "create CUDA");
    check(1, "created a CUDA context on device 0 (of %d)", n_dev);
    for (uint32_t l = 0; l < T_LAYERS; l++) {
        set_layer(cpu, &layers[l], 0);
        set_layer(gpu, &layers[l], 1);
    }

    /* One prefill of 12 tokens, one of them dead (ENGRAM_TOKEN_DEAD). */
    int32_t tok[T_TOKENS], seq[T_TOKENS], pos[T_TOKENS];
    for (uint32_t t = 0; t < T_TOKENS; t++) {
        tok[t] = (int32_t)((t * 11u + 1u) % T_VOCAB);
        seq[t] = 0;
        pos[t] = (int32_t)t;
    }
    tok[6] = ENGRAM_TOKEN_DEAD;
    int64_t ids[T_TOKENS * T_PER];
    must((int)engram_hash(cpu, tok, seq, pos, T_TOKENS, ids, T_TOKENS * T_PER), "hash");
    int64_t ids_gpu[T_TOKENS * T_PER];
    must((int)engram_hash(gpu, tok, seq, pos, T_TOKENS, ids_gpu, T_TOKENS * T_PER), "hash (CUDA context)");
    check(memcmp(ids, ids_gpu, sizeof ids) == 0, "the CUDA context hashes like the CPU one");
    int64_t *d_ids = (int64_t *)to_device(ids, sizeof ids);

    static float in[T_TOKENS * T_HW], want[T_TOKENS * T_HW], got[T_TOKENS * T_HW];
    for (uint32_t i = 0; i < T_TOKENS * T_HW; i++) in[i] = (float)unit();
    memcpy(want, in, sizeof in);
    for (uint32_t l = 0; l < T_LAYERS; l++)
        must((int)engram_apply(cpu, g_layers[l], ids, T_TOKENS, want, ENGRAM_TYPE_F32, NULL), "apply CPU");

    /* f32 highway, host ids then device ids, on our stream. */
    for (int dev_ids = 0; dev_ids < 2; dev_ids++) {
        float *d_hw = (float *)to_device(in, sizeof in);
        for (uint32_t l = 0; l < T_LAYERS; l++) {
            int st = dev_ids ? (int)engram_apply_device_ids(gpu, g_layers[l], d_ids, T_TOKENS, d_hw,
                                                            ENGRAM_TYPE_F32, (void *)stream)
                             : (int)engram_apply(gpu, g_layers[l], ids, T_TOKENS, d_hw, ENGRAM_TYPE_F32,
                                                 (void *)stream);
            check(st == ENGRAM_STATUS_OK, "apply layer %u on CUDA (%s ids): %s", g_layers[l],
                  dev_ids ? "device" : "host", st ? engram_last_error() : "ok");
        }
        check(engram_check(gpu, (void *)stream) == ENGRAM_STATUS_OK, "engram_check after the step: %s",
              engram_last_error());
        cuda_ok(cudaMemcpy(got, d_hw, sizeof got, cudaMemcpyDeviceToHost), "D2H");
        int dead_same = memcmp(&got[6 * T_HW], &in[6 * T_HW], T_HW * 4) == 0;
        check(dead_same, "%s ids: the dead token is untouched (bits)", dev_ids ? "device" : "host");
        int all = 1;
        for (uint32_t t = 0; t < T_TOKENS; t++)
            if (t != 6) all &= close_enough(got, want, in, t);
        check(all, "%s ids: f32 highway matches the CPU backend", dev_ids ? "device" : "host");
        cudaFree(d_hw);
    }

    /* bf16 highway. */
    {
        static uint16_t hb[T_TOKENS * T_HW], hb_got[T_TOKENS * T_HW];
        static float hb_in[T_TOKENS * T_HW], hb_want[T_TOKENS * T_HW], hb_gotf[T_TOKENS * T_HW];
        for (uint32_t i = 0; i < T_TOKENS * T_HW; i++) {
            hb[i] = bf16(in[i]);
            hb_in[i] = from_bf16(hb[i]);
        }
        static uint16_t hb_cpu[T_TOKENS * T_HW];
        memcpy(hb_cpu, hb, sizeof hb);
        for (uint32_t l = 0; l < T_LAYERS; l++)
            must((int)engram_apply(cpu, g_layers[l], ids, T_TOKENS, hb_cpu, ENGRAM_TYPE_BF16, NULL), "apply CPU bf16");
        uint16_t *d_hb = (uint16_t *)to_device(hb, sizeof hb);
        for (uint32_t l = 0; l < T_LAYERS; l++)
            must((int)engram_apply(gpu, g_layers[l], ids, T_TOKENS, d_hb, ENGRAM_TYPE_BF16, (void *)stream),
                 "apply CUDA bf16");
        cuda_ok(cudaStreamSynchronize(stream), "sync");
        cuda_ok(cudaMemcpy(hb_got, d_hb, sizeof hb_got, cudaMemcpyDeviceToHost), "D2H");
        for (uint32_t i = 0; i < T_TOKENS * T_HW; i++) {
            hb_want[i] = from_bf16(hb_cpu[i]);
            hb_gotf[i] = from_bf16(hb_got[i]);
        }
        check(memcmp(&hb_got[6 * T_HW], &hb[6 * T_HW], T_HW * 2) == 0, "bf16: the dead token is untouched");
        int all = 1;
        for (uint32_t t = 0; t < T_TOKENS; t++)
            if (t != 6) all &= close_enough(hb_gotf, hb_want, hb_in, t);
        check(all, "bf16 highway matches the CPU backend (within a bf16 ulp of the update)");
        cudaFree(d_hb);
    }

    /* The step captured in a CUDA graph, replayed: the same bits as direct. */
    {
        float *d_direct = (float *)to_device(in, sizeof in);
        for (uint32_t l = 0; l < T_LAYERS; l++)
            must((int)engram_apply_device_ids(gpu, g_layers[l], d_ids, T_TOKENS, d_direct, ENGRAM_TYPE_F32,
                                              (void *)stream),
                 "direct apply");
        static float direct[T_TOKENS * T_HW];
        cuda_ok(cudaStreamSynchronize(stream), "sync");
        cuda_ok(cudaMemcpy(direct, d_direct, sizeof direct, cudaMemcpyDeviceToHost), "D2H");
        float *d_hw = (float *)to_device(in, sizeof in);
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
        int st = (int)engram_apply(gpu, g_layers[0], ids, T_TOKENS, d_hw, ENGRAM_TYPE_F32, (void *)stream);
        check(st == ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "host row ids while capturing: ERR_INVALID_ARGUMENT (%s)",
              engram_last_error());
        for (uint32_t l = 0; l < T_LAYERS; l++) {
            st = (int)engram_apply_device_ids(gpu, g_layers[l], d_ids, T_TOKENS, d_hw, ENGRAM_TYPE_F32,
                                              (void *)stream);
            check(st == ENGRAM_STATUS_OK, "captured apply_device_ids layer %u: %s", g_layers[l],
                  st ? engram_last_error() : "ok");
        }
        cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
        cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
        for (int rep = 0; rep < 3; rep++) {
            cuda_ok(cudaMemcpyAsync(d_hw, in, sizeof in, cudaMemcpyHostToDevice, stream), "reset highway");
            cuda_ok(cudaGraphLaunch(exec, stream), "graph launch");
            cuda_ok(cudaStreamSynchronize(stream), "sync");
            cuda_ok(cudaMemcpy(got, d_hw, sizeof got, cudaMemcpyDeviceToHost), "D2H");
            check(memcmp(got, direct, sizeof got) == 0, "graph replay %d: the same bits as the direct apply", rep);
        }
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        cudaFree(d_hw);
        cudaFree(d_direct);
    }

    /* Tables, wkv, q and k in host memory (pageable): the CUDA backend
     * gathers rows on the host and copies them to the device. */
    {
        engram_context *h = NULL;
        must((int)engram_create(&gc, &h), "create CUDA (host tables)");
        for (uint32_t l = 0; l < T_LAYERS; l++) set_layer(h, &layers[l], 0);
        check(1, "set_layer with host tables and host wkv on a CUDA context");
        float *d_hw = (float *)to_device(in, sizeof in);
        must((int)engram_prefetch(h, g_layers[0], ids, T_TOKENS), "prefetch layer 1 (host table)");
        for (uint32_t l = 0; l < T_LAYERS; l++) {
            int st = (int)engram_apply(h, g_layers[l], ids, T_TOKENS, d_hw, ENGRAM_TYPE_F32, (void *)stream);
            check(st == ENGRAM_STATUS_OK, "apply layer %u, host table: %s", g_layers[l], st ? engram_last_error() : "ok");
        }
        check(engram_check(h, (void *)stream) == ENGRAM_STATUS_OK, "engram_check (host tables)");
        cuda_ok(cudaMemcpy(got, d_hw, sizeof got, cudaMemcpyDeviceToHost), "D2H");
        int all = memcmp(&got[6 * T_HW], &in[6 * T_HW], T_HW * 4) == 0;
        for (uint32_t t = 0; t < T_TOKENS; t++)
            if (t != 6) all &= close_enough(got, want, in, t);
        check(all, "host tables: f32 highway matches the CPU backend, the dead token untouched");
        static float direct[T_TOKENS * T_HW];
        memcpy(direct, got, sizeof got);

        /* The graph: captured with device ids; each replay after engram_stage. */
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        cuda_ok(cudaMemcpy(d_hw, in, sizeof in, cudaMemcpyHostToDevice), "reset");
        cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
        int st = (int)engram_stage(h, g_layers[0], ids, T_TOKENS, (void *)stream);
        check(st == ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "engram_stage while capturing: ERR_INVALID_ARGUMENT (%s)",
              engram_last_error());
        for (uint32_t l = 0; l < T_LAYERS; l++) {
            st = (int)engram_apply_device_ids(h, g_layers[l], d_ids, T_TOKENS, d_hw, ENGRAM_TYPE_F32, (void *)stream);
            check(st == ENGRAM_STATUS_OK, "captured apply_device_ids, host table, layer %u: %s", g_layers[l],
                  st ? engram_last_error() : "ok");
        }
        cuda_ok(cudaStreamEndCapture(stream, &graph), "end capture");
        cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
        for (int rep = 0; rep < 3; rep++) {
            cuda_ok(cudaMemcpyAsync(d_hw, in, sizeof in, cudaMemcpyHostToDevice, stream), "reset highway");
            for (uint32_t l = 0; l < T_LAYERS; l++)
                must((int)engram_stage(h, g_layers[l], ids, T_TOKENS, (void *)stream), "engram_stage");
            cuda_ok(cudaGraphLaunch(exec, stream), "graph launch");
            cuda_ok(cudaStreamSynchronize(stream), "sync");
            cuda_ok(cudaMemcpy(got, d_hw, sizeof got, cudaMemcpyDeviceToHost), "D2H");
            check(memcmp(got, direct, sizeof got) == 0, "host tables, graph replay %d after engram_stage: the same bits",
                  rep);
        }
        /* Stage one step, replay with other ids: reported, tokens untouched. */
        int64_t other[T_TOKENS * T_PER];
        for (uint32_t t = 0; t < T_TOKENS; t++)
            memcpy(&other[t * T_PER], &ids[((t + 1) % T_TOKENS) * T_PER], T_PER * sizeof(int64_t));
        for (uint32_t l = 0; l < T_LAYERS; l++)
            must((int)engram_stage(h, g_layers[l], other, T_TOKENS, (void *)stream), "engram_stage (other ids)");
        cuda_ok(cudaGraphLaunch(exec, stream), "graph launch");
        st = (int)engram_check(h, (void *)stream);
        check(st == ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "rows not staged for the replayed ids: reported (%s)",
              engram_last_error());
        check(engram_check(h, (void *)stream) == ENGRAM_STATUS_OK, "reported once");
        cudaGraphExecDestroy(exec);
        cudaGraphDestroy(graph);
        /* engram_stage's bad input. */
        check(engram_stage(NULL, 1, ids, T_TOKENS, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "engram_stage: NULL ctx");
        check(engram_stage(h, 1, NULL, T_TOKENS, NULL) == ENGRAM_STATUS_ERR_NULL_ARGUMENT, "engram_stage: NULL row_ids");
        check(engram_stage(h, 2, ids, T_TOKENS, NULL) == ENGRAM_STATUS_ERR_UNKNOWN_LAYER, "engram_stage: unknown layer");
        check(engram_stage(h, 1, ids, 65, NULL) == ENGRAM_STATUS_ERR_CAPACITY, "engram_stage: more than max_tokens");
        check(engram_stage(gpu, 1, ids, T_TOKENS, (void *)stream) == ENGRAM_STATUS_OK,
              "engram_stage on a device table: nothing to do");
        cudaFree(d_hw);
        engram_free(h);
    }

    /* A GGUF file on the CUDA backend: tables read from the file on the host. */
    {
        engram_gguf_options o;
        engram_gguf_options_init(&o);
        o.max_tokens = 64;
        o.max_seqs = 4;
        o.max_positions = 256;
        engram_context *gc_cpu = NULL, *gc_gpu = NULL;
        must((int)engram_create_from_gguf("tests/golden/data/tiny.gguf", &o, &gc_cpu), "tiny.gguf on the CPU");
        o.backend = ENGRAM_BACKEND_CUDA;
        int st = (int)engram_create_from_gguf("tests/golden/data/tiny.gguf", &o, &gc_gpu);
        check(st == ENGRAM_STATUS_OK, "engram_create_from_gguf with ENGRAM_BACKEND_CUDA: %s",
              st ? engram_last_error() : "ok");
        if (gc_cpu && gc_gpu) {
            size_t per = engram_row_ids_per_token(gc_cpu);
            int32_t gtok[8], gseq[8], gpos[8];
            for (int t = 0; t < 8; t++) {
                gtok[t] = (t * 5 + 1) % 40;
                gseq[t] = 0;
                gpos[t] = t;
            }
            int64_t *gids = (int64_t *)malloc(8 * per * sizeof(int64_t));
            must((int)engram_hash(gc_cpu, gtok, gseq, gpos, 8, gids, 8 * per), "hash (gguf)");
            static float g_in[8 * T_HW], g_want[8 * T_HW], g_got[8 * T_HW];
            for (int i = 0; i < 8 * (int)T_HW; i++) g_in[i] = (float)unit();
            memcpy(g_want, g_in, sizeof g_in);
            float *d_g = (float *)to_device(g_in, sizeof g_in);
            must((int)engram_apply(gc_cpu, 1, gids, 8, g_want, ENGRAM_TYPE_F32, NULL), "gguf apply (CPU)");
            must((int)engram_apply(gc_gpu, 1, gids, 8, d_g, ENGRAM_TYPE_F32, (void *)stream), "gguf apply (CUDA)");
            must((int)engram_check(gc_gpu, (void *)stream), "engram_check (gguf)");
            cuda_ok(cudaMemcpy(g_got, d_g, sizeof g_got, cudaMemcpyDeviceToHost), "D2H");
            int all = 1;
            for (uint32_t t = 0; t < 8; t++) all &= close_enough(g_got, g_want, g_in, t);
            check(all, "tiny.gguf on CUDA: layer 1 matches the CPU backend");
            cudaFree(d_g);
            free(gids);
        }
        engram_free(gc_gpu);
        engram_free(gc_cpu);
    }

    /* Bad input. */
    {
        int st = (int)engram_apply(gpu, g_layers[0], ids, T_TOKENS, in, ENGRAM_TYPE_F32, (void *)stream);
        check(st == ENGRAM_STATUS_ERR_INVALID_ARGUMENT, "a host pointer as the highway: ERR_INVALID_ARGUMENT (%s)",
              engram_last_error());
        st = (int)engram_apply(gpu, 2, ids, T_TOKENS, in, ENGRAM_TYPE_F32, (void *)stream);
        check(st == ENGRAM_STATUS_ERR_UNKNOWN_LAYER, "layer 2: ERR_UNKNOWN_LAYER");
        check(engram_check(gpu, (void *)stream) == ENGRAM_STATUS_OK, "engram_check after the bad calls");
    }

    engram_free(gpu);
    engram_free(cpu);
    cudaFree(d_ids);
    for (uint32_t l = 0; l < T_LAYERS; l++) {
        cudaFree(layers[l].d_table);
        cudaFree(layers[l].d_wkv);
        cudaFree(layers[l].d_q);
        cudaFree(layers[l].d_k);
        free(layers[l].table);
        free(layers[l].wkv);
        free(layers[l].q);
        free(layers[l].k);
    }
    cudaStreamDestroy(stream);
    return check_summary("test_cuda_apply");
}
