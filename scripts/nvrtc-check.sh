#!/usr/bin/env bash
# Compile every CUDA kernel (kernels/*.cu) with NVRTC for sm_80 and sm_90, and
# fail on any compile error or warning (tests/cuda_nvrtc.rs). Needs no GPU, no
# driver and no CUDA toolkit: libnvrtc comes from NVIDIA's
# nvidia-cuda-nvrtc-cu12 wheel on PyPI, installed once into a private venv
# under target/ (about 250 MB) and reused after that.
#
# Usage: bash scripts/nvrtc-check.sh
#        bash scripts/nvrtc-check.sh --lib-dir   only set up libnvrtc and print its
#                                                directory (scripts/gpu-prebuild.sh)
#   ENGRAM_NVRTC_LIB=/dir/with/libnvrtc.so.12   use that libnvrtc instead (no venv)
set -euo pipefail
cd "$(dirname "$0")/.."

NVRTC_WHEEL="nvidia-cuda-nvrtc-cu12==12.9.86"
VENV="target/nvrtc-venv"

lib_dir() { ls -d "$VENV"/lib/python3*/site-packages/nvidia/cuda_nvrtc/lib 2>/dev/null | head -n 1; }

if [ -n "${ENGRAM_NVRTC_LIB:-}" ]; then
    LIB="$ENGRAM_NVRTC_LIB"
else
    LIB="$(lib_dir || true)"
    if [ -z "$LIB" ] || [ ! -e "$LIB/libnvrtc.so.12" ]; then
        echo "# installing $NVRTC_WHEEL into $VENV" >&2
        mkdir -p target
        python3 -m venv "$VENV" >&2
        "$VENV/bin/pip" install --quiet --disable-pip-version-check "$NVRTC_WHEEL" >&2
        LIB="$(lib_dir)"
    fi
fi
if [ "${1:-}" = --lib-dir ]; then
    echo "$LIB"
    exit 0
fi
echo "# libnvrtc from $LIB"
LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ENGRAM_REQUIRE_NVRTC=1 \
    cargo test --test cuda_nvrtc -- --nocapture 2>&1 | tee target/nvrtc-check.log
grep -q "test result: ok" target/nvrtc-check.log
