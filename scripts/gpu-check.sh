#!/usr/bin/env bash
# Every check of the CUDA backend that needs a GPU, on a machine with an NVIDIA
# GPU and its driver; no network, no cargo needed (it runs the prebuilt
# target/gpu-bundle that scripts/gpu-prebuild.sh made, or builds with cargo
# --offline where cargo works and ENGRAM_GPU_CHECK_BUILD=1).
#
# All logs go to OUTDIR; each step runs even when an earlier one failed, with
# its own time limit, under a total budget (ENGRAM_GPU_CHECK_BUDGET seconds,
# default 420: the script ends well inside 8 minutes). The steps' limits add
# up to no more than the budget (checked: ENGRAM_GPU_CHECK_DRY=1 prints the
# plan, each step's limit and the sum, runs nothing, and exits non-zero if the
# sum is over the budget; scripts/test.sh runs it). The steps run in the order
# of their value for a short run: the environment (torch probed first), a
# golden sanity check, the benchmark's decode rows, then the rest, with the
# full benchmark last; the benchmark prints each row as it is measured, so a
# step cut by its limit still leaves the rows it got. OUTDIR/summary.txt lists
# every step as PASS, FAIL or SKIP with its exit status and time; the exit
# status is 0 only if nothing failed. Steps that need the CUDA toolkit (a C or
# C++ program against cudart) SKIP, saying why, where there is none. The
# kernels come compiled in the bundle (target/gpu-bundle/modules, cubins for
# sm_90 and sm_100); every process of the run loads them from OUTDIR/modules
# (ENGRAM_CUDA_MODULE_DIR), where NVRTC on this machine also leaves what it
# has to compile (another architecture, changed sources) for the next process.
#
#   env          whether torch with CUDA imports (said first), the GPU, driver,
#                toolkit, the CUDA libraries the loader sees
#   prepare      the bundle into OUTDIR/bin, its modules into OUTDIR/modules
#   golden       tests/cuda_golden.rs's every_golden_regime_on_the_device: a
#                sanity check of the whole apply against the golden
#   bench-decode benches/gpu.rs --decode-only: the decode kernel's rows (bf16
#                and fp8 wkv, 1..64 tokens) against the GEMV, cuBLAS, roofline
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
#   device-cache tests/cuda_device_cache.rs: the device row cache of host
#                tables (device_cache_bytes): the device table's bits through
#                caches that evict on every call, hit and miss counts as the
#                policy predicts, engram_stage + device ids reading hits
#                (engram_cache_fill and the gather's slot indices on a GPU)
#   gpu-split    tests/fp8_split.rs: a device table whose fp8 codes and scales
#                are two arrays (engram_gather_split) gives the CPU's bits
#   gpu-streams  tests/cuda_streams.rs: misaligned device pointers refused with
#                nothing queued, a token's bits the same in every batch of 1-8
#                tokens, a graph re-captured after set_layer uses the new weights
#                (captured: the decode kernel's split path; direct: cooperative)
#   gpu-shards   (ENGRAM_GPU_CHECK_EXTRA=1; the budget is full) tests/cuda_shards.rs:
#                the split calls on device buffers, worlds 1..5, each layout,
#                equal to the whole layer's bits
#   py-torch-cuda (ENGRAM_GPU_CHECK_EXTRA=1; the budget is full) python/tests/
#                test_torch_cuda.py's GPU test: the torch ops on CUDA tensors
#                (host and device row ids, f32/bf16 highways, the split ops) equal
#                to the CPU backend's bits; the package installed with the bundle's
#                libengram.so into OUTDIR/py (no network: --no-build-isolation);
#                SKIP where ENGRAM_TORCH_PYTHON lacks torch with CUDA, pytest or
#                setuptools (with bdist_wheel)
#   gpu-fp8-wkv  tests/cuda_fp8_wkv.rs: the checkpoint's block-scaled fp8 wkv read
#                in place (engram_gemv_fp8_block; exact bf16 tiles + cuBLAS) gives
#                the bits of the same weights widened to bf16, 1..512 tokens
#   gpu-decode   tests/cuda_decode.rs: the decode kernel (issue 17) launched
#                cooperatively on the GPU (the driver takes it: its
#                DecodeStats say so), kv the documented sum bit for bit for
#                1..64 tokens, each token's kv and highway the same bits in
#                every batch of 1..64, the GEMV's bits for 1..8
#   gpu-decode-mps  the same under MPS (ENGRAM_GPU_CHECK_MPS=1: starts its own
#                control daemon in a private pipe directory (mktemp -d), which
#                a trap stops however the step ends; it changes no device
#                setting (no compute mode, no persistence)), with all SMs and with
#                CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25: the cooperative launch
#                taken, or refused and the split path giving the same bits;
#                SKIP unless asked for, without nvidia-cuda-mps-control, or
#                where another MPS daemon answers (then the step cannot own it)
#   device-hash  tests/device_hash.rs on the GPU (engram_hash_device against the
#                host hash: golden regimes, V4.1 texts, dead tokens, many sequences,
#                errors, random steps) and tests/cuda_golden.rs's capture of the
#                device hash + the apply of both layers in one CUDA graph,
#                replayed for 64 decode steps against the host path; SKIP
#                without a driver
#   c-cuda       c_tests/cuda/test_cuda_apply.c: the C ABI with the program's
#                own stream and buffers; graph replay; host tables with
#                engram_stage + graph replay; GGUF on CUDA (needs the toolkit)
#   cpp-host     examples/cpp_host with ENGRAM_EXAMPLE_CUDA (needs the toolkit;
#                ENGRAM_GPU_CHECK_EXTRA=1 only)
#   nvrtc        every kernel compiles with this machine's NVRTC, no warning
#                (ENGRAM_GPU_CHECK_EXTRA=1 only: the build machine checks it)
#   cpp-host     (ENGRAM_GPU_CHECK_EXTRA=1 only)
#   bench        benches/gpu.rs --no-decode: apply at the V4.1 geometry for
#                1..4096 tokens against torch eager and the measured roofline (GEMM rate at the
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
DRY="${ENGRAM_GPU_CHECK_DRY:-0}"
START=$SECONDS
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0
PLANNED=0
BIN="$OUT/bin"
mkdir -p "$BIN"
# The bundled binaries read tests/golden/data and bench/gpu_peer.py from here.
export ENGRAM_SOURCE_ROOT="$ROOT"
# Every process of the run loads (and leaves) its compiled kernels here.
export ENGRAM_CUDA_MODULE_DIR="$OUT/modules"
export OUT ROOT CUDA_HOME ENGRAM_TORCH_PYTHON BIN
[ "$DRY" = 1 ] && echo "dry run: the plan (step, limit), nothing runs; budget ${BUDGET}s"

# step NAME LIMIT_S COMMAND...: run it with its output in OUTDIR/NAME.log, for at
# most LIMIT_S seconds and never past the budget. Exit 77 means SKIP. In a dry
# run: print the step and its limit, and add the limit to the plan's sum.
step() {
    local name="$1" limit="$2"
    shift 2
    PLANNED=$((PLANNED + limit))
    if [ "$DRY" = 1 ]; then
        printf '  %-16s %4ss  (sum %4ss)  %s\n' "$name" "$limit" "$PLANNED" "$*"
        return
    fi
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

# optional VAR NAME WHY: a step that runs only with VAR=1 (its limit is not
# planned otherwise); else SKIP, saying why.
optional() {
    local var="$1" name="$2" why="$3"
    shift 3
    if [ "${!var:-0}" = 1 ]; then
        step "$name" "$@"
    elif [ "$DRY" = 1 ]; then
        printf '  %-16s  (not planned: %s=1 runs it; %s)\n' "$name" "$var" "$why"
    else
        echo "SKIP $name (not asked for: $var=1 runs it; $why)" | tee -a "$SUMMARY"
    fi
}

torch_probe() { # one line: whether torch imports here with CUDA (the peer's columns)
    local out
    if out="$(timeout 25 "$ENGRAM_TORCH_PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available" if torch.cuda.is_available() else "NOT available")' 2>&1)"; then
        echo "$out" | tail -n 1
    else
        echo "torch NOT importable with $ENGRAM_TORCH_PYTHON (the benchmark's torch columns will be empty): $(echo "$out" | tail -n 1)"
    fi
}
export -f torch_probe
env_info() {
    set +e
    echo "torch probe: $(torch_probe)"
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
    return 0
}
export -f env_info
step env 30 env_info
[ "$DRY" = 1 ] || grep '^torch probe:' "$OUT/env.log" | tee -a "$SUMMARY"

# The binaries: the bundle, or a cargo build here when asked.
prepare() {
    if [ "${ENGRAM_GPU_CHECK_BUILD:-0}" = 1 ]; then
        bash scripts/gpu-prebuild.sh || return 1
    fi
    [ -f target/gpu-bundle/ROOT ] || {
        echo "target/gpu-bundle is missing: run scripts/gpu-prebuild.sh where cargo works and carry it"
        return 1
    }
    cp target/gpu-bundle/* "$BIN/" 2>/dev/null
    mkdir -p "$ENGRAM_CUDA_MODULE_DIR"
    if [ -d target/gpu-bundle/modules ]; then
        cp target/gpu-bundle/modules/* "$ENGRAM_CUDA_MODULE_DIR/"
        echo "carried kernel modules: $(ls "$ENGRAM_CUDA_MODULE_DIR" | tr '\n' ' ')"
    else
        echo "no carried kernel modules: the first test process compiles them with NVRTC here"
    fi
    # The binaries read their data through ENGRAM_SOURCE_ROOT (this tree).
    echo "bundle built in $(cat "$BIN/ROOT"); ENGRAM_SOURCE_ROOT=$ENGRAM_SOURCE_ROOT"
    [ -f "$ENGRAM_SOURCE_ROOT/tests/golden/data/tiny.json" ] || { echo "no tests/golden/data here"; return 1; }
    chmod +x "$BIN"/cuda_* "$BIN"/gpu_bench
    ls -la "$BIN"
}
export -f prepare
step prepare 15 prepare

# By value: a golden sanity check, the decode rows of the benchmark (printed
# as measured), the decode tests, then the rest.
step golden 25 env ENGRAM_REQUIRE_GPU=1 "$BIN/cuda_golden" --exact every_golden_regime_on_the_device --nocapture
step bench-decode 55 env ENGRAM_REQUIRE_GPU=1 "$BIN/gpu_bench" --decode-only
step gpu-decode 35 env ENGRAM_REQUIRE_GPU=1 "$BIN/cuda_decode" --test-threads=1 --nocapture
step gpu-tests 40 env ENGRAM_REQUIRE_GPU=1 "$BIN/cuda_golden" --test-threads=1 --nocapture --skip every_golden_regime_on_the_device

# The decode kernel under MPS (optional): a control daemon of the step's own,
# in a private pipe directory, stopped by a trap however the step ends (the
# step's timeout sends TERM; the test runs in the background so that the trap
# runs at once). It changes no device setting. SKIP (77) where that cannot be
# guaranteed: no nvidia-cuda-mps-control, no mktemp, or a daemon that did not
# start in our directory.
decode_mps() {
    command -v nvidia-cuda-mps-control >/dev/null 2>&1 || { echo "no nvidia-cuda-mps-control"; exit 77; }
    # Globals, not locals: the EXIT trap runs after this function returns.
    MPS_DIR="$(mktemp -d /tmp/engram-mps.XXXXXX)" || { echo "no private pipe directory (mktemp -d)"; exit 77; }
    MPS_CHILD=""
    chmod 700 "$MPS_DIR"
    export CUDA_MPS_PIPE_DIRECTORY="$MPS_DIR/pipe" CUDA_MPS_LOG_DIRECTORY="$MPS_DIR/log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    stop_mps() {
        [ -n "$MPS_CHILD" ] && kill "$MPS_CHILD" 2>/dev/null
        echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
        cp -r "$CUDA_MPS_LOG_DIRECTORY" "$OUT/mps-log" 2>/dev/null
        rm -rf "$MPS_DIR"
    }
    trap stop_mps EXIT
    trap 'exit 143' TERM INT HUP
    nvidia-cuda-mps-control -d || { echo "the MPS control daemon did not start"; exit 77; }
    [ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || { echo "the MPS daemon did not open its pipe in $MPS_DIR"; exit 77; }
    local rc=0
    ENGRAM_REQUIRE_GPU=1 ENGRAM_MPS_CHECK=1 "$BIN/cuda_decode" --test-threads=1 --nocapture &
    MPS_CHILD=$!
    wait "$MPS_CHILD" || rc=1
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 ENGRAM_REQUIRE_GPU=1 ENGRAM_MPS_CHECK=1 \
        "$BIN/cuda_decode" --test-threads=1 --nocapture &
    MPS_CHILD=$!
    wait "$MPS_CHILD" || rc=1
    MPS_CHILD=""
    return $rc
}
export -f decode_mps

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
step device-hash 30 device_hash
step gpu-streams 20 env ENGRAM_REQUIRE_GPU=1 "$BIN/cuda_streams" --test-threads=1 --nocapture
step gpu-formats 25 env ENGRAM_REQUIRE_GPU=1 "$BIN/cuda_formats" --test-threads=1 --nocapture
step gpu-fp8-wkv 20 env ENGRAM_REQUIRE_GPU=1 "$BIN/cuda_fp8_wkv" --test-threads=1 --nocapture
step host-tables 20 env ENGRAM_REQUIRE_GPU=1 "$BIN/cuda_host_tables" --test-threads=1 --nocapture
step device-cache 15 env ENGRAM_REQUIRE_GPU=1 "$BIN/cuda_device_cache" --test-threads=1 --nocapture
step gpu-split 10 env ENGRAM_REQUIRE_GPU=1 "$BIN/fp8_split" --test-threads=1 --nocapture

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
step c-cuda 20 c_cuda

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
step bench 60 env ENGRAM_REQUIRE_GPU=1 "$BIN/gpu_bench" --no-decode
optional ENGRAM_GPU_CHECK_MPS gpu-decode-mps "MPS: a daemon of its own for the step" 60 decode_mps
optional ENGRAM_GPU_CHECK_EXTRA nvrtc "the build machine's nvrtc-check.sh compiles every kernel" \
    60 env ENGRAM_REQUIRE_NVRTC=1 "$BIN/cuda_nvrtc" --test-threads=1 --nocapture
optional ENGRAM_GPU_CHECK_EXTRA cpp-host "examples/cpp_host on CUDA" 30 cpp_host_cuda
optional ENGRAM_GPU_CHECK_EXTRA gpu-shards "tests/cuda_shards.rs: the split calls on device buffers (issue 37)" \
    15 env ENGRAM_REQUIRE_GPU=1 "$BIN/cuda_shards" --test-threads=1 --nocapture
py_torch_cuda() { # the torch ops on CUDA tensors against the CPU backend (issue 37)
    # --no-build-isolation (no network): setuptools builds the wheel itself
    # (bdist_wheel is in setuptools >= 70.1, in the wheel package before).
    "$ENGRAM_TORCH_PYTHON" -c 'import importlib.util as u, torch, pytest, setuptools
assert torch.cuda.is_available()
assert u.find_spec("wheel") or u.find_spec("setuptools.command.bdist_wheel")' ||
        { echo "SKIP: $ENGRAM_TORCH_PYTHON lacks torch with CUDA, pytest or setuptools' bdist_wheel"; return 77; }
    ENGRAM_LIB="$BIN/libengram.so" "$ENGRAM_TORCH_PYTHON" -m pip install --quiet --no-deps --no-build-isolation \
        --no-index --target "$OUT/py" "$ROOT/python" || return 1
    (cd "$OUT" && PYTHONPATH="$OUT/py" ENGRAM_REQUIRE_GPU=1 ENGRAM_SOURCE_DIR="$ROOT" "$ENGRAM_TORCH_PYTHON" -m pytest \
        -q -rs -p no:cacheprovider "$ROOT/python/tests/test_torch_cuda.py" -k test_cuda_ops_bit_for_bit)
}
export -f py_torch_cuda
optional ENGRAM_GPU_CHECK_EXTRA py-torch-cuda "python/tests/test_torch_cuda.py on the GPU (issue 37)" \
    30 py_torch_cuda

if [ "$DRY" = 1 ]; then
    echo "planned: ${PLANNED}s of a ${BUDGET}s budget"
    [ "$PLANNED" -le "$BUDGET" ] || { echo "FAIL: the steps' limits add up to more than the budget"; exit 1; }
    exit 0
fi
cat "$OUT/bench-decode.log" "$OUT/bench.log" 2>/dev/null | sed -n '/^## /,$p' >"$OUT/BENCHMARKS-candidate.md"

echo "== summary ($SUMMARY), $((SECONDS - START))s in all"
cat "$SUMMARY"
P=$(grep -c '^PASS' "$SUMMARY" || true)
S=$(grep -c '^SKIP' "$SUMMARY" || true)
echo "$P passed, $S skipped, $FAILED failed"
[ "$FAILED" -eq 0 ]
