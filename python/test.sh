#!/usr/bin/env bash
# The Python package end to end, as a user installs it: `pip install ./python`
# into a virtualenv (ENGRAM_PY_VENV, default ${CARGO_TARGET_DIR:-target}/python-venv,
# made once and reused), which builds libengram.so with the same
# `cargo rustc --release --lib` as scripts/install.sh (so the install check's
# release build is reused) and generates the ctypes structs from
# include/engram.h; then pytest on python/tests against the installed package
# (the golden through Python, every error path, no-copy checks).
#
#   bash python/test.sh [pytest args...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

bash scripts/ensure-tools.sh
VENV="${ENGRAM_PY_VENV:-${CARGO_TARGET_DIR:-$ROOT/target}/python-venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
# A local directory is rebuilt and reinstalled on every run (pip does not
# trust its version number); numpy comes as the package's only dependency.
"$PY" -m pip install --quiet --disable-pip-version-check ./python pytest
# From the repository root, so `import engram` is the installed package,
# not python/engram (which has no library or generated structs).
env -u ENGRAM_LIBRARY "$PY" -m pytest -q -p no:cacheprovider python/tests "$@"
