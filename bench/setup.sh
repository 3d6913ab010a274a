#!/usr/bin/env bash
# The benchmark's peers: numpy (DeepSeek's hashing approach) and PyTorch on
# the CPU (the same engram forward), and ggml's CPU backend (llama.cpp's op
# chain; bench/ggml/build.sh). PyPI's torch wheel pulls its nvidia-*
# dependencies even for CPU use; they go into this private venv only.
# Usage: bash bench/setup.sh   (idempotent; about 4 GB on disk, ggml's build
# cached in ~/.cache/engram)
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install --quiet --disable-pip-version-check numpy==2.4.6 torch==2.9.0
.venv/bin/python -c "import numpy, torch; print('numpy', numpy.__version__, 'torch', torch.__version__)"

# The ggml peer (issue 19): ggml's CPU backend from the llama.cpp sources that
# llama-cpp-python 0.3.36's sdist vendors (built once, cached outside the
# checkout), and the C++ driver that `cargo bench --bench cpu` runs, for
# both ggml builds it compares against: the portable AVX2 one and the one
# for this CPU (GGML_NATIVE=ON). The bench builds them itself when they are
# missing; building them here takes that wait out of its first run.
cd ..
bash bench/ggml/build.sh >/dev/null
ENGRAM_GGML_NATIVE=1 bash bench/ggml/build.sh >/dev/null
