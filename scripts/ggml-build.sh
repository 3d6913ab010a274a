#!/usr/bin/env bash
# Build ggml's CPU backend from the llama.cpp sources that PyPI's
# llama-cpp-python sdist vendors, once, and cache the result outside the
# checkout. Used by the ggml integration test (integrations/ggml/test.sh, in
# the test command) and by the ggml peer of the CPU benchmark (bench/setup.sh).
#
#   bash scripts/ggml-build.sh          prints the install prefix on stdout
#                                       (progress goes to stderr)
#
# The sdist is fetched with pip (`pip download --no-binary`, in a private venv
# in the cache), its sha256 checked against the pin below, and only
# vendor/llama.cpp/ggml kept. CMake, CPU only, Release, static libraries.
# Instruction set: AVX2 + FMA + F16C + BMI2 set explicitly (GGML_NATIVE=OFF),
# so the build is the same on every AVX2 machine (CI is a 2-core AVX2 machine);
# ENGRAM_GGML_NATIVE=1 builds with -march=native instead (an AVX-512 host).
# The cache directory is keyed by the sdist's version, its sha256, the
# compiler's version and the CMake flags, so a change of any of them builds
# anew; a finished build is reused (a few seconds). The first build takes a
# few minutes on 2 cores.
#
# Environment: ENGRAM_GGML_CACHE (default ${XDG_CACHE_HOME:-$HOME/.cache}/engram),
#              ENGRAM_GGML_NATIVE=1, ENGRAM_GGML_JOBS (default: nproc).
set -euo pipefail

LCP_VERSION="0.3.36"
LCP_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
# The llama.cpp commit this sdist vendors, as its CHANGELOG names it (checked
# against the CHANGELOG below; ggml_commit() in the built library returns it).
LLAMA_CPP_COMMIT="0c1e57098"

log() { echo "ggml-build: $*" >&2; }
die() { log "$*"; exit 1; }

command -v cmake >/dev/null 2>&1 || die "cmake missing (bash scripts/ensure-tools.sh installs it)"
command -v python3 >/dev/null 2>&1 || die "python3 missing"
CC_BIN="${CC:-cc}"
CXX_BIN="${CXX:-c++}"
command -v "$CC_BIN" >/dev/null 2>&1 || die "no C compiler ($CC_BIN)"
command -v "$CXX_BIN" >/dev/null 2>&1 || die "no C++ compiler ($CXX_BIN)"

CMAKE_ARGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DCMAKE_POSITION_INDEPENDENT_CODE=ON
    -DGGML_CPU=ON
    -DGGML_BACKEND_DL=OFF
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF
    -DGGML_OPENCL=OFF -DGGML_SYCL=OFF -DGGML_HIP=OFF -DGGML_RPC=OFF
    -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF -DGGML_CCACHE=OFF
    -DGGML_OPENMP=ON
)
if [ "${ENGRAM_GGML_NATIVE:-0}" = 1 ]; then
    CMAKE_ARGS+=(-DGGML_NATIVE=ON)
    ISA="native"
else
    CMAKE_ARGS+=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
        -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF)
    ISA="avx2"
fi

CACHE_ROOT="${ENGRAM_GGML_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/engram}/ggml-$LCP_VERSION"
KEY_TEXT="llama-cpp-python $LCP_VERSION $LCP_SHA256
$("$CC_BIN" --version | head -n 1)
$("$CXX_BIN" --version | head -n 1)
$(cmake --version | head -n 1)
${CMAKE_ARGS[*]}"
if [ "$ISA" = native ]; then
    # -march=native depends on the machine it runs on.
    KEY_TEXT="$KEY_TEXT
$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)"
fi
KEY="$(printf '%s' "$KEY_TEXT" | sha256sum | cut -c1-16)"
PREFIX="$CACHE_ROOT/$ISA-$KEY"

if [ -f "$PREFIX/.complete" ]; then
    log "cached: $PREFIX ($(cat "$PREFIX/VERSION"))"
    echo "$PREFIX"
    exit 0
fi

mkdir -p "$CACHE_ROOT"
# One build at a time per cache (other shells may run the test command too).
exec 9>"$CACHE_ROOT/.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi
if [ -f "$PREFIX/.complete" ]; then
    log "cached (built meanwhile): $PREFIX"
    echo "$PREFIX"
    exit 0
fi

# The sources: the sdist's vendored ggml, unpacked once per sdist.
SRC="$CACHE_ROOT/src"
if [ ! -f "$SRC/.complete" ]; then
    rm -rf "$SRC" "$CACHE_ROOT/dl"
    mkdir -p "$CACHE_ROOT/dl"
    if [ ! -x "$CACHE_ROOT/venv/bin/pip" ]; then
        log "creating a venv for pip in $CACHE_ROOT/venv"
        python3 -m venv "$CACHE_ROOT/venv" >&2 || die "python3 -m venv failed (python3-venv: bash scripts/ensure-tools.sh)"
    fi
    log "downloading llama-cpp-python==$LCP_VERSION (sdist) with pip"
    "$CACHE_ROOT/venv/bin/pip" download --quiet --disable-pip-version-check --no-deps \
        --no-binary llama-cpp-python "llama-cpp-python==$LCP_VERSION" -d "$CACHE_ROOT/dl" >&2
    TARBALL="$CACHE_ROOT/dl/llama_cpp_python-$LCP_VERSION.tar.gz"
    [ -f "$TARBALL" ] || die "pip did not leave $TARBALL"
    GOT="$(sha256sum "$TARBALL" | cut -d' ' -f1)"
    [ "$GOT" = "$LCP_SHA256" ] || die "sha256 of $TARBALL is $GOT, pinned $LCP_SHA256"
    log "sha256 ok ($LCP_SHA256)"
    mkdir -p "$SRC.tmp"
    tar -xzf "$TARBALL" -C "$SRC.tmp" --strip-components=1 \
        "llama_cpp_python-$LCP_VERSION/vendor/llama.cpp/ggml" \
        "llama_cpp_python-$LCP_VERSION/vendor/llama.cpp/LICENSE" \
        "llama_cpp_python-$LCP_VERSION/CHANGELOG.md"
    # The first release heading's first entry names the vendored commit.
    awk '/^## \[[0-9]/{n++} n==1' "$SRC.tmp/CHANGELOG.md" | grep -q "llama.cpp@$LLAMA_CPP_COMMIT" \
        || die "CHANGELOG.md of $LCP_VERSION does not name llama.cpp@$LLAMA_CPP_COMMIT"
    mv "$SRC.tmp" "$SRC"
    touch "$SRC/.complete"
    rm -rf "$CACHE_ROOT/dl"
fi
GGML_SRC="$SRC/vendor/llama.cpp/ggml"

# ggml's CMakeLists names its commit with `git rev-parse`; the sdist has no
# .git, so a stand-in answers with the commit the CHANGELOG names (and "clean"
# for the dirty check). ggml_commit() then returns it.
FAKE_GIT="$CACHE_ROOT/git-commit-from-changelog"
cat >"$FAKE_GIT" <<EOF
#!/bin/sh
# rev-parse: the llama.cpp commit llama-cpp-python $LCP_VERSION's CHANGELOG names.
case "\$1" in rev-parse) echo "$LLAMA_CPP_COMMIT" ;; esac
exit 0
EOF
chmod +x "$FAKE_GIT"

# The sdist leaves out ggml.pc.in, which ggml's CMakeLists needs when it is the
# top-level project; as a subdirectory (the way llama.cpp builds it) it does not.
WRAP="$CACHE_ROOT/wrapper"
mkdir -p "$WRAP"
cat >"$WRAP/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.14)
project(engram_ggml C CXX)
add_subdirectory("${ENGRAM_GGML_SRC}" ggml)
CMAKE

BUILD="$CACHE_ROOT/build-$ISA-$KEY"
rm -rf "$BUILD" "$PREFIX"
JOBS="${ENGRAM_GGML_JOBS:-$(nproc 2>/dev/null || echo 2)}"
log "configuring ($ISA; ${CMAKE_ARGS[*]})"
cmake -S "$WRAP" -B "$BUILD" "${CMAKE_ARGS[@]}" -DENGRAM_GGML_SRC="$GGML_SRC" -DGIT_EXE="$FAKE_GIT" \
    -DCMAKE_C_COMPILER="$CC_BIN" -DCMAKE_CXX_COMPILER="$CXX_BIN" \
    -DCMAKE_INSTALL_PREFIX="$PREFIX" -DCMAKE_INSTALL_LIBDIR=lib >"$CACHE_ROOT/configure-$KEY.log" 2>&1 \
    || { tail -n 40 "$CACHE_ROOT/configure-$KEY.log" >&2; die "cmake configure failed"; }
log "building with $JOBS jobs (a few minutes the first time)"
START=$(date +%s)
cmake --build "$BUILD" -j "$JOBS" >"$CACHE_ROOT/build-$KEY.log" 2>&1 \
    || { tail -n 40 "$CACHE_ROOT/build-$KEY.log" >&2; die "build failed"; }
cmake --install "$BUILD" >"$CACHE_ROOT/install-$KEY.log" 2>&1 \
    || { tail -n 20 "$CACHE_ROOT/install-$KEY.log" >&2; die "install failed"; }
# The vendored CUDA sources are kept next to the build for the patch check
# (integrations/ggml/ggml-cuda-engram.patch): a path, not a copy.
ln -sfn "$SRC/vendor/llama.cpp" "$PREFIX/llama.cpp-src"
VERSION_LINE="ggml $(sed -n 's/^set(GGML_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\))/\2/p' "$GGML_SRC/CMakeLists.txt" | paste -sd.) (llama.cpp $LLAMA_CPP_COMMIT, vendored by llama-cpp-python $LCP_VERSION), $ISA"
echo "$VERSION_LINE" >"$PREFIX/VERSION"
printf '%s\n' "$KEY_TEXT" >"$PREFIX/KEY"
touch "$PREFIX/.complete"
rm -rf "$BUILD"
log "built in $(( $(date +%s) - START )) s: $PREFIX ($VERSION_LINE)"
echo "$PREFIX"
