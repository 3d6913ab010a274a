#!/usr/bin/env bash
# Build, on a machine with cargo and the crates (no GPU needed), everything
# scripts/gpu-check.sh runs on a GPU machine, into one small folder:
#
#   target/gpu-bundle/
#     cuda_golden       tests/cuda_golden.rs, release: every golden regime, GEMV
#                       sizes, graph replay, two streams, device errors, 64-bit offsets
#     cuda_formats      tests/cuda_formats.rs: every row format and every wkv format
#     cuda_host_tables  tests/cuda_host_tables.rs: host and file tables, staging
#     cuda_device_cache tests/cuda_device_cache.rs: the device row cache of host tables
#     fp8_split         tests/fp8_split.rs: fp8 codes and scales in two arrays
#     cuda_streams      tests/cuda_streams.rs: misaligned pointers refused, batch
#                       invariance up to 8 tokens, a graph re-captured after
#                       set_layer (the stream-order tests are emulation-only)
#     cuda_fp8_wkv      tests/cuda_fp8_wkv.rs: the block-scaled fp8 wkv against bf16
#     cuda_decode       tests/cuda_decode.rs: the decode kernel's documented order,
#                       batch invariance 1-64, the GEMV's bits, its cooperative launch
#     cuda_nvrtc        tests/cuda_nvrtc.rs: every kernel compiles without a warning
#     device_hash       tests/device_hash.rs: engram_hash_device against the host hash
#     gpu_bench         benches/gpu.rs
#     libengram.so      the library, for the C test and examples/cpp_host on CUDA
#     modules/          every kernel module compiled here by NVRTC to a cubin for
#                       each of ENGRAM_PREBUILD_ARCHS (default sm_90,sm_100: H100,
#                       H200, B200), each file named by the module, the
#                       architecture and a hash of the kernel sources, options and
#                       defines (src/cuda/kernels.rs module_file_name); the GPU
#                       check points ENGRAM_CUDA_MODULE_DIR at a copy, so the
#                       library loads them instead of compiling (NVRTC on the
#                       device is the fallback, for another architecture or
#                       changed sources, and fills the same directory for the
#                       run's other processes)
#     ROOT, COMMIT      where and from which commit it was built (on the GPU
#                       machine the binaries read tests/golden/data and
#                       bench/gpu_peer.py under ENGRAM_SOURCE_ROOT, which
#                       gpu-check.sh sets to the tree it runs in)
#
# Debug info is stripped so the bundle stays well under 64 MiB (checked). The
# binaries need glibc 2.36 or later and nothing else: the CUDA libraries are
# loaded at run time.
#
# Before it finishes it runs the bundled test binaries here on the emulated
# device (ENGRAM_TEST_DEVICE=emulated: the kernels on the CPU through
# tests/simt), so a bundle that cannot pass its own tests is never carried to a
# GPU. ENGRAM_PREBUILD_SMOKE=0 skips that (a minute or so).
#
# Any step that fails stops the script with a non-zero status and a line
# "gpu-prebuild: FAILED at step: ..." naming it, so no device time is spent on
# a tree that does not build.
#
# Usage: bash scripts/gpu-prebuild.sh
#   ENGRAM_PREBUILD_ARCHS   the cubins' architectures (default sm_90,sm_100)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
B=target/gpu-bundle
ARCHS="${ENGRAM_PREBUILD_ARCHS:-sm_90,sm_100}"
STEP="start"
trap 'echo "gpu-prebuild: FAILED at step: $STEP" >&2' ERR
step() { # name the step the next commands belong to
    STEP="$1"
    echo "== $1"
}
LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT
rm -rf "$B"
mkdir -p "$B"
TESTS=(cuda_golden cuda_formats cuda_host_tables cuda_device_cache fp8_split cuda_streams cuda_fp8_wkv cuda_decode cuda_nvrtc device_hash cuda_shards)

exe_of() { # the test/bench executable cargo built, from its JSON messages
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])
' "$1"
}

step "cargo build --release --lib"
cargo build --release --lib
cp "${CARGO_TARGET_DIR:-target}/release/libengram.so" "$B/"
for t in "${TESTS[@]}"; do
    step "cargo test --release --test $t --no-run"
    exe="$(cargo test --release --test "$t" --no-run --message-format=json 2>"$LOG" | exe_of "$t")" ||
        { tail -n 30 "$LOG"; false; }
    [ -n "$exe" ] || { tail -n 30 "$LOG"; echo "no executable for $t"; false; }
    cp "$exe" "$B/$t"
done
step "cargo bench --bench gpu --no-run"
exe="$(cargo bench --bench gpu --no-run --message-format=json 2>"$LOG" | exe_of gpu)" ||
    { tail -n 30 "$LOG"; false; }
[ -n "$exe" ] || { tail -n 30 "$LOG"; echo "no executable for the gpu bench"; false; }
cp "$exe" "$B/gpu_bench"
step "strip"
for f in "${TESTS[@]}" gpu_bench libengram.so; do
    strip --strip-debug "$B/$f"
done
step "NVRTC: the kernel modules to cubins for $ARCHS"
NVRTC_LIB="$(bash scripts/nvrtc-check.sh --lib-dir)"
mkdir -p "$B/modules"
LD_LIBRARY_PATH="$NVRTC_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ENGRAM_REQUIRE_NVRTC=1 \
    ENGRAM_CUDA_MODULE_DIR="$ROOT/$B/modules" ENGRAM_PREBUILD_ARCHS="$ARCHS" \
    "$B/cuda_nvrtc" --ignored --exact prebuild_the_modules --nocapture
N_MODULES=$(find "$B/modules" -name '*.cubin' | wc -l)
[ "$N_MODULES" -eq $((3 * $(echo "$ARCHS" | tr ',' '\n' | grep -c .))) ] ||
    { echo "expected 3 modules per architecture, found $N_MODULES"; false; }
echo "$ROOT" >"$B/ROOT"
git rev-parse HEAD >"$B/COMMIT" 2>/dev/null || echo unknown >"$B/COMMIT"
if ! git diff --quiet HEAD 2>/dev/null; then
    echo "(the working tree differs from $(cat "$B/COMMIT"): uncommitted changes are in the bundle)" | tee -a "$B/COMMIT"
fi
step "the bundle's size"
ls -la "$B" "$B/modules"
KB=$(du -sk "$B" | cut -f1)
echo "bundle: $((KB / 1024)) MiB"
if [ "$KB" -ge $((60 * 1024)) ]; then
    echo "the bundle is over 60 MiB (the carry limit is 64 MiB in all)"
    false
fi

if [ "${ENGRAM_PREBUILD_SMOKE:-1}" = 1 ]; then
    for t in cuda_golden cuda_formats cuda_host_tables cuda_device_cache fp8_split cuda_streams cuda_fp8_wkv cuda_decode; do
        step "smoke: the bundled $t on the emulated device"
        ENGRAM_TEST_DEVICE=emulated ENGRAM_REQUIRE_EMULATION=1 "$B/$t" --test-threads=2 -q 2>&1 | tail -n 3
    done
    step "smoke: gpu_bench --list"
    "$B/gpu_bench" --list >/dev/null
    echo "smoke: OK"
fi
echo "carry target/gpu-bundle to the GPU machine and run: bash scripts/gpu-check.sh OUTDIR"
