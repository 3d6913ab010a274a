#!/usr/bin/env bash
# Every check of the CUDA backend that needs a GPU, on a machine with an NVIDIA
# GPU and its driver; no network, no cargo needed (it runs the prebuilt
# target/gpu-bundle that scripts/gpu-prebuild.sh made, or builds with cargo
# --offline where cargo works and ENGRAM_GPU_CHECK_BUILD=1).
#
# All logs go to OUTDIR; each step runs even when an earlier one failed, with
# its own time limit, under a total budget (ENGRAM_GPU_CHECK_BUDGET seconds,
# default 420: the script ends well inside 8 minutes). OUTDIR/summary.txt lists
# every step as PASS, FAIL or SKIP with its exit status and time; the exit
# status is 0 only if nothing failed. Steps that need the CUDA toolkit (a C or
# C++ program against cudart) SKIP, saying why, where there is none.
#
#   env          the GPU, driver, toolkit, the CUDA libraries the loader sees, torch
#   nvrtc        every kernel compiles with this machine's NVRTC, no warning
#   gpu-tests    tests/cuda_golden.rs: every golden regime (f32/bf16 highway,
#                host/device ids, GEMV 1-8 and cuBLAS), a CUDA graph replay, two
#                contexts on two streams, device-found errors (first in the CPU's
#                order), argument checks, 64-bit offsets into a 384M-row table
#   gpu-formats  tests/cuda_formats.rs: every row format bit-identical to the CPU,
#                non-finite rows refused alike, every wkv format (f16, q8_0, q4_0,
#                q2_K..q6_K; fused GEMV and bf16 tiles + cuBLAS) within its bound
#   host-tables  tests/cuda_host_tables.rs: tables in host memory and in a file
#                (prefetch, staging), engram_stage + device ids, unstaged rows,
#                I/O errors
#   gpu-split    tests/fp8_split.rs: a device table whose fp8 codes and scales
#                are two arrays (engram_gather_split) gives the CPU's bits
#   gpu-streams  tests/cuda_streams.rs: misaligned device pointers refused with
#                nothing queued, a token's bits the same in every batch of 1-8
#                tokens, a graph re-captured after set_layer uses the new weights
#                (captured: the decode kernel's split path; direct: cooperative)
#   gpu-fp8-wkv  tests/cuda_fp8_wkv.rs: the checkpoint's block-scaled fp8 wkv read
#                in place (engram_gemv_fp8_block; exact bf16 tiles + cuBLAS) gives
#                the bits of the same weights widened to bf16, 1..512 tokens
#   gpu-decode   tests/cuda_decode.rs: the decode kernel (issue 17) launched
#                cooperatively on the GPU (the driver takes it: its
#                DecodeStats say so), kv the documented sum bit for bit for
#                1..64 tokens, each token's kv and highway the same bits in
#                every batch of 1..64, the GEMV's bits for 1..8
#   gpu-decode-mps  the same under MPS (ENGRAM_GPU_CHECK_MPS=1: starts its own
#                control daemon, pipes under OUTDIR), with all SMs and with
#                CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25: the cooperative launch
#                taken, or refused and the split path giving the same bits;
#                SKIP unless asked for or without nvidia-cuda-mps-control
#   device-hash  tests/device_hash.rs on the GPU (engram_hash_device against the
#                host hash: golden regimes, V4.1 texts, dead tokens, many sequences,
#                errors, random steps) and tests/cuda_golden.rs's capture of the
#                device hash + the apply of both layers in one CUDA graph,
#                replayed for 64 decode steps against the host path; SKIP
#                without a driver
#   c-cuda       c_tests/cuda/test_cuda_apply.c: the C ABI with the program's
#                own stream and buffers; graph replay; host tables with
#                engram_stage + graph replay; GGUF on CUDA (needs the toolkit)
#   cpp-host     examples/cpp_host with ENGRAM_EXAMPLE_CUDA (needs the toolkit)
#   bench        benches/gpu.rs: apply at the V4.1 geometry for 1..4096 tokens
#                (and the decode kernel, cooperative and split, against the
#                GEMV and cuBLAS for 1..64 tokens, bf16 and fp8 wkv, with its
#                grid and occupancy)
#                against torch eager and the measured roofline (GEMM rate at the
#                real shape on random data, highway bytes counted), each kernel's
#                time per row (a separate pass), quantised wkv, the host-table
#                path; its tables go to OUTDIR/BENCHMARKS-candidate.md
#
# Usage: bash scripts/gpu-check.sh OUTDIR
#   CUDA_HOME (default /usr/local/cuda)    the toolkit (headers, libcudart, nvcc)
#   ENGRAM_TORCH_PYTHON                    the Python with torch for the peer
#                                          (default /opt/torch/.venv/bin/python3 if
#                                          it exists, else python3)
set -uo pipefail

OUT="${1:?usage: bash scripts/gpu-check.sh OUTDIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
if [ -z "${ENGRAM_TORCH_PYTHON:-}" ]; then
    if [ -x /opt/torch/.venv/bin/python3 ]; then
        ENGRAM_TORCH_PYTHON=/opt/torch/.venv/bin/python3
    else
        ENGRAM_TORCH_PYTHON=python3
    fi
fi
BUDGET="${ENGRAM_GPU_CHECK_BUDGET:-420}"
START=$SECONDS
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0
BIN="$OUT/bin"
mkdir -p "$BIN"
# The bundled binaries read tests/golden/data and bench/gpu_peer.py from here.
export ENGRAM_SOURCE_ROOT="$ROOT"
export OUT ROOT CUDA_HOME ENGRAM_TORCH_PYTHON BIN

# step NAME LIMIT_S COMMAND...: run it with its output in OUTDIR/NAME.log, for at
# most LIMIT_S seconds and never past the budget. Exit 77 means SKIP.
step() {
    local name="$1" limit="$2"
    shift 2
    local left=$((BUDGET - (SECONDS - START)))
    if [ "$left" -lt 15 ]; then
        echo "FAIL $name (not run: the ${BUDGET}s budget is spent)" | tee -a "$SUMMARY"
        FAILED=$((FAILED + 1))
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (at most ${limit}s): $*"
    local t0=$SECONDS rc=0
    # Through bash -c so that a shell function (exported below) can be a step.
    timeout -k 5 "$limit" bash -c '"$@"' bash "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    local dt=$((SECONDS - t0))
    tail -n 20 "$OUT/$name.log"
    if [ "$rc" -eq 0 ]; then
        echo "PASS $name (${dt}s)" | tee -a "$SUMMARY"
    elif [ "$rc" -eq 77 ]; then
        echo "SKIP $name ($(tail -n 1 "$OUT/$name.log"))" | tee -a "$SUMMARY"
    else
        [ "$rc" -eq 124 ] && echo "(timed out after ${limit}s)" | tee -a "$OUT/$name.log"
        echo "FAIL $name (exit $rc, ${dt}s; see $name.log)" | tee -a "$SUMMARY"
        FAILED=$((FAILED + 1))
    fi
}

env_info() {
    set +e
    echo "date: $(date -u)"
    echo "tree: $(git rev-parse HEAD 2>/dev/null || echo '(no git)') at $ROOT"
    [ -f target/gpu-bundle/COMMIT ] && echo "bundle: $(cat target/gpu-bundle/COMMIT) built in $(cat target/gpu-bundle/ROOT)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv
    nvidia-smi | head -n 15
    ls -d "$CUDA_HOME" && "$CUDA_HOME/bin/nvcc" --version | tail -n 2
    ldd --version | head -n 1
    command -v gcc g++ cc
    echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
    ldconfig -p | grep -E 'libcuda\.so|libnvrtc\.so|libcublas\.so|libcudart\.so'
    ls /opt/torch/.venv/lib/python3*/site-packages/nvidia/cu13/lib 2>/dev/null | head -n 20
    "$ENGRAM_TORCH_PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
    return 0
}
export -f env_info
step env 30 env_info

# The binaries: the bundle, or a cargo build here when asked.
prepare() {
    if [ "${ENGRAM_GPU_CHECK_BUILD:-0}" = 1 ]; then
        bash scripts/gpu-prebuild.sh || return 1
    fi
    [ -f target/gpu-bundle/ROOT ] || {
        echo "target/gpu-bundle is missing: run scripts/gpu-prebuild.sh where cargo works and carry it"
        return 1
    }
    cp target/gpu-bundle/* "$BIN/"
    # The binaries read their data through ENGRAM_SOURCE_ROOT (this tree).
    echo "bundle built in $(cat "$BIN/ROOT"); ENGRAM_SOURCE_ROOT=$ENGRAM_SOURCE_ROOT"
    [ -f "$ENGRAM_SOURCE_ROOT/tests/golden/data/tiny.json" ] || { echo "no tests/golden/data here"; return 1; }
    chmod +x "$BIN"/cuda_* "$BIN"/gpu_bench
    ls -la "$BIN"
}
export -f prepare
step prepare 60 prepare

step nvrtc 60 env ENGRAM_REQUIRE_NVRTC=1 "$BIN/cuda_nvrtc" --test-threads=1 --nocapture
step gpu-tests 150 env ENGRAM_REQUIRE_GPU=1 "$BIN/cuda_golden" --test-threads=1 --nocapture
step gpu-formats 90 env ENGRAM_REQUIRE_GPU=1 "$BIN/cuda_formats" --test-threads=1 --nocapture
step host-tables 90 env ENGRAM_REQUIRE_GPU=1 "$BIN/cuda_host_tables" --test-threads=1 --nocapture
step gpu-split 60 env ENGRAM_REQUIRE_GPU=1 "$BIN/fp8_split" --test-threads=1 --nocapture
step gpu-streams 60 env ENGRAM_REQUIRE_GPU=1 "$BIN/cuda_streams" --test-threads=1 --nocapture
step gpu-fp8-wkv 60 env ENGRAM_REQUIRE_GPU=1 "$BIN/cuda_fp8_wkv" --test-threads=1 --nocapture
step gpu-decode 60 env ENGRAM_REQUIRE_GPU=1 "$BIN/cuda_decode" --test-threads=1 --nocapture

# The decode kernel's cooperative launch under MPS (optional: it starts a
# control daemon of its own for the step's duration).
decode_mps() {
    [ "${ENGRAM_GPU_CHECK_MPS:-0}" = 1 ] || { echo "MPS not asked for (ENGRAM_GPU_CHECK_MPS=1)"; exit 77; }
    command -v nvidia-cuda-mps-control >/dev/null 2>&1 || { echo "no nvidia-cuda-mps-control"; exit 77; }
    export CUDA_MPS_PIPE_DIRECTORY="$OUT/mps/pipe" CUDA_MPS_LOG_DIRECTORY="$OUT/mps/log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || { echo "the MPS control daemon did not start"; exit 77; }
    local rc=0
    ENGRAM_REQUIRE_GPU=1 ENGRAM_MPS_CHECK=1 "$BIN/cuda_decode" --test-threads=1 --nocapture || rc=1
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 ENGRAM_REQUIRE_GPU=1 ENGRAM_MPS_CHECK=1 \
        "$BIN/cuda_decode" --test-threads=1 --nocapture || rc=1
    echo quit | nvidia-cuda-mps-control
    return $rc
}
export -f decode_mps
step gpu-decode-mps 120 decode_mps

# The device hash (issue 18, docs/device-hash.md); SKIP where no driver loads.
device_hash() {
    python3 -c 'import ctypes; ctypes.CDLL("libcuda.so.1")' 2>/dev/null ||
        { echo "no CUDA driver (libcuda.so.1) here"; exit 77; }
    [ -x "$BIN/device_hash" ] || { echo "the bundle has no device_hash: rerun scripts/gpu-prebuild.sh"; return 1; }
    ENGRAM_REQUIRE_GPU=1 "$BIN/device_hash" --test-threads=1 --nocapture || return 1
    ENGRAM_REQUIRE_GPU=1 "$BIN/cuda_golden" --exact a_captured_device_hash_and_apply_replays_64_decode_steps \
        --nocapture | tee "$OUT/device-hash-graph.out" || return 1
    grep -q "64 replays of the captured hash" "$OUT/device-hash-graph.out"
}
export -f device_hash
step device-hash 90 device_hash

toolkit() { # a compiler and the CUDA runtime's header and library, or exit 77
    [ -f "$CUDA_HOME/include/cuda_runtime_api.h" ] || { echo "no CUDA toolkit headers in $CUDA_HOME/include"; exit 77; }
    ls "$CUDA_HOME"/lib64/libcudart.so* >/dev/null 2>&1 ||
        ls "$CUDA_HOME"/targets/*/lib/libcudart.so* >/dev/null 2>&1 || { echo "no libcudart in $CUDA_HOME"; exit 77; }
}
export -f toolkit
c_cuda() {
    set -o pipefail
    toolkit
    local cc=gcc
    command -v gcc >/dev/null 2>&1 || cc="$CUDA_HOME/bin/nvcc"
    command -v "$cc" >/dev/null 2>&1 || { echo "no C compiler (gcc or nvcc)"; exit 77; }
    "$cc" -std=c11 -O1 -Wall -Wextra -I include -I c_tests -I "$CUDA_HOME/include" \
        c_tests/cuda/test_cuda_apply.c -L "$BIN" -lengram -Wl,-rpath,"$BIN" \
        -L "$CUDA_HOME/lib64" -L "$CUDA_HOME/targets/x86_64-linux/lib" -lcudart -lm -o "$BIN/test_cuda_apply" || return 1
    "$BIN/test_cuda_apply" | tee "$OUT/c-cuda.out" || return 1
    # run.sh's rule: every check printed PASS.
    ! grep -q '^FAIL' "$OUT/c-cuda.out"
}
export -f c_cuda
step c-cuda 90 c_cuda

# The C++ host example on CUDA, compiled straight against the header and the
# bundled library (no install or CMake needed on the GPU machine).
cpp_host_cuda() {
    toolkit
    command -v g++ >/dev/null 2>&1 || { echo "no g++"; exit 77; }
    g++ -std=c++17 -O1 -Wall -Wextra -Werror -DENGRAM_EXAMPLE_CUDA=1 -I include -I "$CUDA_HOME/include" \
        examples/cpp_host/main.cpp -L "$BIN" -lengram -Wl,-rpath,"$BIN" \
        -L "$CUDA_HOME/lib64" -L "$CUDA_HOME/targets/x86_64-linux/lib" -lcudart -o "$BIN/cpp_host_cuda" || return 1
    "$BIN/cpp_host_cuda"
}
export -f cpp_host_cuda
step cpp-host 90 cpp_host_cuda

step bench 240 env ENGRAM_REQUIRE_GPU=1 "$BIN/gpu_bench"
sed -n '/^## /,$p' "$OUT/bench.log" >"$OUT/BENCHMARKS-candidate.md" 2>/dev/null

echo "== summary ($SUMMARY), $((SECONDS - START))s in all"
cat "$SUMMARY"
P=$(grep -c '^PASS' "$SUMMARY" || true)
S=$(grep -c '^SKIP' "$SUMMARY" || true)
echo "$P passed, $S skipped, $FAILED failed"
[ "$FAILED" -eq 0 ]
