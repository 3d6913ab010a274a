// The ggml peer of the CPU benchmark: the engram forward as llama.cpp's
// DeepSeek-V4.1 graph builds it from ggml ops, against libengram's
// engram_apply, on the same weights (the same bytes in memory: both sides
// borrow them), the same row ids, the same thread count, at the V4.1
// geometry (D 5120, hc 4, Hd 256, H 8, N 4: C 24, wkv [25600, 6144]).
//
// The ggml chain per layer (SPEC.md section 1; the op list of issue 19):
//   rows  = get_rows(table, ids)                 [Hd, C*n] f32 (ggml dequantises)
//   kv    = mul_mat(wkv, reshape(rows, C*Hd, n)) [D*(hc+1), n] f32
//   key   = cont(view(kv, D, hc, n)); value = view(kv, D, n) (the last slice)
//   dot   = scale(sum_rows(mul(mul(rms_norm(h), rms_norm(key)), mul(q, k))), 1/sqrt(D))
//   gate  = sigmoid(mul(sqrt(clamp(abs(dot), 1e-6, inf)), sgn(dot)))
//   out   = add(h, mul(repeat(value, D, hc, n), gate))
// with h the highway [D, hc, n] f32. Table formats: Q8_0 rows (ggml's own
// Q8_0 tensor, the same bytes) and the checkpoint's fp8 e4m3 + e8m0 rows,
// which ggml has no type for: ggml gets the table dequantised to bf16 (exact:
// every value of these rows is a bf16), libengram the fp8 bytes.
//
// Agreement, per cell, on a clean input before timing: the rows (fp8:
// bit-identical to engram_read_back's bf16 rows; Q8_0: within bf16 rounding,
// libengram dequantises to bf16, ggml to f32), kv (ggml keeps it in f32, and
// for the block formats quantises the rows to Q8_0 / Q8_K before the dot
// products; libengram rounds kv to bf16) and the highway. Tolerances:
//   kv:      max |kv_ggml - kv_engram| <= 2^-7 * max |kv_engram| with a bf16
//            wkv (ours rounds kv to bf16: 2^-9; the sums' order), 2^-5 with a
//            block format (ggml quantises the rows to Q8_0 / Q8_K, one scale
//            per 32 / 256 values, so small values of an fp8 row with a wide
//            range lose bits: measured up to 1.4e-2);
//   highway: max |out_ggml - out_engram| <= 2^-3 * max |out_engram - x| (the
//            engram term). Looser, because the gate's signed square root has
//            an unbounded slope at dot = 0: a kv difference that moves a dot
//            of a few thousandths across zero moves that stream's gate by up
//            to 0.25 * sqrt(2 |d dot|), a few hundredths (measured: up to
//            6.3e-2 of the largest term with Q4_K wkv and the fp8 table).
// A wrong formula (a missing sigmoid, sqrt, 1/sqrt(D) or rstd, key and value
// swapped) moves the highway by the order of the term itself.
//
// Timing: the layers (enough of them to exceed 2.4 GB of wkv, so wkv comes
// from memory as in a model) are visited in turn; each repetition runs one
// ggml compute and one engram_apply, alternating, so that a change in the
// machine's load hits both sides alike; each side's timed call follows an
// untimed one of its own (on the next layer), so that its threads are awake
// and the other side's have stopped spinning. Median of the repetitions.
//
// Weights: ggml's wkv sits where llama.cpp puts a CPU weight of its type: in
// the first of the CPU backend's extra buffer types whose mul_mat takes it
// (AMX on a CPU with AMX-INT8, then the repacked layouts: Q4_K on AVX2,
// Q2_K on AVX-512, ...), copied there (and repacked) once per layer; else in
// place, the same bytes libengram reads. ENGRAM_GGML_EXTRA_BUFTS=0 keeps
// every format in place (llama.cpp's --no-repack). Each cell names where.
//
// Usage: ggml_peer THREADS [REPS]   (ENGRAM_BENCH_NS=1,8,64,512,
//        ENGRAM_BENCH_FORMATS=bf16,fp8,q8_0,q4_K,q2_K, ENGRAM_BENCH_TABLES=q8_0,fp8;
//        wkv fp8 is the checkpoint's block-scaled fp8, which ggml gets as bf16)
#include "engram.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

namespace {

constexpr int64_t D = 5120, HC = 4, HD = 256, HEADS = 8, NGRAM = 4;
constexpr int64_t COLS = (NGRAM - 1) * HEADS;  // 24
constexpr int64_t K_IN = COLS * HD;            // 6144
constexpr int64_t K_OUT = D * (HC + 1);        // 25600
constexpr float EPS = 1e-6f;

struct Rng {
    uint64_t s;
    uint64_t next() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        return s;
    }
    uint64_t below(uint64_t n) { return next() % n; }
    float f32() { return (float)((next() >> 40) & 0xffffff) / (float)(1 << 24) * 2.0f - 1.0f; }
};

[[noreturn]] void die(const std::string &m) {
    std::fprintf(stderr, "ggml_peer: %s\n", m.c_str());
    std::exit(1);
}

void *alloc_bytes(size_t n) {
    void *p = std::aligned_alloc(64, (n + 63) / 64 * 64);
    if (!p) die("out of memory (" + std::to_string(n) + " bytes)");
    return p;
}

bool is_prime(uint64_t n) {
    if (n < 2) return false;
    for (uint64_t d = 2; d * d <= n; d++)
        if (n % d == 0) return false;
    return true;
}

uint16_t f32_to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// e4m3 (bias 7, no infinities; 0x7f / 0xff are NaN and never generated here).
float e4m3(uint8_t c) {
    int sign = c >> 7, e = (c >> 3) & 15, m = c & 7;
    float v = e == 0 ? std::ldexp((float)m / 8.0f, -6) : std::ldexp(1.0f + (float)m / 8.0f, e - 7);
    return sign ? -v : v;
}

double now_s() {
    using namespace std::chrono;
    return duration<double>(steady_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<std::string> list_env(const char *name, const char *dflt) {
    const char *v = std::getenv(name);
    std::stringstream ss(v && *v ? v : dflt);
    std::vector<std::string> out;
    std::string item;
    while (std::getline(ss, item, ','))
        if (!item.empty()) out.push_back(item);
    return out;
}

struct WkvFormat {
    std::string name;
    uint32_t engram_type;
    ggml_type gtype;
    // The checkpoint's block-scaled fp8 (libengram reads codes + 128 x 128
    // e8m0 scales in place); ggml has no such type and gets the same values
    // widened to bf16 (exact), `gtype`.
    bool fp8_block = false;
};

constexpr int64_t FP8_BLOCK = 128;

// One layer of block-scaled fp8 wkv: codes (no NaN) and scales 2^-14..2^-11,
// so every value is a normal bf16; and the same values as bf16 for ggml.
void fill_fp8_wkv(uint8_t *codes, uint8_t *scales, uint16_t *bf16, Rng &rng) {
    const int64_t br = (K_OUT + FP8_BLOCK - 1) / FP8_BLOCK, bc = (K_IN + FP8_BLOCK - 1) / FP8_BLOCK;
    for (int64_t i = 0; i < br * bc; i++) scales[i] = (uint8_t)(127 - 14 + rng.below(4));
    for (int64_t r = 0; r < K_OUT; r++)
        for (int64_t c = 0; c < K_IN; c++) {
            uint8_t b = (uint8_t)rng.next();
            if ((b & 0x7f) == 0x7f) b ^= 1;
            codes[r * K_IN + c] = b;
            int s = scales[(r / FP8_BLOCK) * bc + c / FP8_BLOCK];
            bf16[r * K_IN + c] = f32_to_bf16(std::ldexp(e4m3(b), s - 127));  // exact
        }
}

// One layer's wkv bytes in `f`: random, with each block's f16 scales fixed
// small and finite (the way benches/cpu.rs builds them).
void fill_wkv(const WkvFormat &f, uint8_t *p, size_t bytes, Rng &rng) {
    static const uint8_t k_scales[4] = {0x00, 0x1c, 0x00, 0x18};  // f16 2^-8 and 2^-9
    size_t bb = f.gtype == GGML_TYPE_BF16 ? 2 : ggml_type_size(f.gtype);
    for (size_t i = 0; i < bytes; i++) {
        uint8_t b = (uint8_t)rng.next();
        size_t at = i % bb;
        if (f.gtype == GGML_TYPE_Q8_0 && at < 2) b = at == 0 ? 0x00 : 0x1c;
        if (f.gtype == GGML_TYPE_Q2_K && at >= 80) b = k_scales[at - 80];
        if (f.gtype == GGML_TYPE_Q4_K && at < 4) b = k_scales[at];
        if (f.gtype == GGML_TYPE_BF16 && at == 1) b = (uint8_t)(0x3c + (b & 1));
        p[i] = b;
    }
}

struct Model {
    uint32_t nl = 0;
    std::vector<uint32_t> layer_ids;
    std::vector<uint64_t> mult, primes, offsets;
    std::vector<int32_t> token_map;
    uint64_t rows = 0;
    std::vector<float> q, k;
};

Model make_model(uint32_t nl, Rng &rng) {
    Model m;
    m.nl = nl;
    uint64_t p = 4000;
    for (uint32_t l = 0; l < nl; l++) {
        m.layer_ids.push_back(1 + 13 * l);
        uint64_t sum = 0;
        for (int64_t c = 0; c < COLS; c++) {
            do p++;
            while (!is_prime(p));
            m.primes.push_back(p);
            m.offsets.push_back(sum);
            sum += p;
        }
        m.rows = std::max(m.rows, sum);
        for (int64_t i = 0; i < NGRAM; i++) m.mult.push_back(2 * (l * NGRAM + i) + 1);
    }
    for (int i = 0; i < 1000; i++) m.token_map.push_back(i);
    for (int64_t i = 0; i < HC * D; i++) m.q.push_back(1.0f + rng.f32() / 8.0f);
    for (int64_t i = 0; i < HC * D; i++) m.k.push_back(1.0f + rng.f32() / 8.0f);
    return m;
}

engram_context *make_context(const Model &m, uint32_t threads) {
    engram_config c;
    engram_config_init(&c);
    c.hidden_size = D;
    c.hc = HC;
    c.head_dim = HD;
    c.n_heads = HEADS;
    c.max_ngram = NGRAM;
    c.eps = EPS;
    c.layer_ids = m.layer_ids.data();
    c.n_layers = m.nl;
    c.token_map = m.token_map.data();
    c.token_map_len = m.token_map.size();
    c.pad_id = 0;
    c.multipliers = m.mult.data();
    c.n_multipliers = m.mult.size();
    c.primes = m.primes.data();
    c.n_primes = m.primes.size();
    c.offsets = m.offsets.data();
    c.n_offsets = m.offsets.size();
    c.max_tokens = 512;
    c.max_seqs = 1;
    c.max_positions = 1;
    c.n_threads = threads;
    engram_context *ctx = nullptr;
    if (engram_create(&c, &ctx) != ENGRAM_STATUS_OK) die(std::string("engram_create: ") + engram_last_error());
    return ctx;
}

// Where llama.cpp puts a CPU weight of type `t` (llama-model.cpp,
// select_weight_buft): the first extra buffer type of the CPU device whose
// supports_op takes a mul_mat of it by a 512-token f32 batch; nullptr: plain
// host memory (or ENGRAM_GGML_EXTRA_BUFTS=0).
ggml_backend_buffer_type_t weight_buft(ggml_type t) {
    const char *env = std::getenv("ENGRAM_GGML_EXTRA_BUFTS");
    if (env && std::string(env) == "0") return nullptr;
    ggml_backend_reg_t reg = ggml_backend_cpu_reg();
    ggml_backend_dev_t dev = ggml_backend_reg_dev_get(reg, 0);
    auto get = (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(
        reg, "ggml_backend_dev_get_extra_bufts");
    if (!get) return nullptr;
    ggml_init_params p = {ggml_tensor_overhead() * 4, nullptr, true};
    ggml_context *c = ggml_init(p);
    ggml_tensor *w = ggml_new_tensor_2d(c, t, K_IN, K_OUT);
    ggml_tensor *op = ggml_mul_mat(c, w, ggml_new_tensor_2d(c, GGML_TYPE_F32, K_IN, 512));
    ggml_backend_buffer_type_t chosen = nullptr;
    for (ggml_backend_buffer_type_t *b = get(dev); b && *b && !chosen; b++) {
        ggml_backend_buffer_t probe = ggml_backend_buft_alloc_buffer(*b, 0);
        w->buffer = probe;
        if (ggml_backend_dev_supports_op(dev, op)) chosen = *b;
        w->buffer = nullptr;
        ggml_backend_buffer_free(probe);
    }
    ggml_free(c);
    return chosen;
}

// One layer's wkv as ggml reads it: `bytes` in place (buffer nullptr), or a
// tensor of its own in an extra buffer type, set (repacked) from `bytes`.
struct PlacedWkv {
    void *data = nullptr;
    ggml_backend_buffer_t buffer = nullptr;
    void *extra = nullptr;
    ggml_context *ctx = nullptr;
};

PlacedWkv place_wkv(ggml_type t, ggml_backend_buffer_type_t buft, void *bytes) {
    PlacedWkv p;
    p.data = bytes;
    if (!buft) return p;
    ggml_init_params ip = {ggml_tensor_overhead() * 2, nullptr, true};
    p.ctx = ggml_init(ip);
    ggml_tensor *w = ggml_new_tensor_2d(p.ctx, t, K_IN, K_OUT);
    p.buffer = ggml_backend_alloc_ctx_tensors_from_buft(p.ctx, buft);
    if (!p.buffer) die(std::string("cannot allocate wkv in ") + ggml_backend_buft_name(buft));
    ggml_backend_tensor_set(w, bytes, 0, ggml_nbytes(w));
    p.data = w->data;
    p.extra = w->extra;
    return p;
}

void free_placed(PlacedWkv &p) {
    if (p.buffer) ggml_backend_buffer_free(p.buffer);
    if (p.ctx) ggml_free(p.ctx);
    p = PlacedWkv{};
}

// Point the graph's wkv placeholder at one layer's weights.
void point_wkv(ggml_tensor *t, const PlacedWkv &p) {
    t->data = p.data;
    t->buffer = p.buffer;
    t->extra = p.extra;
}

// The graph of one layer's engram forward for n tokens; `wkv`, `ids` and `h`
// are placeholders whose data pointers the caller sets before each compute.
struct Graph {
    ggml_context *ctx = nullptr;
    ggml_cgraph *gf = nullptr;
    ggml_tensor *wkv = nullptr, *ids = nullptr, *h = nullptr, *rows = nullptr, *kv = nullptr, *out = nullptr;
    ggml_cplan plan{};
    std::vector<uint8_t> work;
};

Graph build_graph(int64_t n, ggml_type wkv_type, const PlacedWkv &wkv0, ggml_tensor *table, ggml_tensor *q,
                  ggml_tensor *k, int threads) {
    Graph g;
    size_t mem = ggml_tensor_overhead() * 64 + ggml_graph_overhead() +
                 (size_t)n * (size_t)(COLS * HD + K_OUT + 8 * HC * D) * 4 + (16u << 20);
    ggml_init_params ip = {mem, nullptr, false};
    g.ctx = ggml_init(ip);
    if (!g.ctx) die("ggml_init");
    // Placeholders: their data points at memory the caller owns.
    {
        ggml_init_params np = {ggml_tensor_overhead() * 4, nullptr, true};
        ggml_context *meta = ggml_init(np);
        g.wkv = ggml_new_tensor_2d(meta, wkv_type, K_IN, K_OUT);
        point_wkv(g.wkv, wkv0);  // the plan's work size depends on where wkv is
        g.ids = ggml_new_tensor_1d(meta, GGML_TYPE_I32, COLS * n);
        g.h = ggml_new_tensor_3d(meta, GGML_TYPE_F32, D, HC, n);
        // (meta lives as long as the process: a few hundred bytes per graph.)
    }
    ggml_context *c = g.ctx;
    g.rows = ggml_get_rows(c, table, g.ids);  // [Hd, C*n] f32
    ggml_tensor *flat = ggml_reshape_2d(c, g.rows, COLS * HD, n);
    g.kv = ggml_mul_mat(c, g.wkv, flat);  // [K_OUT, n] f32
    ggml_tensor *key = ggml_cont(c, ggml_view_3d(c, g.kv, D, HC, n, g.kv->nb[0] * D, g.kv->nb[1], 0));
    ggml_tensor *val = ggml_view_2d(c, g.kv, D, n, g.kv->nb[1], g.kv->nb[0] * D * HC);
    ggml_tensor *hn = ggml_rms_norm(c, g.h, EPS);
    ggml_tensor *kn = ggml_rms_norm(c, key, EPS);
    ggml_tensor *w = ggml_mul(c, q, k);  // [D, hc]
    ggml_tensor *dot = ggml_sum_rows(c, ggml_mul(c, ggml_mul(c, hn, kn), w));
    dot = ggml_scale(c, dot, 1.0f / std::sqrt((float)D));  // [1, hc, n]
    ggml_tensor *mag = ggml_sqrt(c, ggml_clamp(c, ggml_abs(c, dot), 1e-6f, INFINITY));
    ggml_tensor *gate = ggml_sigmoid(c, ggml_mul(c, mag, ggml_sgn(c, dot)));
    ggml_tensor *v = ggml_repeat_4d(c, ggml_reshape_3d(c, ggml_cont(c, val), D, 1, n), D, HC, n, 1);
    g.out = ggml_add(c, g.h, ggml_mul(c, v, gate));
    g.gf = ggml_new_graph(c);
    ggml_build_forward_expand(g.gf, g.out);
    g.plan = ggml_graph_plan(g.gf, threads, nullptr);
    g.work.resize(g.plan.work_size + 64);
    g.plan.work_data = g.work.data();
    return g;
}

void compute(Graph &g) {
    if (ggml_graph_compute(g.gf, &g.plan) != GGML_STATUS_SUCCESS) die("ggml_graph_compute");
}

struct Cell {
    std::string wkv, table;
    int64_t n;
    double t_ggml, t_engram, rows_err, kv_err, out_err;
    bool rows_exact;
};

}  // namespace

int main(int argc, char **argv) {
    if (argc < 2) die("usage: ggml_peer THREADS [REPS]");
    const int threads = std::max(1, std::atoi(argv[1]));
    const int reps_arg = argc > 2 ? std::atoi(argv[2]) : 0;
    std::vector<int64_t> ns;
    for (auto &s : list_env("ENGRAM_BENCH_NS", "1,8,64,512")) ns.push_back(std::atoll(s.c_str()));
    const std::vector<WkvFormat> all_formats = {
        {"bf16", ENGRAM_TYPE_BF16, GGML_TYPE_BF16},
        {"q8_0", ENGRAM_TYPE_Q8_0, GGML_TYPE_Q8_0},
        {"q4_K", ENGRAM_TYPE_Q4_K, GGML_TYPE_Q4_K},
        {"q2_K", ENGRAM_TYPE_Q2_K, GGML_TYPE_Q2_K},
        {"fp8", ENGRAM_TYPE_FP8_E4M3_E8M0_BLOCK, GGML_TYPE_BF16, true},
    };
    std::vector<WkvFormat> formats;
    for (auto &s : list_env("ENGRAM_BENCH_FORMATS", "bf16,fp8,q8_0,q4_K,q2_K")) {
        auto it = std::find_if(all_formats.begin(), all_formats.end(), [&](const WkvFormat &f) { return f.name == s; });
        if (it == all_formats.end()) die("unknown wkv format " + s);
        formats.push_back(*it);
    }
    const std::vector<std::string> tables = list_env("ENGRAM_BENCH_TABLES", "q8_0,fp8");
    ggml_cpu_init();
    // ggml's debug lines ("repack: repack tensor ...", one a layer) are not for this output.
    ggml_log_set(
        [](ggml_log_level level, const char *text, void *) {
            static ggml_log_level last = GGML_LOG_LEVEL_INFO;
            if (level != GGML_LOG_LEVEL_CONT) last = level;
            if (last != GGML_LOG_LEVEL_DEBUG) std::fputs(text, stderr);
        },
        nullptr);
    std::printf("# ggml peer: ggml %s (commit %s), libengram %s; %d threads on both sides; V4.1 geometry "
                "(D %lld, hc %lld, C %lld, Hd %lld; wkv [%lld x %lld])\n",
                ggml_version(), ggml_commit(), ENGRAM_VERSION_STRING, threads, (long long)D, (long long)HC,
                (long long)COLS, (long long)HD, (long long)K_OUT, (long long)K_IN);

    Rng rng{0x243f6a8885a308d3ull};
    // Enough layers for the smallest format (each format uses the first ones).
    uint32_t max_nl = 2;
    for (const WkvFormat &f : formats) {
        size_t lb = f.fp8_block ? (size_t)(K_IN * K_OUT) : ggml_row_size(f.gtype, K_IN) * K_OUT;
        max_nl = std::max(max_nl, (uint32_t)((2400000000ull + lb - 1) / lb));
    }
    Model m = make_model(max_nl, rng);
    const uint64_t rows = m.rows;

    // Tables: fp8 (264 bytes a row) and its exact bf16 dequantisation, and Q8_0 (272 bytes a row).
    const size_t fp8_rb = HD + HD / 32;
    uint8_t *fp8 = (uint8_t *)alloc_bytes(rows * fp8_rb);
    uint16_t *fp8_bf16 = (uint16_t *)alloc_bytes(rows * HD * 2);
    for (uint64_t r = 0; r < rows; r++) {
        uint8_t *row = fp8 + r * fp8_rb;
        for (int64_t i = 0; i < HD; i++) {
            uint8_t c = (uint8_t)rng.next();
            row[i] = (c & 0x7f) == 0x7f ? 0 : c;
        }
        for (int64_t b = 0; b < HD / 32; b++) row[HD + b] = (uint8_t)(120 + rng.below(10));
        for (int64_t i = 0; i < HD; i++) {
            float v = std::ldexp(e4m3(row[i]), (int)row[HD + i / 32] - 127);
            fp8_bf16[r * HD + i] = f32_to_bf16(v);  // exact: an e4m3 value times 2^(-7..2)
        }
    }
    const size_t q8_rb = ggml_row_size(GGML_TYPE_Q8_0, HD);
    uint8_t *q8 = (uint8_t *)alloc_bytes(rows * q8_rb);
    for (size_t i = 0; i < rows * q8_rb; i++) {
        size_t at = i % 34;
        q8[i] = at == 0 ? (uint8_t)0x00 : at == 1 ? (uint8_t)0x20 : (uint8_t)rng.next();  // d = 2^-7
    }

    // ggml's views of the shared weights (no copies).
    ggml_init_params wp = {ggml_tensor_overhead() * 8, nullptr, true};
    ggml_context *wctx = ggml_init(wp);
    ggml_tensor *t_fp8 = ggml_new_tensor_2d(wctx, GGML_TYPE_BF16, HD, (int64_t)rows);
    t_fp8->data = fp8_bf16;
    ggml_tensor *t_q8 = ggml_new_tensor_2d(wctx, GGML_TYPE_Q8_0, HD, (int64_t)rows);
    t_q8->data = q8;
    ggml_tensor *t_q = ggml_new_tensor_2d(wctx, GGML_TYPE_F32, D, HC);
    t_q->data = m.q.data();
    ggml_tensor *t_k = ggml_new_tensor_2d(wctx, GGML_TYPE_F32, D, HC);
    t_k->data = m.k.data();

    std::vector<Cell> cells;
    bool all_ok = true;
    for (const WkvFormat &f : formats) {
        // libengram's bytes a layer set the number of layers (ggml's bf16
        // copy of an fp8 wkv is twice that).
        const size_t layer_bytes = ggml_row_size(f.gtype, K_IN) * K_OUT;
        const size_t own_bytes = f.fp8_block ? (size_t)(K_IN * K_OUT) : layer_bytes;
        const uint32_t nl = (uint32_t)std::max<size_t>(2, (2400000000ull + own_bytes - 1) / own_bytes);
        const size_t n_scales = (size_t)(((K_OUT + FP8_BLOCK - 1) / FP8_BLOCK) * ((K_IN + FP8_BLOCK - 1) / FP8_BLOCK));
        Model mf = m;  // the first nl layers of the model
        mf.nl = nl;
        mf.layer_ids.resize(nl);
        mf.primes.resize(nl * COLS);
        mf.offsets.resize(nl * COLS);
        mf.mult.resize(nl * NGRAM);
        // wkv[l]: ggml's weights (and libengram's, but for fp8: codes[l], scales[l]).
        std::vector<uint8_t *> wkv(nl), codes(nl, nullptr), scales(nl, nullptr);
        for (uint32_t l = 0; l < nl; l++) {
            wkv[l] = (uint8_t *)alloc_bytes(layer_bytes);
            if (f.fp8_block) {
                codes[l] = (uint8_t *)alloc_bytes((size_t)(K_IN * K_OUT));
                scales[l] = (uint8_t *)alloc_bytes(n_scales);
                fill_fp8_wkv(codes[l], scales[l], (uint16_t *)wkv[l], rng);
            } else {
                fill_wkv(f, wkv[l], layer_bytes, rng);
            }
        }
        // ggml's view of each layer: in place, or its own copy where llama.cpp would put it.
        ggml_backend_buffer_type_t buft = weight_buft(f.gtype);
        const std::string where = buft ? ggml_backend_buft_name(buft) : "in place";
        std::vector<PlacedWkv> placed(nl);
        for (uint32_t l = 0; l < nl; l++) placed[l] = place_wkv(f.gtype, buft, wkv[l]);
        std::printf("# wkv %s: ggml's weights %s\n", f.name.c_str(), where.c_str());
        for (const std::string &tname : tables) {
            const bool is_fp8 = tname == "fp8";
            if (!is_fp8 && tname != "q8_0") die("unknown table format " + tname);
            engram_context *ctx = make_context(mf, (uint32_t)threads);
            for (uint32_t l = 0; l < nl; l++) {
                engram_layer_weights w;
                engram_layer_weights_init(&w);
                w.layer_id = mf.layer_ids[l];
                w.table_type = is_fp8 ? ENGRAM_TYPE_FP8_E4M3_E8M0 : ENGRAM_TYPE_Q8_0;
                w.table = is_fp8 ? (const void *)fp8 : (const void *)q8;
                w.table_rows = rows;
                w.wkv = f.fp8_block ? codes[l] : wkv[l];
                w.wkv_type = f.engram_type;
                if (f.fp8_block) {
                    w.wkv_scales = scales[l];
                    w.wkv_block_rows = (uint32_t)FP8_BLOCK;
                    w.wkv_block_cols = (uint32_t)FP8_BLOCK;
                }
                w.q = mf.q.data();
                w.k = mf.k.data();
                w.qk_type = ENGRAM_TYPE_F32;
                if (engram_set_layer(ctx, &w) != ENGRAM_STATUS_OK)
                    die(std::string("engram_set_layer: ") + engram_last_error());
            }
            for (int64_t n : ns) {
                // Row ids: [n, nl, C] int64 for libengram; per layer [C*n] int32 for ggml.
                std::vector<int64_t> ids((size_t)(n * nl * COLS));
                for (size_t i = 0; i < ids.size(); i++) {
                    size_t c = i % (size_t)(nl * COLS);
                    ids[i] = (int64_t)(mf.offsets[c] + rng.below(mf.primes[c]));
                }
                std::vector<std::vector<int32_t>> gids(nl, std::vector<int32_t>((size_t)(n * COLS)));
                for (uint32_t l = 0; l < nl; l++)
                    for (int64_t t = 0; t < n; t++)
                        for (int64_t c = 0; c < COLS; c++)
                            gids[l][(size_t)(t * COLS + c)] = (int32_t)ids[(size_t)((t * nl + l) * COLS + c)];
                std::vector<float> x0((size_t)(n * HC * D));
                for (auto &v : x0) v = rng.f32();
                Graph g = build_graph(n, f.gtype, placed[0], is_fp8 ? t_fp8 : t_q8, t_q, t_k, threads);

                // --- agreement, layer 0, clean input ---
                std::vector<float> hg = x0, he = x0;
                point_wkv(g.wkv, placed[0]);
                g.ids->data = gids[0].data();
                g.h->data = hg.data();
                compute(g);
                if (engram_apply(ctx, mf.layer_ids[0], ids.data(), (uint32_t)n, he.data(), ENGRAM_TYPE_F32,
                                 nullptr) != ENGRAM_STATUS_OK)
                    die(std::string("engram_apply: ") + engram_last_error());
                std::vector<uint16_t> rb((size_t)(n * K_IN)), kb((size_t)(n * K_OUT));
                if (engram_read_back(ctx, mf.layer_ids[0], ids.data(), (uint32_t)n, rb.data(), rb.size(), kb.data(),
                                     kb.size()) != ENGRAM_STATUS_OK)
                    die(std::string("engram_read_back: ") + engram_last_error());
                const float *grows = (const float *)g.rows->data, *gkv = (const float *)g.kv->data,
                            *gout = (const float *)g.out->data;
                double rows_err = 0, rows_max = 0, kv_err = 0, kv_max = 0, out_err = 0, term_max = 0;
                bool rows_exact = true;
                for (size_t i = 0; i < rb.size(); i++) {
                    float e = bf16_to_f32(rb[i]);
                    rows_exact = rows_exact && e == grows[i];
                    rows_err = std::max(rows_err, (double)std::fabs(e - grows[i]));
                    rows_max = std::max(rows_max, (double)std::fabs(e));
                }
                for (size_t i = 0; i < kb.size(); i++) {
                    float e = bf16_to_f32(kb[i]);
                    kv_err = std::max(kv_err, (double)std::fabs(e - gkv[i]));
                    kv_max = std::max(kv_max, (double)std::fabs(e));
                }
                for (size_t i = 0; i < he.size(); i++) {
                    out_err = std::max(out_err, (double)std::fabs(he[i] - gout[i]));
                    term_max = std::max(term_max, (double)std::fabs(he[i] - x0[i]));
                }
                Cell cell{f.name, tname, n, 0, 0, rows_err / rows_max, kv_err / kv_max, out_err / term_max,
                          rows_exact};
                const double tol_kv = f.gtype == GGML_TYPE_BF16 ? 1.0 / 128 : 1.0 / 32, tol_out = 1.0 / 8;
                bool ok = (is_fp8 ? rows_exact : cell.rows_err <= 1.0 / 256) && cell.kv_err <= tol_kv &&
                          cell.out_err <= tol_out && term_max > 0;
                if (!ok) {
                    all_ok = false;
                    std::printf("DISAGREE wkv %s table %s n %lld: rows %.3g%s, kv %.3g, out %.3g (bounds: rows %s, "
                                "kv %.3g, out %.3g)\n",
                                f.name.c_str(), tname.c_str(), (long long)n, cell.rows_err,
                                rows_exact ? " (exact)" : "", cell.kv_err, cell.out_err,
                                is_fp8 ? "exact" : "1/256", tol_kv, tol_out);
                }

                // --- timing: layers in turn, ggml and engram alternating ---
                const int reps = reps_arg > 0 ? reps_arg : (n <= 8 ? 15 : n <= 64 ? 7 : 5);
                std::vector<double> tg, te;
                std::vector<float> hw = x0;
                g.h->data = hw.data();
                uint32_t layer = 0;
                // one warm-up of each side
                for (int r = -1; r < reps; r++) {
                    double t2 = 0, t3 = 0;
                    layer = (layer + 1) % nl;
                    point_wkv(g.wkv, placed[layer]);
                    g.ids->data = gids[layer].data();
                    // Each side runs once untimed (the next layer) right
                    // before its timed call: its threads are awake and the
                    // other side's have stopped spinning (ggml's OpenMP
                    // threads spin after a graph; back to back, a 1-token
                    // apply lost ~5 ms to them, while after an idle pause
                    // both sides start from sleeping threads and ggml's
                    // 1-token graphs took 2-4x longer).
                    compute(g);
                    layer = (layer + 1) % nl;
                    point_wkv(g.wkv, placed[layer]);
                    g.ids->data = gids[layer].data();
                    double t0 = now_s();
                    compute(g);
                    double t1 = now_s();
                    for (int pass = 0; pass < 2; pass++) {
                        layer = (layer + 1) % nl;
                        double ta = now_s();
                        if (engram_apply(ctx, mf.layer_ids[layer], ids.data(), (uint32_t)n, hw.data(),
                                         ENGRAM_TYPE_F32, nullptr) != ENGRAM_STATUS_OK)
                            die(std::string("engram_apply: ") + engram_last_error());
                        t2 = ta;
                        t3 = now_s();
                    }
                    if (r >= 0) {
                        tg.push_back(t1 - t0);
                        te.push_back(t3 - t2);
                    }
                }
                cell.t_ggml = median(tg);
                cell.t_engram = median(te);
                std::printf("cell wkv %-4s table %-4s n %3lld: ggml %9.2f ms, engram %9.2f ms, ggml/engram %.2fx "
                            "(median of %d; %u layers in turn) | agreement: rows %s, kv %.2e, out %.2e%s\n",
                            f.name.c_str(), tname.c_str(), (long long)n, cell.t_ggml * 1e3, cell.t_engram * 1e3,
                            cell.t_ggml / cell.t_engram, reps, nl,
                            rows_exact ? "exact" : (std::to_string(cell.rows_err)).c_str(), cell.kv_err, cell.out_err,
                            ok ? "" : " DISAGREE");
                // One line for benches/cpu.rs to read (the line above is for people).
                std::printf("result wkv=%s table=%s n=%lld ggml_ms=%.4f engram_ms=%.4f reps=%d agree=%d weights=%s\n",
                            f.name.c_str(), tname.c_str(), (long long)n, cell.t_ggml * 1e3, cell.t_engram * 1e3, reps,
                            ok ? 1 : 0, buft ? ggml_backend_buft_name(buft) : "in-place");
                std::fflush(stdout);
                cells.push_back(cell);
                ggml_free(g.ctx);
            }
            engram_free(ctx);
        }
        for (auto &p : placed) free_placed(p);
        for (auto *p : wkv) std::free(p);
        for (auto *p : codes) std::free(p);
        for (auto *p : scales) std::free(p);
    }

    // The table: ggml's time over libengram's.
    std::printf("\n## ggml's time over libengram's (median of each; > 1: libengram faster), %d threads\n", threads);
    std::printf("| wkv | table |");
    for (int64_t n : ns) std::printf(" %lld |", (long long)n);
    std::printf("\n|---|---|");
    for (size_t i = 0; i < ns.size(); i++) std::printf("---|");
    std::printf("\n");
    for (size_t i = 0; i < cells.size(); i += ns.size()) {
        std::printf("| %s | %s |", cells[i].wkv == "fp8" ? "fp8 block (ggml: bf16)" : cells[i].wkv.c_str(),
                    cells[i].table == "fp8" ? "fp8 (ggml: bf16)" : "q8_0");
        for (size_t j = 0; j < ns.size() && i + j < cells.size(); j++)
            std::printf(" %.2f |", cells[i + j].t_ggml / cells[i + j].t_engram);
        std::printf("\n");
    }
    std::printf("\nms per layer call, ggml / libengram:\n");
    for (size_t i = 0; i < cells.size(); i += ns.size()) {
        std::printf("| %s | %s |", cells[i].wkv.c_str(), cells[i].table.c_str());
        for (size_t j = 0; j < ns.size() && i + j < cells.size(); j++)
            std::printf(" %.2f / %.2f |", cells[i + j].t_ggml * 1e3, cells[i + j].t_engram * 1e3);
        std::printf("\n");
    }
    double worst_kv = 0, worst_out = 0;
    for (auto &c : cells) {
        worst_kv = std::max(worst_kv, c.kv_err);
        worst_out = std::max(worst_out, c.out_err);
    }
    std::printf("\nagreement: %s; worst kv %.2e of max |kv| (bound 2^-7 bf16 wkv, 2^-5 block formats), worst "
                "highway %.2e of max |engram term| (bound 2^-3); fp8 rows bit-identical, q8_0 rows within 2^-8\n",
                all_ok ? "every cell within the bounds" : "SOME CELLS DISAGREE", worst_kv, worst_out);
    std::free(fp8);
    std::free(fp8_bf16);
    std::free(q8);
    ggml_free(wctx);
    return all_ok ? 0 : 1;
}
