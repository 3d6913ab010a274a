#!/usr/bin/env bash
# The benchmark's Python peers: numpy (DeepSeek's hashing approach) and
# PyTorch on the CPU (the same engram forward). PyPI's torch wheel pulls its
# nvidia-* dependencies even for CPU use; they go into this private venv only.
# Usage: bash bench/setup.sh   (idempotent; about 4 GB on disk)
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/pip install --quiet --disable-pip-version-check numpy==2.4.6 torch==2.9.0
.venv/bin/python -c "import numpy, torch; print('numpy', numpy.__version__, 'torch', torch.__version__)"
