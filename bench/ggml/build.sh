#!/usr/bin/env bash
# Build the ggml peer of the CPU benchmark (bench/ggml/ggml_peer.cpp): ggml's
# CPU backend from llama-cpp-python 0.3.36's vendored sources (cached:
# scripts/ggml-build.sh), libengram in release (cargo build --release --lib:
# the library `cargo bench` measures), and the driver, linked against both,
# into target/ggml-peer/ggml_peer. `cargo bench --bench cpu` runs it when it
# is there (ENGRAM_BENCH_ONLY=ggml runs only it). Called by bench/setup.sh.
# ENGRAM_GGML_NATIVE=1 builds against ggml's -march=native build instead (an
# AVX-512 host: AVX-512 against AVX-512), into target/ggml-peer-native/.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
bash scripts/ensure-tools.sh
GGML="$(bash scripts/ggml-build.sh)"
echo "# ggml: $(cat "$GGML/VERSION")"
cargo build --quiet --release --lib
OUT="$ROOT/target/ggml-peer"
if [ "${ENGRAM_GGML_NATIVE:-0}" = 1 ]; then
    OUT="$ROOT/target/ggml-peer-native"
fi
mkdir -p "$OUT"
"${CXX:-g++}" -std=c++17 -O2 -g -Wall -Wextra -Werror \
    -I"$ROOT/include" -I"$GGML/include" "$ROOT/bench/ggml/ggml_peer.cpp" -o "$OUT/ggml_peer.tmp" \
    "$GGML/lib/libggml.a" "$GGML/lib/libggml-cpu.a" "$GGML/lib/libggml-base.a" \
    -L"$ROOT/target/release" -Wl,-rpath,"$ROOT/target/release" -lengram -fopenmp -lm -lpthread -ldl
mv "$OUT/ggml_peer.tmp" "$OUT/ggml_peer"
cp "$GGML/VERSION" "$OUT/GGML_VERSION"
echo "# built $OUT/ggml_peer (libengram from target/release)"
