#!/usr/bin/env bash
# Every test: formatting, clippy, the Rust tests (golden, properties, header freshness,
# unit tests), the C ABI tests under AddressSanitizer, and the demo.
# Needs only what a fresh machine of this project has: cargo, gcc/g++.
# The install check at the end also needs cmake and pkg-config, and the ggml
# integration test python3's venv (pip fetches ggml's sources once); they are
# installed with apt-get when missing (scripts/ensure-tools.sh).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo fmt --check"
cargo fmt --all -- --check

echo "== cargo clippy --all-targets -- -D warnings (every unsafe block says why it is sound)"
cargo clippy --workspace --all-targets -- -D warnings

echo "== module layering: no import cycle among src/ files, nothing below backend names a backend (tests/imports.rs)"
cargo test --quiet --test imports

echo "== cargo test"
mkdir -p target
ENGRAM_REQUIRE_EMULATION=1 cargo test --workspace --all-targets 2>&1 | tee target/cargo-test.log
# `cargo test` prints one 'test result' line per test binary; fail loudly if none ran.
grep -q "test result: ok" target/cargo-test.log

echo "== the stager's protocol under loom (the real code on loom's primitives; every interleaving, up to 3 preemptions)"
# Its own build of the lib's unit tests (feature loom-model); clippy checks that code too.
cargo clippy --quiet --lib --tests --features loom-model -- -D warnings
cargo test --quiet --lib --features loom-model cpu::stager::model 2>&1 | tail -n 3

echo "== C ABI tests (C and C++, AddressSanitizer + UBSan)"
bash c_tests/run.sh

echo "== ggml: libengram as a ggml custom op, bit-identical to engram_apply (ggml built once from llama-cpp-python 0.3.36's sources, cached)"
bash integrations/ggml/test.sh

echo "== demo"
cargo run --quiet --example demo > target/demo.log
tail -n 3 target/demo.log

echo "== install into a fresh prefix; examples/cpp_host through CMake (find_package, add_subdirectory, FetchContent) and pkg-config; static link; every recipe of docs/install.md and docs/ggml.md"
bash scripts/check-install.sh

echo "== Python: pip install ./python into a venv (reuses the release build above), pytest python/tests;"
echo "   the gloo distributed test on the CPU backend and on the CUDA backend's SIMT emulation"
ENGRAM_REQUIRE_EMULATION=1 bash python/test.sh

echo "== GGUF header fuzz, bounded (50,000 mutated files per fixture, fixed seed)"
# cargo test above ran 4,000 per fixture; this run widens it (a few seconds).
ENGRAM_FUZZ_ITERS=50000 ENGRAM_FUZZ_SEED=20261129 cargo test --quiet --test gguf_fuzz 2>&1 | tail -n 3

echo "== engram-tables: the V4.1 token map from config.json + tokenizer.json equals the golden's"
cargo run --quiet -p engram-tables -- --config tests/golden/data/v41_config.json \
    --tokenizer tests/golden/data/deepseek_v4_tokenizer.json --out target/engram-tables
cmp target/engram-tables/token_map.i32 tests/golden/data/v41_token_map.i32

echo "== engram-replay: README.md and docs/layout.md through the V4.1 tokenizer and hash, replayed through the"
echo "   library's lru/clock/s3fifo at three small sizes; --check-lru fails if the library's LRU and the tool's own differ"
cargo run --quiet -p engram-replay -- --sizes 64K,1M,16M --check-lru --json target/replay.json \
    README.md docs/layout.md > target/replay.log
grep -q 'check-lru: the library' target/replay.log
tail -n 4 target/replay.log

echo "== engram-inspect: two dialect fixtures check; a file whose rows disagree with its primes fails naming both keys"
cargo run --quiet -p engram-inspect -- tests/golden/data/dialects/tarruda.gguf > target/inspect.log
cargo run --quiet -p engram-inspect -- tests/golden/data/dialects/vcruz305_split-00002-of-00003.gguf >> target/inspect.log
grep -c '^  ok ' target/inspect.log
cp tests/golden/data/dialects/ds4.gguf target/inspect_bad.gguf
printf '\xa5' | dd of=target/inspect_bad.gguf bs=1 seek=826 conv=notrunc status=none # layer 1's rows: 420 -> 421
rc=0
cargo run --quiet -p engram-inspect -- target/inspect_bad.gguf > target/inspect_bad.log || rc=$?
if [ "$rc" -ne 1 ] || ! grep -q 'FAIL.*deepseek41.engram.rows.*deepseek41.engram.primes' target/inspect_bad.log; then
    cat target/inspect_bad.log
    echo "engram-inspect did not fail (exit $rc) naming deepseek41.engram.rows and .primes"
    exit 1
fi
grep FAIL target/inspect_bad.log

echo "== CUDA kernels: NVRTC compile for sm_80 and sm_90, errors and warnings fail (no GPU needed)"
# libnvrtc from the nvidia-cuda-nvrtc-cu12 wheel (PyPI), in a venv under target/.
# The GPU tests themselves skip without a driver; scripts/gpu-check.sh runs them.
bash scripts/nvrtc-check.sh

echo "== the GPU check's plan: its steps' limits fit its device-time budget (dry run)"
ENGRAM_GPU_CHECK_DRY=1 bash scripts/gpu-check.sh target/gpu-check-dry
