#!/usr/bin/env bash
# libengram as a ggml custom op (integrations/ggml/engram_ggml.h) on ggml's
# CPU backend, bit-identical to calling engram_apply directly: builds ggml
# (cached: scripts/ggml-build.sh; a few minutes the first time, seconds after),
# the library (cargo build --lib, as c_tests/run.sh does), compiles
# test_ggml.c as C11 and as C++17 with warnings as errors, and runs both on
# tests/golden/data/tiny.gguf with 2 threads.
#
# Usage: bash integrations/ggml/test.sh
#   ENGRAM_LIB_DIR=/path/with/libengram.so   use a prebuilt library, no cargo build
#   ENGRAM_GGML_THREADS=N                    threads (default 2)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
cd "$ROOT"
CC="${CC:-gcc}"
CXX="${CXX:-g++}"
THREADS="${ENGRAM_GGML_THREADS:-2}"

bash scripts/ensure-tools.sh
GGML="$(bash scripts/ggml-build.sh)"
echo "# ggml: $(cat "$GGML/VERSION") in $GGML"

if [ -n "${ENGRAM_LIB_DIR:-}" ]; then
    LIB_DIR="$(cd "$ENGRAM_LIB_DIR" && pwd)"
else
    LIB_DIR="${CARGO_TARGET_DIR:-$ROOT/target}/debug"
    cargo build --quiet --lib
fi
[ -f "$LIB_DIR/libengram.so" ] || { echo "FAIL no libengram.so in $LIB_DIR"; exit 1; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/engram_ggml_test.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
INC=(-I"$ROOT/include" -I"$HERE" -I"$GGML/include" -I"$ROOT/c_tests")
# ggml's static libraries (the CPU backend uses OpenMP), then libengram.
LIBS=("$GGML/lib/libggml.a" "$GGML/lib/libggml-cpu.a" "$GGML/lib/libggml-base.a"
    -L"$LIB_DIR" -Wl,-rpath,"$LIB_DIR" -lengram -fopenmp -lstdc++ -lm -lpthread -ldl)
WARN=(-Wall -Wextra -Werror)

"$CC" -std=c11 -O1 -g "${WARN[@]}" "${INC[@]}" "$HERE/test_ggml.c" -o "$WORK/test_ggml_c" "${LIBS[@]}"
"$CXX" -std=c++17 -O1 -g "${WARN[@]}" "${INC[@]}" -x c++ "$HERE/test_ggml.c" -x none -o "$WORK/test_ggml_cpp" "${LIBS[@]}"

# The proposed ggml-cuda change (docs/ggml.md) still applies to the vendored
# sources. It is not built here: that needs nvcc and a GPU.
PATCH="$HERE/ggml-cuda-custom-op.patch"
if command -v git >/dev/null 2>&1; then
    (cd "$GGML/llama.cpp-src" && git apply --check "$PATCH")
else
    (cd "$GGML/llama.cpp-src" && patch -p1 --dry-run --silent <"$PATCH" >/dev/null)
fi
echo "PASS ggml-cuda-custom-op.patch applies to llama.cpp $(sed 's/.*llama.cpp \([0-9a-f]*\).*/\1/' "$GGML/VERSION")'s ggml (not built: no nvcc/GPU)"

status=0
for t in test_ggml_c test_ggml_cpp; do
    echo "# $t"
    if ! "$WORK/$t" "$ROOT/tests/golden/data/tiny.gguf" "$THREADS" >"$WORK/$t.log" 2>&1; then
        status=1
    fi
    if [ "$t" = test_ggml_c ]; then
        cat "$WORK/$t.log"
    else
        grep -v '^PASS' "$WORK/$t.log" || true
    fi
done
if [ "$status" -ne 0 ] || grep -q '^FAIL' "$WORK"/*.log; then
    echo "integrations/ggml: FAILED"
    exit 1
fi
echo "integrations/ggml: ok (C and C++)"
