#!/usr/bin/env bash
# Build the ggml peer of the CPU benchmark (bench/ggml/ggml_peer.cpp): ggml's
# CPU backend from llama-cpp-python 0.3.36's vendored sources (cached:
# scripts/ggml-build.sh), libengram in release (cargo build --release --lib:
# the library `cargo bench` measures), and the driver, linked against both,
# into ${CARGO_TARGET_DIR:-target}/ggml-peer/ggml_peer. Called by
# bench/setup.sh, and by `cargo bench --bench cpu` itself for both builds.
# ENGRAM_GGML_NATIVE=1 builds against ggml's GGML_NATIVE=ON (-march=native)
# build instead, into .../ggml-peer-native/.
#
# ENGRAM_LIB_DIR=DIR: link the libengram.so already in DIR (the bench passes
# its own target/release) instead of running cargo. The driver is linked
# again only when it is older than its source, the header or ggml's
# libraries (it loads libengram.so at run time, so a new library needs no
# new link). Prints the driver's path last on stdout.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
bash scripts/ensure-tools.sh
GGML="$(bash scripts/ggml-build.sh)"
echo "# ggml: $(cat "$GGML/VERSION")" >&2
TARGET="${CARGO_TARGET_DIR:-$ROOT/target}"
case "$TARGET" in /*) ;; *) TARGET="$ROOT/$TARGET" ;; esac
if [ -n "${ENGRAM_LIB_DIR:-}" ]; then
    LIB_DIR="$ENGRAM_LIB_DIR"
    [ -f "$LIB_DIR/libengram.so" ] || { echo "build.sh: no libengram.so in $LIB_DIR" >&2; exit 1; }
else
    cargo build --quiet --release --lib
    LIB_DIR="$TARGET/release"
fi
OUT="$TARGET/ggml-peer"
if [ "${ENGRAM_GGML_NATIVE:-0}" = 1 ]; then
    OUT="$TARGET/ggml-peer-native"
fi
mkdir -p "$OUT"
DRIVER="$OUT/ggml_peer"
fresh=1
for dep in "$ROOT/bench/ggml/ggml_peer.cpp" "$ROOT/include/engram.h" "$GGML/lib/libggml.a" \
    "$GGML/lib/libggml-cpu.a" "$GGML/lib/libggml-base.a" "$GGML/VERSION" "$ROOT/bench/ggml/build.sh"; do
    [ -f "$DRIVER" ] && [ "$DRIVER" -nt "$dep" ] || fresh=0
done
# The driver records the library directory it was linked against (its rpath).
[ "$(cat "$OUT/LIB_DIR" 2>/dev/null)" = "$LIB_DIR" ] || fresh=0
if [ "$fresh" = 1 ]; then
    echo "# $DRIVER up to date" >&2
    echo "$DRIVER"
    exit 0
fi
"${CXX:-g++}" -std=c++17 -O2 -g -Wall -Wextra -Werror \
    -I"$ROOT/include" -I"$GGML/include" "$ROOT/bench/ggml/ggml_peer.cpp" -o "$OUT/ggml_peer.tmp" \
    "$GGML/lib/libggml.a" "$GGML/lib/libggml-cpu.a" "$GGML/lib/libggml-base.a" \
    -L"$LIB_DIR" -Wl,-rpath,"$LIB_DIR" -lengram -fopenmp -lm -lpthread -ldl
mv "$OUT/ggml_peer.tmp" "$DRIVER"
cp "$GGML/VERSION" "$OUT/GGML_VERSION"
echo "$LIB_DIR" >"$OUT/LIB_DIR"
echo "# built $DRIVER (libengram from $LIB_DIR)" >&2
echo "$DRIVER"
