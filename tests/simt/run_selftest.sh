#!/usr/bin/env bash
# Build tests/simt (libengram_simt.so and its self-test) and run the self-test.
#
#   tests/simt/run_selftest.sh [OUTDIR [-DNAME=VALUE ...]]   (default OUTDIR: build/simt)
#
# The kernels need the -D options of src/cuda/kernels.rs defines() (build.sh
# passes them on); `cargo test --test simt_selftest` builds and runs the
# self-test with them, and leaves them in target/tmp/simt-*/defines.txt for a
# run by hand: tests/simt/run_selftest.sh build/simt $(cat target/tmp/simt-*/defines.txt)
#
# Environment: as build.sh (FMAD, SANITIZE=1, TSAN=1, UCONTEXT=1), and
#   ALL=1   run four builds in turn: plain, SANITIZE=1, TSAN=1 and
#           UCONTEXT=1 FMAD=0, in OUTDIR/{plain,asan,tsan,ucontext}
#           (about 3 minutes on 2 cores; a plain run takes about 15 s)
# Under TSAN=1 it also checks that TSan reports the self-test's deliberate
# intra-block race (--race-demo) and not its fixed twin.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
OUT="${1:-$ROOT/build/simt}"
shift || true
DEFS=("$@")
KNAMES="$ROOT/src/cuda/gpu.rs"

# The kernel names the CUDA backend launches: the KERNEL_NAMES list of
# src/cuda/gpu.rs.
EXPECT=()
if [ -f "$KNAMES" ]; then
    mapfile -t NAMES < <(awk '/pub const KERNEL_NAMES/{f=1} f{print} f&&/\];/{exit}' "$KNAMES" |
        grep -o '"engram_[A-Za-z0-9_]*"' | tr -d '"')
    for n in "${NAMES[@]}"; do EXPECT+=(--expect "$n"); done
fi
[ "${#EXPECT[@]}" -gt 0 ] ||
    echo "run_selftest.sh: WARNING: no kernel names found in $KNAMES: the CUDA backend's names are not checked" >&2

run_one() {
    local dir="$1"
    "$HERE/build.sh" "$dir" "${DEFS[@]}"
    "$dir/selftest" "${EXPECT[@]}"
    if [ "${TSAN:-0}" = 1 ]; then
        local rc=0
        "$dir/selftest" --race-demo >"$dir/race-demo.log" 2>&1 || rc=$?
        if [ "$rc" = 0 ] || ! grep -q "ThreadSanitizer: data race" "$dir/race-demo.log"; then
            echo "FAIL: TSan did not report the deliberate race (exit $rc, see $dir/race-demo.log)" >&2
            return 1
        fi
        "$dir/selftest" --race-demo=fixed
        echo "ok   TSan reports the deliberate intra-block race and not its fixed twin"
    fi
}

if [ "${ALL:-0}" = 1 ]; then
    unset SANITIZE TSAN UCONTEXT FMAD
    run_one "$OUT/plain"
    SANITIZE=1 run_one "$OUT/asan"
    TSAN=1 run_one "$OUT/tsan"
    UCONTEXT=1 FMAD=0 run_one "$OUT/ucontext"
    echo "run_selftest.sh: all four builds passed"
else
    run_one "$OUT"
fi
