#!/usr/bin/env bash
# Make sure the tools the install checks and the ggml build need are on the
# machine: cmake (with make for its default generator), pkg-config, g++,
# readelf (binutils), python3 with venv/pip (python3-venv). Missing
# ones are installed with apt-get: CI runs on a fresh Debian machine as root,
# with Debian's package registry reachable. Prints what it installs; prints
# nothing when everything is there.
set -euo pipefail

need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
command -v make >/dev/null 2>&1 || need+=(make)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
command -v g++ >/dev/null 2>&1 || need+=(g++)
command -v readelf >/dev/null 2>&1 || need+=(binutils)
# python3 with venv (and so pip): scripts/nvrtc-check.sh's venv, and
# scripts/ggml-build.sh's pip download of the llama-cpp-python sdist.
command -v python3 >/dev/null 2>&1 || need+=(python3)
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
[ ${#need[@]} -eq 0 ] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-tools.sh: missing ${need[*]} and no apt-get to install them" >&2
    exit 1
fi
SUDO=()
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "ensure-tools.sh: missing ${need[*]}; install them (needs root)" >&2; exit 1; }
    SUDO=(sudo)
fi
echo "== installing ${need[*]} (apt-get)"
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
