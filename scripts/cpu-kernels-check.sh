#!/usr/bin/env bash
# The CPU kernels on a machine of the other kind: this project's CI machine
# has AVX2 but no AVX-512, so the AVX-512 kernels (projection, hash) only run
# where the CPU has them. This script tests and measures them there.
#
#   bash scripts/cpu-kernels-check.sh prebuild      # here: release binaries into target/cpu-bundle
#   bash scripts/cpu-kernels-check.sh run OUTDIR    # there (any x86-64 Linux, no cargo needed)
#
# run: 1. the CPU's features; 2. the library's unit tests (every kernel the CPU
# runs: portable, AVX2 and AVX-512 projection, every hash reduction, each
# against the others and the references, batch invariance); 3. the CPU
# benchmark with the detected kernel and with the AVX2 kernel forced, on 2
# threads and on all cores (peers with ENGRAM_BENCH_PYTHON, default python3,
# skipped if it lacks numpy/torch). Logs and summary.txt go to OUTDIR; the
# exit status is 0 only if the tests passed. About 10 minutes with peers.
set -uo pipefail
cd "$(dirname "$0")/.."
B=target/cpu-bundle
case "${1:-}" in
prebuild)
    set -e
    rm -rf "$B" && mkdir -p "$B"
    exe_of() {
        python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1] and sys.argv[2] in m["target"]["kind"]:
        print(m["executable"])
' "$1" "$2"
    }
    cp "$(cargo test --release --lib --no-run --message-format=json 2>/dev/null | exe_of engram rlib)" "$B/unit_tests"
    cp "$(cargo bench --bench cpu --no-run --message-format=json 2>/dev/null | exe_of cpu bench)" "$B/cpu_bench"
    strip --strip-debug "$B/unit_tests" "$B/cpu_bench"
    git rev-parse HEAD >"$B/COMMIT" 2>/dev/null || true
    du -sh "$B"
    ;;
run)
    OUT="${2:?usage: bash scripts/cpu-kernels-check.sh run OUTDIR}"
    mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
    export ENGRAM_ROOT="$(pwd)"
    PY="${ENGRAM_BENCH_PYTHON:-python3}"
    # The peers need numpy and torch; without them (and without bench/.venv)
    # the benchmark says so and skips them.
    if "$PY" -c 'import numpy, torch' 2>/dev/null; then export ENGRAM_BENCH_PYTHON="$PY"; else unset ENGRAM_BENCH_PYTHON; fi
    rc=0
    { grep -m1 'model name' /proc/cpuinfo; nproc; grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E 'avx|fma|f16c|amx' | tr '\n' ' '; echo; } >"$OUT/env.log" 2>&1
    cat "$OUT/env.log"
    timeout 600 "$B/unit_tests" --test-threads 4 projection hash >"$OUT/unit_tests.log" 2>&1 || rc=1
    tail -n 3 "$OUT/unit_tests.log"
    echo "unit tests: $([ $rc -eq 0 ] && echo PASS || echo FAIL)" | tee "$OUT/summary.txt"
    all=$(nproc)
    for threads in $(printf "2\n%s\n" "$all" | sort -un); do
        # On AMX CPUs the detected kernel is amx: avx512 forced is its floor.
        kernels="detected avx2"
        if grep -qw amx_bf16 /proc/cpuinfo; then kernels="detected avx512 avx2"; fi
        for kernel in $kernels; do
            log="$OUT/bench-$threads-threads-$kernel.log"
            if [ "$kernel" = detected ]; then k=; else k=$kernel; fi
            ENGRAM_CPU_KERNEL=$k ENGRAM_BENCH_THREADS=$threads timeout 900 "$B/cpu_bench" --bench >"$log" 2>&1
            echo "bench $threads threads, kernel $kernel: exit $?" | tee -a "$OUT/summary.txt"
        done
    done
    exit $rc
    ;;
*)
    echo "usage: bash scripts/cpu-kernels-check.sh prebuild | run OUTDIR" >&2
    exit 2
    ;;
esac
