#!/usr/bin/env bash
# The C/C++ drop-in, end to end, as a user's build sees it: install into a
# fresh prefix (scripts/install.sh), check the CMake package's version rules,
# build examples/cpp_host through CMake (shared and static library) and through
# pkg-config, run each (CPU backend), and link a C program statically
# (c_tests/test_static_link.sh); the installed libraries are stripped (the
# shared library's debug info split off beside it). Installs cmake and pkg-config when missing
# (scripts/ensure-tools.sh). Reuses target/ (one release build of the library).
#
#   bash scripts/check-install.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

bash scripts/ensure-tools.sh
WORK="$(mktemp -d "${TMPDIR:-/tmp}/engram_install_check.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
PREFIX="$WORK/prefix"

bash scripts/install.sh "$PREFIX" >"$WORK/install.log" 2>&1 || { cat "$WORK/install.log"; exit 1; }
tail -n 3 "$WORK/install.log" | head -n 1
export PKG_CONFIG_PATH="$PREFIX/lib/pkgconfig"

echo "== installed libraries are stripped; the shared one's debug info is beside it (lib/.debug)"
SO_REAL="$(readlink -f "$PREFIX/lib/libengram.so")"
for lib in "$SO_REAL" "$PREFIX/lib/libengram.a"; do
    # (readelf into a variable: `readelf | grep -q` under pipefail fails when
    # grep stops reading early.)
    sections="$(readelf -S --wide "$lib")"
    if grep -q '\.debug_info' <<<"$sections"; then
        echo "FAIL $lib carries debug info (.debug_info); install.sh should strip it"
        exit 1
    fi
    echo "  $(basename "$lib"): $(du -k "$lib" | cut -f1) KiB, no .debug_info"
done
DBG="$PREFIX/lib/.debug/$(basename "$SO_REAL").debug"
sections="$(readelf -S --wide "$DBG")"
grep -q '\.debug_info' <<<"$sections" || { echo "FAIL $DBG holds no .debug_info"; exit 1; }
link="$(readelf --string-dump=.gnu_debuglink "$SO_REAL")"
grep -q "$(basename "$DBG")" <<<"$link" ||
    { echo "FAIL $SO_REAL has no .gnu_debuglink to $(basename "$DBG")"; exit 1; }
echo "  $(basename "$DBG"): $(du -k "$DBG" | cut -f1) KiB, linked by .gnu_debuglink"

echo "== CMake package: version rules"
mkdir -p "$WORK/version"
cat >"$WORK/version/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.17)
project(engram_version_check LANGUAGES NONE)
# request -> expected: a 0.x release satisfies only its own minor version.
foreach(req_want IN ITEMS "0.3=1" "0.3.0=1" "0=0" "0.2=0" "0.4=0" "1=0" "0.3.99=0")
  string(REPLACE "=" ";" rw "${req_want}")
  list(GET rw 0 req)
  list(GET rw 1 want)
  unset(engram_FOUND)
  find_package(engram ${req} QUIET)
  if(engram_FOUND)
    set(got 1)
  else()
    set(got 0)
  endif()
  if(NOT got EQUAL want)
    message(FATAL_ERROR "find_package(engram ${req}): found=${got}, expected ${want}")
  endif()
endforeach()
find_package(engram 0.3.0 EXACT REQUIRED)
if(NOT TARGET engram::engram OR NOT TARGET engram::engram_static)
  message(FATAL_ERROR "engram::engram / engram::engram_static missing")
endif()
message(STATUS "engram ${engram_VERSION}: version rules hold")
CMAKE
cmake -S "$WORK/version" -B "$WORK/version/build" -DCMAKE_PREFIX_PATH="$PREFIX" >"$WORK/version.log" 2>&1 ||
    { cat "$WORK/version.log"; exit 1; }
grep -- "-- engram" "$WORK/version.log"

run_example() { # name exe
    local out
    if ! out="$("$2" 2>&1)"; then
        echo "$out"
        echo "FAIL $1"
        exit 1
    fi
    echo "$out" | grep -E '^(check|PASS)' | sed "s/^/  [$1] /"
}

for kind in shared static; do
    echo "== examples/cpp_host through CMake ($kind library)"
    opt=OFF
    [ "$kind" = static ] && opt=ON
    B="$WORK/cmake-$kind"
    cmake -S examples/cpp_host -B "$B" -DCMAKE_PREFIX_PATH="$PREFIX" -DCMAKE_BUILD_TYPE=Release \
        -DCMAKE_COMPILE_WARNING_AS_ERROR=ON -DENGRAM_EXAMPLE_STATIC=$opt >"$B.log" 2>&1 || { cat "$B.log"; exit 1; }
    cmake --build "$B" >>"$B.log" 2>&1 || { cat "$B.log"; exit 1; }
    if [ "$kind" = static ] && readelf -d "$B/cpp_host" | grep -q 'NEEDED.*libengram'; then
        echo "FAIL the ENGRAM_EXAMPLE_STATIC build needs libengram.so"
        exit 1
    fi
    run_example "cmake, $kind" "$B/cpp_host"
done

echo "== examples/cpp_host through pkg-config"
# shellcheck disable=SC2046 # word splitting of pkg-config output is intended
g++ -std=c++17 -O2 -Wall -Wextra -Wpedantic -Werror -o "$WORK/cpp_host_pc" examples/cpp_host/main.cpp \
    $(pkg-config --cflags --libs engram) -Wl,-rpath,"$(pkg-config --variable=libdir engram)"
run_example "pkg-config" "$WORK/cpp_host_pc"

echo "== static link of a C program (c_tests/test_static_link.sh)"
bash c_tests/test_static_link.sh "$PREFIX"
