// A C++17 host that uses engram the way a llama.cpp-style engine does: one
// context for the model, one batch per step holding tokens of several
// sequences (each with its own position), the engram layers applied inside the
// layer loop, speculative drafts rolled back, a sequence forked from another's
// prefix and freed.
//
// The model is a tiny one built here (deterministic weights, two engram
// layers). At the end every accepted token is checked against a second
// context, on the CPU backend, that runs each sequence straight through in one
// call: the row ids must be equal and (CPU build) the highway bit-equal.
// Prints PASS or FAIL and exits 0 or 1.
//
// Built with -DENGRAM_EXAMPLE_CUDA=ON (CMake) the engine context uses the CUDA
// backend: the program allocates its own device buffers (weights, highway) and
// its own cudaStream_t and passes them in; the check then compares with the
// CPU context within a tolerance. If engram_create refuses the CUDA backend
// as unsupported (ENGRAM_STATUS_ERR_UNSUPPORTED) it prints SKIP and exits 77.

#include <engram.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#ifdef ENGRAM_EXAMPLE_CUDA
#include <cuda_runtime.h>
#endif

namespace {

// ---------------------------------------------------------------------------
// Errors

struct EngramError : std::runtime_error {
    engram_status status;
    EngramError(engram_status s, const std::string& what)
        : std::runtime_error(what + ": " + engram_status_str(s) + ": " + engram_last_error()),
          status(s) {}
};

void check(engram_status s, const char* what) {
    if (s != ENGRAM_STATUS_OK) throw EngramError(s, what);
}

#ifdef ENGRAM_EXAMPLE_CUDA
void cuda_check(cudaError_t e, const char* what) {
    if (e != cudaSuccess)
        throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
#define CUDA_CHECK(call) cuda_check((call), #call)
#endif

// ---------------------------------------------------------------------------
// The tiny model: D = 128, hc = 4, Hd = 64, 2-grams and 3-grams with 4 heads
// each (C = 8 row ids per token per engram layer), 16 model layers of which 1
// and 14 are engram layers, a 1000-token vocabulary compressed to 700 ids
// where tokens 990..999 are image tokens (map entry -1: dead).

constexpr uint32_t kD = 128, kHc = 4, kHd = 64, kNgram = 3, kHeads = 4;
constexpr uint32_t kCols = (kNgram - 1) * kHeads;
constexpr uint32_t kModelLayers = 16;
constexpr uint32_t kVocab = 1000, kFirstImageToken = 990;
constexpr uint32_t kMaxTokens = 16, kMaxSeqs = 4, kMaxPositions = 64;
const std::vector<uint32_t> kEngramLayers = {1, 14};

// A small deterministic generator (splitmix64 finaliser) in [-1, 1).
float noise(uint64_t seed, uint64_t i) {
    uint64_t z = (seed * 0x9e3779b97f4a7c15ull) ^ (i + 0x632be59bd9b4e019ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return static_cast<float>(z >> 40) / static_cast<float>(1u << 24) * 2.0f - 1.0f;
}

uint32_t f32_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u;
}

// f32 -> bf16, round to nearest even (the data here has no NaNs).
uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

bool is_prime(uint64_t n) {
    if (n < 2) return false;
    for (uint64_t d = 2; d * d <= n; ++d)
        if (n % d == 0) return false;
    return true;
}

// SPEC section 3's primes: per layer, per n-gram size, per head, the next prime
// above the last one (restarting at vocab - 1 for each n-gram size) that no
// earlier column took.
std::vector<uint64_t> derive_primes(size_t n_layers, uint64_t vocab) {
    std::vector<uint64_t> out;
    for (size_t l = 0; l < n_layers; ++l)
        for (uint32_t k = 1; k < kNgram; ++k) {
            uint64_t cur = vocab - 1;
            for (uint32_t h = 0; h < kHeads; ++h) {
                uint64_t c = cur + 1;
                while (!is_prime(c) || std::find(out.begin(), out.end(), c) != out.end()) ++c;
                out.push_back(c);
                cur = c;
            }
        }
    return out;
}

struct LayerWeights {
    uint64_t rows = 0;
    std::vector<uint16_t> table;  // [rows, Hd] bf16
    std::vector<uint16_t> wkv;    // [D*(hc+1), C*Hd] bf16
    std::vector<float> q, k;      // [hc, D] f32
};

struct TinyModel {
    std::vector<int32_t> token_map;
    std::vector<uint64_t> multipliers, primes, offsets;
    std::vector<LayerWeights> layers;  // in kEngramLayers order

    TinyModel() {
        for (uint32_t t = 0; t < kVocab; ++t)
            token_map.push_back(t >= kFirstImageToken ? -1 : static_cast<int32_t>(t % 700));
        for (uint64_t i = 0; i < kEngramLayers.size() * kNgram; ++i)
            multipliers.push_back((static_cast<uint64_t>(f32_bits(noise(7, i))) << 20) * 2 + 1);
        primes = derive_primes(kEngramLayers.size(), 2000);
        offsets.resize(primes.size());
        for (size_t l = 0; l < kEngramLayers.size(); ++l) {
            LayerWeights w;
            for (uint32_t c = 0; c < kCols; ++c) {  // per-layer exclusive prefix sums
                offsets[l * kCols + c] = w.rows;
                w.rows += primes[l * kCols + c];
            }
            w.table.resize(w.rows * kHd);
            for (size_t i = 0; i < w.table.size(); ++i) w.table[i] = f32_to_bf16(noise(100 + l, i));
            w.wkv.resize(size_t{kD} * (kHc + 1) * kCols * kHd);
            for (size_t i = 0; i < w.wkv.size(); ++i) w.wkv[i] = f32_to_bf16(noise(200 + l, i) / 16.0f);
            for (size_t i = 0; i < size_t{kHc} * kD; ++i) {
                w.q.push_back(1.0f + noise(300 + l, i) / 8.0f);
                w.k.push_back(1.0f + noise(400 + l, i) / 8.0f);
            }
            layers.push_back(std::move(w));
        }
    }

    // The config borrows the model's arrays only during engram_create.
    engram_config config(uint32_t backend, uint32_t n_threads) const {
        engram_config cfg;
        engram_config_init(&cfg);
        cfg.backend = backend;
        cfg.device = 0;
        cfg.hidden_size = kD;
        cfg.hc = kHc;
        cfg.head_dim = kHd;
        cfg.n_heads = kHeads;
        cfg.max_ngram = kNgram;
        cfg.layer_ids = kEngramLayers.data();
        cfg.n_layers = static_cast<uint32_t>(kEngramLayers.size());
        cfg.token_map = token_map.data();
        cfg.token_map_len = token_map.size();
        cfg.pad_id = token_map[2];
        cfg.multipliers = multipliers.data();
        cfg.n_multipliers = multipliers.size();
        cfg.primes = primes.data();
        cfg.n_primes = primes.size();
        cfg.offsets = offsets.data();
        cfg.n_offsets = offsets.size();
        cfg.max_tokens = kMaxTokens;
        cfg.max_seqs = kMaxSeqs;
        cfg.max_positions = kMaxPositions;
        cfg.n_threads = n_threads;
        return cfg;
    }

    // The highway a token enters the layer loop with (its "embedding"; for an
    // image token the vision encoder's output in a real engine).
    static void embed(int32_t token, float* out) {
        for (uint32_t i = 0; i < kHc * kD; ++i)
            out[i] = noise(999, static_cast<uint64_t>(token) * kHc * kD + i);
    }
};

// The toy LM head: the next token is a function of the token's final highway
// (FNV-1a over its bits), never an image token.
int32_t sample(const float* highway) {
    uint32_t h = 2166136261u;
    for (uint32_t i = 0; i < kHc * kD; ++i) h = (h ^ f32_bits(highway[i])) * 16777619u;
    return static_cast<int32_t>(h % kFirstImageToken);
}

// ---------------------------------------------------------------------------
// Device memory helpers (CUDA build only)

#ifdef ENGRAM_EXAMPLE_CUDA
// The backend the device build asks for. Overriding it (to ENGRAM_BACKEND_CPU,
// with a host-memory stand-in for the CUDA runtime) tests this file's device
// path without a GPU.
#ifndef ENGRAM_EXAMPLE_DEVICE_BACKEND
#define ENGRAM_EXAMPLE_DEVICE_BACKEND ENGRAM_BACKEND_CUDA
#endif

template <class T>
class DeviceBuffer {
  public:
    explicit DeviceBuffer(size_t n) : n_(n) { CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), n * sizeof(T))); }
    explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
        CUDA_CHECK(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
    }
    ~DeviceBuffer() { cudaFree(p_); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    T* get() const { return p_; }

  private:
    T* p_ = nullptr;
    size_t n_;
};

// Page-locked host memory, so that copies queued on a stream are asynchronous.
template <class T>
class PinnedBuffer {
  public:
    explicit PinnedBuffer(size_t n) { CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&p_), n * sizeof(T))); }
    ~PinnedBuffer() { cudaFreeHost(p_); }
    PinnedBuffer(const PinnedBuffer&) = delete;
    PinnedBuffer& operator=(const PinnedBuffer&) = delete;
    T* get() const { return p_; }

  private:
    T* p_ = nullptr;
};

class Stream {
  public:
    Stream() { CUDA_CHECK(cudaStreamCreate(&s_)); }
    ~Stream() { cudaStreamDestroy(s_); }
    Stream(const Stream&) = delete;
    Stream& operator=(const Stream&) = delete;
    cudaStream_t get() const { return s_; }

  private:
    cudaStream_t s_ = nullptr;
};
#endif

// ---------------------------------------------------------------------------
// The engine side: a batch like llama_batch, and one engram context.

struct Batch {
    std::vector<int32_t> token, pos, seq_id;
    void add(int32_t t, int32_t p, int32_t s) {
        token.push_back(t);
        pos.push_back(p);
        seq_id.push_back(s);
    }
    uint32_t size() const { return static_cast<uint32_t>(token.size()); }
};

struct StepOut {
    std::vector<int64_t> row_ids;  // [n, n_layers, C]
    std::vector<float> embedded;   // [n, hc, D] before the layer loop
    std::vector<float> highway;    // [n, hc, D] after it
};

struct ContextFree {
    void operator()(engram_context* c) const { engram_free(c); }
};
using ContextPtr = std::unique_ptr<engram_context, ContextFree>;

class Engine {
  public:
    // on_device: the CUDA backend with device buffers (CUDA build only).
    Engine(const TinyModel& m, bool on_device, uint32_t n_threads) : on_device_(on_device) {
        uint32_t backend = ENGRAM_BACKEND_CPU;
#ifdef ENGRAM_EXAMPLE_CUDA
        if (on_device_) backend = ENGRAM_EXAMPLE_DEVICE_BACKEND;
#endif
        engram_config cfg = m.config(backend, n_threads);
        engram_context* raw = nullptr;
        check(engram_create(&cfg, &raw), "engram_create");
        ctx_.reset(raw);
        per_ = engram_row_ids_per_token(ctx_.get());

        for (size_t l = 0; l < kEngramLayers.size(); ++l) {
            const LayerWeights& lw = m.layers[l];
            engram_layer_weights w;
            engram_layer_weights_init(&w);
            w.layer_id = kEngramLayers[l];
            // Host memory on the CPU backend. The device build uploads the
            // (tiny) table below, as an engine does when its table fits on the
            // GPU; the CUDA backend also reads a table from host memory or a
            // file (the real ~100 GB ones), gathering rows on the host.
            w.table = lw.table.data();
            w.table_rows = lw.rows;
            w.table_type = ENGRAM_TYPE_BF16;
            w.wkv = lw.wkv.data();
            w.wkv_type = ENGRAM_TYPE_BF16;
            w.q = lw.q.data();
            w.k = lw.k.data();
            w.qk_type = ENGRAM_TYPE_F32;
#ifdef ENGRAM_EXAMPLE_CUDA
            if (on_device_) {  // table, projection and norm weights in our own device memory
                dev_.push_back(std::unique_ptr<DeviceWeights>(new DeviceWeights{
                    DeviceBuffer<uint16_t>(lw.table), DeviceBuffer<uint16_t>(lw.wkv), DeviceBuffer<float>(lw.q),
                    DeviceBuffer<float>(lw.k)}));
                w.table = dev_.back()->table.get();
                w.wkv = dev_.back()->wkv.get();
                w.q = dev_.back()->q.get();
                w.k = dev_.back()->k.get();
            }
#endif
            // Borrowed: the weights must outlive the context (they do: ctx_ is
            // declared last, so it is freed first).
            check(engram_set_layer(ctx_.get(), &w), "engram_set_layer");
        }
#ifdef ENGRAM_EXAMPLE_CUDA
        if (on_device_) {
            stream_ = std::make_unique<Stream>();
            d_highway_ = std::make_unique<DeviceBuffer<float>>(size_t{kMaxTokens} * kHc * kD);
            h_ids_ = std::make_unique<PinnedBuffer<int64_t>>(size_t{kMaxTokens} * per_);
            h_highway_ = std::make_unique<PinnedBuffer<float>>(size_t{kMaxTokens} * kHc * kD);
        }
#endif
    }

    engram_context* ctx() const { return ctx_.get(); }
    size_t per_token() const { return per_; }

    // One engine step: hash the batch (host), then the model's layer loop with
    // the engram layers applied in place on the highway.
    StepOut decode(const Batch& b) {
        const uint32_t n = b.size();
        StepOut out;
        out.row_ids.resize(size_t{n} * per_);
        check(engram_hash(ctx_.get(), b.token.data(), b.seq_id.data(), b.pos.data(), n, out.row_ids.data(),
                          out.row_ids.size()),
              "engram_hash");
        out.embedded.resize(size_t{n} * kHc * kD);
        for (uint32_t t = 0; t < n; ++t) TinyModel::embed(b.token[t], &out.embedded[size_t{t} * kHc * kD]);
        out.highway = out.embedded;

        if (!on_device_) {
            for (uint32_t layer = 0; layer < kModelLayers; ++layer) {
                if (is_engram_layer(layer))
                    check(engram_apply(ctx_.get(), layer, out.row_ids.data(), n, out.highway.data(),
                                       ENGRAM_TYPE_F32, /*stream, ignored on the CPU*/ nullptr),
                          "engram_apply");
                // ... the engine's attention and FFN for `layer` would run here.
            }
            return out;
        }
#ifdef ENGRAM_EXAMPLE_CUDA
        // Everything below is queued on our stream: upload the row ids and the
        // embedded highway, the engram layers in place on the device highway,
        // the highway back; one synchronisation at the end of the step.
        const size_t hw_bytes = out.highway.size() * sizeof(float);
        std::memcpy(h_ids_->get(), out.row_ids.data(), out.row_ids.size() * sizeof(int64_t));
        std::memcpy(h_highway_->get(), out.highway.data(), hw_bytes);
        cudaStream_t s = stream_->get();
        CUDA_CHECK(cudaMemcpyAsync(d_highway_->get(), h_highway_->get(), hw_bytes, cudaMemcpyHostToDevice, s));
        for (uint32_t layer = 0; layer < kModelLayers; ++layer) {
            if (is_engram_layer(layer))
                // Row ids from pinned host memory (the hash runs on the host);
                // the highway is our device buffer; the work goes on our stream.
                check(engram_apply(ctx_.get(), layer, h_ids_->get(), n, d_highway_->get(), ENGRAM_TYPE_F32,
                                   static_cast<void*>(s)),
                      "engram_apply");
        }
        CUDA_CHECK(cudaMemcpyAsync(h_highway_->get(), d_highway_->get(), hw_bytes, cudaMemcpyDeviceToHost, s));
        CUDA_CHECK(cudaStreamSynchronize(s));
        std::memcpy(out.highway.data(), h_highway_->get(), hw_bytes);
#endif
        return out;
    }

  private:
    static bool is_engram_layer(uint32_t layer) {
        return std::find(kEngramLayers.begin(), kEngramLayers.end(), layer) != kEngramLayers.end();
    }

    bool on_device_;
    size_t per_ = 0;
#ifdef ENGRAM_EXAMPLE_CUDA
    struct DeviceWeights {
        DeviceBuffer<uint16_t> table;
        DeviceBuffer<uint16_t> wkv;
        DeviceBuffer<float> q, k;
    };
    std::vector<std::unique_ptr<DeviceWeights>> dev_;
    std::unique_ptr<Stream> stream_;
    std::unique_ptr<DeviceBuffer<float>> d_highway_;
    std::unique_ptr<PinnedBuffer<int64_t>> h_ids_;
    std::unique_ptr<PinnedBuffer<float>> h_highway_;
#endif
    ContextPtr ctx_;  // last member: freed before the buffers it borrows
};

// ---------------------------------------------------------------------------
// What the engine keeps per token it accepted, for the check at the end.

struct Record {
    int32_t token;
    std::vector<int64_t> row_ids;
    std::vector<float> embedded, highway;
};
using Key = std::pair<int32_t, int32_t>;  // (seq, pos)

template <class T>
std::vector<T> slice(const std::vector<T>& v, size_t at, size_t n) {
    return std::vector<T>(v.begin() + static_cast<std::ptrdiff_t>(at), v.begin() + static_cast<std::ptrdiff_t>(at + n));
}

struct Host {
    Engine& engine;
    std::map<Key, Record> accepted;
    bool dead_touched = false;  // an image token's highway changed (must not happen)

    // Decode a batch; tokens whose `keep` flag is false (rejected drafts) are
    // not recorded. Prints one line per token.
    StepOut step(const char* title, const Batch& b, const std::vector<bool>& keep = {}) {
        StepOut o = engine.decode(b);
        const size_t per = engine.per_token(), w = size_t{kHc} * kD;
        std::printf("\n%s: %u tokens\n", title, b.size());
        for (uint32_t t = 0; t < b.size(); ++t) {
            double delta = 0;
            for (size_t i = 0; i < w; ++i) delta += std::fabs(o.highway[t * w + i] - o.embedded[t * w + i]);
            delta /= static_cast<double>(w);
            const bool kept = keep.empty() || keep[t];
            std::printf("  seq %d pos %2d token %4d: row ids (layer %u) %" PRId64 " %" PRId64
                        " ...  mean |engram term| %.4f%s%s\n",
                        b.seq_id[t], b.pos[t], b.token[t], kEngramLayers[0], o.row_ids[t * per],
                        o.row_ids[t * per + 1], delta, delta == 0 ? "  (dead: untouched)" : "",
                        kept ? "" : "  (draft, rejected)");
            if (b.token[t] >= static_cast<int32_t>(kFirstImageToken) && delta != 0) dead_touched = true;
            if (kept)
                accepted[{b.seq_id[t], b.pos[t]}] =
                    Record{b.token[t], slice(o.row_ids, t * per, per), slice(o.embedded, t * w, w),
                           slice(o.highway, t * w, w)};
        }
        return o;
    }
};

// ---------------------------------------------------------------------------
// The check: each final sequence straight through, in one call, on a fresh
// CPU context (one thread, sequence id 0 reused after a drop).

bool highway_matches(const Record& got, const float* ref, bool exact, double* worst) {
    const size_t w = size_t{kHc} * kD;
    if (exact) return std::memcmp(got.highway.data(), ref, w * sizeof(float)) == 0;
    // CUDA vs CPU: the projection sums in another order, so allow a small
    // fraction of the token's largest engram term (a wrong row or gate would
    // be off by the term itself).
    double term = 0, err = 0;
    for (size_t i = 0; i < w; ++i) {
        term = std::max(term, std::fabs(static_cast<double>(ref[i]) - got.embedded[i]));
        err = std::max(err, std::fabs(static_cast<double>(got.highway[i]) - ref[i]));
    }
    *worst = std::max(*worst, term > 0 ? err / term : err);
    return err <= 1e-2 * term + 1e-6;
}

bool check_against_reference(const TinyModel& model, const std::map<Key, Record>& accepted,
                             const std::vector<std::pair<int32_t, std::vector<int32_t>>>& sequences,
                             bool exact) {
    Engine ref(model, /*on_device=*/false, /*n_threads=*/1);
    const size_t per = ref.per_token(), w = size_t{kHc} * kD;
    size_t compared = 0, mismatches = 0, id_mismatches = 0, hw_mismatches = 0;
    double worst = 0;
    for (const auto& [seq, tokens] : sequences) {
        Batch b;
        for (size_t p = 0; p < tokens.size(); ++p) b.add(tokens[p], static_cast<int32_t>(p), 0);
        StepOut o = ref.decode(b);
        for (size_t p = 0; p < tokens.size(); ++p) {
            auto it = accepted.find({seq, static_cast<int32_t>(p)});
            if (it == accepted.end()) continue;  // a forked prefix: checked under its own sequence
            ++compared;
            const Record& r = it->second;
            bool ids_ok = r.token == tokens[p] &&
                          std::equal(r.row_ids.begin(), r.row_ids.end(), o.row_ids.begin() + p * per);
            bool hw_ok = highway_matches(r, &o.highway[p * w], exact, &worst);
            id_mismatches += !ids_ok;
            hw_mismatches += !hw_ok;
            if (!ids_ok || !hw_ok) {
                ++mismatches;
                std::printf("  MISMATCH seq %d pos %zu:%s%s\n", seq, p, ids_ok ? "" : " row ids",
                            hw_ok ? "" : " highway");
            }
        }
        check(engram_seq_rm(ref.ctx(), 0, -1, -1), "engram_seq_rm");
    }
    std::printf("\ncheck: %zu accepted tokens against a straight run on a CPU context: row ids %s, highway %s%s",
                compared, id_mismatches ? "DIFFER" : "equal", hw_mismatches ? "NOT " : "",
                exact ? "bit-equal" : "within tolerance");
    if (!exact) std::printf(" (worst error %.2e of the largest engram term)", worst);
    std::printf("\n");
    return mismatches == 0 && compared == accepted.size();
}

int run() {
    std::printf("engram %s (header %s)\n", engram_version(), ENGRAM_VERSION_STRING);
    if (std::strcmp(engram_version(), ENGRAM_VERSION_STRING) != 0) {
        std::printf("FAIL: the library and the header are different versions\n");
        return 1;
    }
    const TinyModel model;

#ifdef ENGRAM_EXAMPLE_CUDA
    const bool on_device = true;
    int n_dev = 0;
    CUDA_CHECK(cudaGetDeviceCount(&n_dev));
    CUDA_CHECK(cudaSetDevice(0));
    std::printf("backend: CUDA (device 0 of %d; our own device buffers and stream)\n", n_dev);
    std::unique_ptr<Engine> engine_ptr;
    try {
        engine_ptr = std::make_unique<Engine>(model, on_device, 2);
    } catch (const EngramError& e) {
        if (e.status == ENGRAM_STATUS_ERR_UNSUPPORTED) {
            std::printf("SKIP: this libengram has no CUDA backend (%s)\n", e.what());
            return 77;
        }
        throw;
    }
    Engine& engine = *engine_ptr;
#else
    const bool on_device = false;
    std::printf("backend: CPU\n");
    Engine engine(model, on_device, 2);
#endif
    std::printf("model: D %u, hc %u, Hd %u, %u-grams x %u heads, engram layers %u and %u of %u, "
                "%zu row ids per token\n",
                kD, kHc, kHd, kNgram, kHeads, kEngramLayers[0], kEngramLayers[1], kModelLayers,
                engine.per_token());

    Host host{engine, {}};
    const size_t w = size_t{kHc} * kD;
    // The engine's view of each sequence: accepted tokens by position, and the
    // token it sampled last (to be fed at the next position).
    std::vector<int32_t> seq0 = {11, 25, 995 /* image token */, 4, 310, 42};
    std::vector<int32_t> seq1 = {7, 8, 9, 600, 123};
    int32_t next0 = 0, next1 = 0, next2 = 0;
    auto last = [&](const StepOut& o, uint32_t i) { return sample(&o.highway[i * w]); };

    {  // Step 1: prefill sequence 0.
        Batch b;
        for (size_t p = 0; p < seq0.size(); ++p) b.add(seq0[p], static_cast<int32_t>(p), 0);
        StepOut o = host.step("step 1: prefill seq 0", b);
        next0 = last(o, b.size() - 1);
    }
    {  // Step 2: sequence 1 prefills while sequence 0 decodes, in one batch.
        Batch b;
        for (size_t p = 0; p < seq1.size(); ++p) b.add(seq1[p], static_cast<int32_t>(p), 1);
        b.add(next0, static_cast<int32_t>(seq0.size()), 0);
        StepOut o = host.step("step 2: prefill seq 1, decode seq 0", b);
        seq0.push_back(next0);
        next0 = last(o, b.size() - 1);
        next1 = last(o, static_cast<uint32_t>(seq1.size()) - 1);
    }
    {  // Step 3: sequence 0 verifies a 3-token draft; sequence 1 decodes.
        const int32_t p0 = static_cast<int32_t>(seq0.size());
        const std::vector<int32_t> draft = {77, 78, 79};  // from a stand-in drafter
        // The verifier accepts the first draft token and rejects the other two
        // (scripted here; a real engine compares each with its own sample).
        const size_t n_accept = 1;
        Batch b;
        std::vector<bool> keep;
        b.add(next0, p0, 0);
        keep.push_back(true);
        for (size_t i = 0; i < draft.size(); ++i) {
            b.add(draft[i], p0 + 1 + static_cast<int32_t>(i), 0);
            keep.push_back(i < n_accept);
        }
        b.add(next1, static_cast<int32_t>(seq1.size()), 1);
        keep.push_back(true);
        StepOut o = host.step("step 3: seq 0 verifies a draft of 3, seq 1 decodes", b, keep);
        seq0.push_back(next0);
        for (size_t i = 0; i < n_accept; ++i) seq0.push_back(draft[i]);
        // The target's own token after the last accepted one replaces the first
        // rejected draft token; hashing it at that position (next step)
        // overwrites the draft's history: that is the rollback.
        next0 = last(o, static_cast<uint32_t>(n_accept));
        seq1.push_back(next1);
        next1 = last(o, b.size() - 1);
        std::printf("  verify: %zu of %zu draft tokens accepted; positions %zu..%zu of seq 0 rolled back, "
                    "position %zu gets the target's token %d next step\n",
                    n_accept, draft.size(), seq0.size(), seq0.size() + draft.size() - n_accept - 1, seq0.size(),
                    next0);
    }
    {  // Step 4: both decode; sequence 0 re-hashes its first rejected position.
        Batch b;
        b.add(next0, static_cast<int32_t>(seq0.size()), 0);
        b.add(next1, static_cast<int32_t>(seq1.size()), 1);
        StepOut o = host.step("step 4: seq 0 decodes over the rejected draft, seq 1 decodes", b);
        seq0.push_back(next0);
        seq1.push_back(next1);
        next0 = last(o, 0);
        next1 = last(o, 1);
    }
    // Fork: sequence 2 shares sequence 0's first 4 tokens and continues with
    // its own (a second sample, a beam). Copy the history, then overwrite from
    // the branch point on; positions past it are rewritten before they are read.
    const size_t branch = 4;
    std::vector<int32_t> seq2(seq0.begin(), seq0.begin() + branch);
    check(engram_seq_cp(engine.ctx(), 0, 2, -1, -1), "engram_seq_cp");
    std::printf("\nfork: engram_seq_cp(0 -> 2, whole sequence); seq 2 branches at position %zu\n", branch);
    {  // Step 5: all three sequences; sequence 2 feeds two tokens of its own.
        Batch b;
        b.add(next0, static_cast<int32_t>(seq0.size()), 0);
        b.add(next1, static_cast<int32_t>(seq1.size()), 1);
        b.add(500, static_cast<int32_t>(branch), 2);
        b.add(501, static_cast<int32_t>(branch + 1), 2);
        StepOut o = host.step("step 5: seq 0 and 1 decode, seq 2 prefills its branch", b);
        seq0.push_back(next0);
        seq1.push_back(next1);
        seq2.push_back(500);
        seq2.push_back(501);
        next0 = last(o, 0);
        next1 = last(o, 1);
        next2 = last(o, 3);
    }
    {  // Step 6: all three decode, then sequence 2 is done and freed.
        Batch b;
        b.add(next0, static_cast<int32_t>(seq0.size()), 0);
        b.add(next2, static_cast<int32_t>(seq2.size()), 2);
        b.add(next1, static_cast<int32_t>(seq1.size()), 1);
        host.step("step 6: all three decode", b);
        seq0.push_back(next0);
        seq2.push_back(next2);
        seq1.push_back(next1);
    }
    check(engram_seq_rm(engine.ctx(), 2, -1, -1), "engram_seq_rm");
    std::printf("\nfree: engram_seq_rm(2, whole sequence)\n");

    // A call on the freed sequence fails, says why, and changes nothing.
    {
        const int32_t tok = 5, seq = 2, pos = static_cast<int32_t>(seq2.size());
        std::vector<int64_t> ids(engine.per_token(), 12345);
        engram_status s = engram_hash(engine.ctx(), &tok, &seq, &pos, 1, ids.data(), ids.size());
        const bool untouched = std::all_of(ids.begin(), ids.end(), [](int64_t v) { return v == 12345; });
        std::printf("bad call (seq 2 pos %d after the drop): %s: %s%s\n", pos, engram_status_str(s),
                    engram_last_error(), untouched ? " (output untouched)" : "");
        if (s != ENGRAM_STATUS_ERR_MISSING_HISTORY || !untouched) {
            std::printf("FAIL: expected ENGRAM_STATUS_ERR_MISSING_HISTORY and no output\n");
            return 1;
        }
    }

    bool ok = check_against_reference(model, host.accepted, {{0, seq0}, {1, seq1}, {2, seq2}},
                                      /*exact=*/!on_device);
    if (host.dead_touched) {
        std::printf("  an image token's highway was changed\n");
        ok = false;
    }
    std::printf("%s: %zu tokens accepted in 6 steps (seq 0: %zu, seq 1: %zu, seq 2: %zu)\n", ok ? "PASS" : "FAIL",
                host.accepted.size(), seq0.size(), seq1.size(), seq2.size());
    return ok ? 0 : 1;
}

}  // namespace

int main() {
    try {
        return run();
    } catch (const std::exception& e) {
        std::printf("FAIL: %s\n", e.what());
        return 1;
    }
}
