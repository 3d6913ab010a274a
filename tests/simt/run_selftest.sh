#!/usr/bin/env bash
# Build tests/simt (libengram_simt.so and its self-test) and run the self-test.
#
#   tests/simt/run_selftest.sh [OUTDIR]        (default OUTDIR: build/simt)
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
KRS="$ROOT/src/cuda/kernels.rs"

# The kernel names the CUDA backend looks up (src/cuda/kernels.rs): each
# m.function("NAME") literal, and the GEMV family format!("PREFIX{}", i + 1)
# for i < GEMV_MAX.
EXPECT=()
if [ -f "$KRS" ]; then
    mapfile -t NAMES < <(grep -o 'function("[A-Za-z0-9_]*")' "$KRS" | sed 's/function("\(.*\)")/\1/')
    PREFIX="$(grep -o 'format!("[A-Za-z0-9_]*{}", i + 1)' "$KRS" | sed 's/format!("\([A-Za-z0-9_]*\){}".*/\1/' | head -n 1 || true)"
    MAX="$(grep -o 'GEMV_MAX: usize = [0-9]*' "$KRS" | grep -o '[0-9]*$' | head -n 1 || true)"
    if [ -n "$PREFIX" ] && [ -n "$MAX" ]; then
        for ((i = 1; i <= MAX; i++)); do NAMES+=("$PREFIX$i"); done
    else
        echo "run_selftest.sh: note: no GEMV kernel family found in $KRS" >&2
    fi
    for n in "${NAMES[@]}"; do EXPECT+=(--expect "$n"); done
fi
[ "${#EXPECT[@]}" -gt 0 ] ||
    echo "run_selftest.sh: WARNING: no kernel names found in $KRS: the CUDA backend's names are not checked" >&2

run_one() {
    local dir="$1"
    "$HERE/build.sh" "$dir"
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
