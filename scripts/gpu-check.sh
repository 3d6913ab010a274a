#!/usr/bin/env bash
# Every check of the CUDA backend that needs a GPU, on a machine with an NVIDIA
# GPU, its driver and the CUDA toolkit (and, for the benchmark's peer, PyTorch
# with CUDA). All logs go to OUTDIR; each step is run even when an earlier one
# failed, and OUTDIR/summary.txt lists every step as PASS or FAIL with its exit
# status and time. The exit status is 0 only if every step passed.
#
#   1. env         nvidia-smi, the toolkit, libcuda / libnvrtc / libcublas, torch
#   2. build       cargo build --release (offline) if cargo is here, else the
#                  prebuilt target/gpu-bundle (scripts/gpu-prebuild.sh made it)
#   3. nvrtc       every kernel compiles with this machine's NVRTC, no warning
#   4. gpu-tests   tests/cuda_golden.rs with ENGRAM_REQUIRE_GPU=1: every golden
#                  regime, graph replay, two contexts on two streams, device errors
#   5. c-cuda      c_tests/cuda/test_cuda_apply.c: the C ABI on CUDA with the
#                  program's own stream and device buffers (cc ... -lcudart)
#   6. gpu-formats tests/cuda_formats.rs: every table-row format (fp8, bf16,
#                  f16, f32, GGUF Q8_0/Q4_0/Q2_K..Q6_K) dequantised on the GPU
#                  gives the CPU backend's bf16 bits
#   6b. gpu-split  tests/fp8_split.rs: a table whose fp8 codes and scales are two
#                  arrays (engram_gather_split) gives the CPU backend's bits
#   7. cpp-host    examples/cpp_host built with ENGRAM_EXAMPLE_CUDA (its own
#                  cudaStream_t and device buffers), checked against the CPU
#                  backend; exit 77 (no CUDA backend) counts as a failure here
#   8. bench       benches/gpu.rs: apply at the V4.1 geometry against torch
#                  eager and the roofline
#
# Sized to finish in a few minutes (the benchmark is most of it).
#
# Usage: bash scripts/gpu-check.sh OUTDIR
#   CUDA_HOME (default /usr/local/cuda)   the toolkit
#   ENGRAM_TORCH_PYTHON (default python3) the Python with torch for the peer
#   ENGRAM_GPU_CHECK_USE_BUNDLE=1         skip cargo, use target/gpu-bundle
set -uo pipefail

OUT="${1:?usage: bash scripts/gpu-check.sh OUTDIR}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "$0")/.."
ROOT="$(pwd)"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export ENGRAM_TORCH_PYTHON="${ENGRAM_TORCH_PYTHON:-python3}"
# libnvrtc and libcublas of the toolkit, for the library's run-time loading.
for d in "$CUDA_HOME/lib64" "$CUDA_HOME/targets/x86_64-linux/lib"; do
    [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0

# step NAME TIMEOUT_S COMMAND...: run it with its output in OUTDIR/NAME.log.
step() {
    local name="$1" limit="$2"
    shift 2
    echo "== $name: $*"
    local t0=$SECONDS rc=0
    # Through bash -c so that a shell function (exported below) can be a step.
    timeout "$limit" bash -c '"$@"' bash "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    local dt=$((SECONDS - t0))
    tail -n 25 "$OUT/$name.log"
    if [ "$rc" -eq 0 ]; then
        echo "PASS $name (${dt}s)" | tee -a "$SUMMARY"
    else
        [ "$rc" -eq 124 ] && echo "(timed out after ${limit}s)" | tee -a "$OUT/$name.log"
        echo "FAIL $name (exit $rc, ${dt}s; see $name.log)" | tee -a "$SUMMARY"
        FAILED=$((FAILED + 1))
    fi
}

env_info() {
    set +e
    echo "date: $(date -u)"
    echo "commit: $(git rev-parse HEAD 2>/dev/null) (working tree may differ)"
    nvidia-smi
    "$CUDA_HOME/bin/nvcc" --version
    ldd --version | head -n 1
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    ldconfig -p | grep -E 'libcuda\.so|libnvrtc\.so|libcublas\.so|libcudart\.so'
    ls "$CUDA_HOME/lib64" 2>/dev/null | grep -E 'nvrtc|cublas|cudart' | head -n 20
    command -v cargo && cargo --version
    "$ENGRAM_TORCH_PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
    [ -f target/gpu-bundle/COMMIT ] && echo "bundle built from $(cat target/gpu-bundle/COMMIT) in $(cat target/gpu-bundle/ROOT)"
    return 0
}
export -f env_info
export OUT ROOT CUDA_HOME
step env 60 env_info

# --- build: cargo (offline) if possible, else the prebuilt bundle ---
BIN="$OUT/bin"
mkdir -p "$BIN"
build() {
    if [ "${ENGRAM_GPU_CHECK_USE_BUNDLE:-0}" != 1 ] && command -v cargo >/dev/null 2>&1 &&
        cargo build --release --offline --lib; then
        echo "# built with cargo here"
        cp target/release/libengram.so "$BIN/"
        local t exe
        for t in cuda_golden cuda_nvrtc cuda_formats fp8_split; do
            exe="$(cargo test --release --offline --test "$t" --no-run --message-format=json 2>/dev/null |
                python3 -c 'import json,sys
for l in sys.stdin:
    try: m=json.loads(l)
    except ValueError: continue
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]==sys.argv[1]: print(m["executable"])' "$t")"
            [ -n "$exe" ] || return 1
            cp "$exe" "$BIN/$t"
        done
        exe="$(cargo bench --offline --bench gpu --no-run --message-format=json 2>/dev/null |
            python3 -c 'import json,sys
for l in sys.stdin:
    try: m=json.loads(l)
    except ValueError: continue
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="gpu": print(m["executable"])')"
        [ -n "$exe" ] || return 1
        cp "$exe" "$BIN/gpu_bench"
        echo "$ROOT" >"$BIN/ROOT"
    else
        echo "# no cargo build here: using the prebuilt target/gpu-bundle"
        [ -f target/gpu-bundle/ROOT ] || { echo "target/gpu-bundle is missing: run scripts/gpu-prebuild.sh where cargo works and carry it"; return 1; }
        cp target/gpu-bundle/* "$BIN/"
    fi
    # The binaries read tests/golden/data and bench/gpu_peer.py under the
    # source path they were compiled in; point that path at this tree.
    local baked
    baked="$(cat "$BIN/ROOT")"
    if [ "$baked" != "$ROOT" ] && [ ! -e "$baked/tests/golden/data/tiny.json" ]; then
        mkdir -p "$(dirname "$baked")" && ln -sfn "$ROOT" "$baked" || return 1
        echo "# linked $baked -> $ROOT"
    fi
    chmod +x "$BIN"/cuda_golden "$BIN"/cuda_nvrtc "$BIN"/cuda_formats "$BIN"/fp8_split "$BIN"/gpu_bench
    ls -la "$BIN"
}
export -f build
export BIN
step build 420 build

# --- the checks ---
step nvrtc 120 env ENGRAM_REQUIRE_NVRTC=1 "$BIN/cuda_nvrtc" --nocapture
step gpu-tests 300 env ENGRAM_REQUIRE_GPU=1 "$BIN/cuda_golden" --test-threads=1 --nocapture

c_cuda() {
    local cc=gcc
    command -v gcc >/dev/null 2>&1 || cc="$CUDA_HOME/bin/nvcc"
    "$cc" -std=c11 -O1 -Wall -Wextra -I include -I c_tests -I "$CUDA_HOME/include" \
        c_tests/cuda/test_cuda_apply.c -L "$BIN" -lengram -Wl,-rpath,"$BIN" \
        -L "$CUDA_HOME/lib64" -lcudart -lm -o "$BIN/test_cuda_apply" || return 1
    "$BIN/test_cuda_apply" || return 1
    # run.sh's rule: every check printed PASS.
    ! grep -q '^FAIL' "$OUT/c-cuda.log"
}
export -f c_cuda
step c-cuda 120 c_cuda

step gpu-formats 120 env ENGRAM_REQUIRE_GPU=1 "$BIN/cuda_formats" --nocapture
step gpu-split 60 env ENGRAM_REQUIRE_GPU=1 "$BIN/fp8_split" --nocapture

# The C++ host example on CUDA, compiled straight against the header and the
# library built above (no install or CMake needed on the GPU machine).
cpp_host_cuda() {
    g++ -std=c++17 -O1 -Wall -Wextra -Werror -DENGRAM_EXAMPLE_CUDA=1 -I include -I "$CUDA_HOME/include" \
        examples/cpp_host/main.cpp -L "$BIN" -lengram -Wl,-rpath,"$BIN" \
        -L "$CUDA_HOME/lib64" -lcudart -o "$BIN/cpp_host_cuda" || return 1
    "$BIN/cpp_host_cuda"
}
export -f cpp_host_cuda
step cpp-host 120 cpp_host_cuda

step bench 400 env ENGRAM_REQUIRE_GPU=1 "$BIN/gpu_bench"
cp "$OUT/bench.log" "$OUT/BENCHMARKS-candidate.md" 2>/dev/null

echo "== summary ($OUT/summary.txt)"
cat "$SUMMARY"
P=$(grep -c '^PASS' "$SUMMARY" || true)
echo "$P passed, $FAILED failed"
[ "$FAILED" -eq 0 ]
