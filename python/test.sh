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
# not python/engram (which has no library or generated structs). Without
# torch here: the torch tests skip, and the package must import without it.
env -u ENGRAM_LIBRARY "$PY" -m pytest -q -p no:cacheprovider python/tests "$@"

# The torch ops (python/tests/test_torch_ops.py, test_torch_cuda.py) and the
# gloo distributed test (test_distributed.py, and test_distributed_cuda.py on
# the CUDA backend's emulation) in a second virtualenv that has torch: made once and
# cached in ENGRAM_TORCH_VENV (default ~/.cache/engram/torch-2.9.0-venv, as
# bench/ggml caches its build). PyPI's torch==2.9.0 wheel needs its nvidia-*
# packages to import even on a CPU (about 5 GB; the CPU-only wheels live on
# download.pytorch.org, not on PyPI), so the first run downloads them.
# ENGRAM_PY_TORCH=0 skips this part.
if [ "${ENGRAM_PY_TORCH:-1}" != 0 ]; then
    TVENV="${ENGRAM_TORCH_VENV:-$HOME/.cache/engram/torch-2.9.0-venv}"
    if [ ! -f "$TVENV/.engram-complete" ]; then
        echo "# installing torch==2.9.0 into $TVENV (once)"
        rm -rf "$TVENV"
        python3 -m venv "$TVENV"
        "$TVENV/bin/pip" install --quiet --disable-pip-version-check torch==2.9.0 pytest
        touch "$TVENV/.engram-complete"
    fi
    "$TVENV/bin/pip" install --quiet --disable-pip-version-check ./python
    env -u ENGRAM_LIBRARY "$TVENV/bin/python" -m pytest -q -p no:cacheprovider \
        python/tests/test_torch_ops.py python/tests/test_torch_cuda.py python/tests/test_distributed.py "$@"

    # The gloo test again on the CUDA backend's SIMT emulation
    # (test_distributed_cuda.py), through libengram_emu.so (tools/engram-emu,
    # test only: libengram's C ABI plus engram_emu_* calls that load the
    # emulation and give out its device memory; libengram.so has no door to
    # it), named in ENGRAM_LIBRARY for this file only. A debug build, which
    # shares the lib with `cargo test`'s; the SIMT library is found in (or
    # built into) the target's tmp/, where the Rust tests build the same one.
    # Without g++ the test skips, unless ENGRAM_REQUIRE_EMULATION=1.
    cargo build --quiet -p engram-emu
    TARGET="${CARGO_TARGET_DIR:-target}"
    case "$TARGET" in /*) ;; *) TARGET="$ROOT/$TARGET" ;; esac
    ENGRAM_LIBRARY="$TARGET/debug/libengram_emu.so" ENGRAM_SIMT_DIR="$TARGET/tmp" "$TVENV/bin/python" \
        -m pytest -q -p no:cacheprovider python/tests/test_distributed_cuda.py "$@"
fi
