#!/usr/bin/env bash
# The C/C++ drop-in, end to end, as a user's build sees it: install into a
# fresh prefix (scripts/install.sh), check the CMake package's version rules,
# build examples/cpp_host through CMake (shared and static library) and through
# pkg-config, run each (CPU backend), and link a C program statically
# (c_tests/test_static_link.sh); the installed libraries are stripped (the
# shared library's debug info split off beside it). Then every recipe the docs
# give, as written: the blocks of docs/install.md and docs/ggml.md marked
# `<!-- check-install: NAME -->` (the installed files table, CMake
# find_package, pkg-config, the ggml op against the installed tree) are read
# out of the docs, /opt/engram replaced by the fresh prefix, built and run, so
# a recipe that stops working fails here. Installs cmake and pkg-config when
# missing (scripts/ensure-tools.sh). Last, the root CMakeLists.txt: cpp_host
# built through add_subdirectory of this checkout and FetchContent from it
# (docs/install.md's recipes), shared and static, their targets compared with
# the installed package's, and `cmake --install` compared with install.sh's
# tree. Reuses target/ (one release build of the library, shared by
# install.sh and the CMake builds: the same cargo arguments); the ggml step
# reuses scripts/ggml-build.sh's cache.
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

# ---------------------------------------------------------------------------
# The docs' recipes, read out of the docs.

# doc_block FILE NAME: the body of the fenced block (or the table) that
# follows the line `<!-- check-install: NAME -->` in FILE, with /opt/engram
# replaced by the fresh prefix. Fails when the marker or the block is missing.
doc_block() {
    local out
    out="$(awk -v name="$2" '
        $0 == ("<!-- check-install: " name " -->") { found = 1; next }
        found == 1 && /^```/ { found = 2; next }          # a fenced block
        found == 1 && /^\|/ { found = 3 }               # a table
        found == 2 && /^```/ { exit }
        found == 3 && !/^\|/ { exit }
        found >= 2 { print }
    ' "$1")"
    [ -n "$out" ] || { echo "FAIL $1 has no block marked <!-- check-install: $2 -->" >&2; return 1; }
    printf '%s\n' "$out" | sed "s|/opt/engram|$PREFIX|g"
}

# doc_project DIR: a CMake project around a docs block (stdin); the docs
# show the lines an engine adds to its own CMakeLists.txt.
doc_project() {
    mkdir -p "$1"
    { printf 'cmake_minimum_required(VERSION 3.17)\nproject(engram_doc_recipe C CXX)\n'; cat; } >"$1/CMakeLists.txt"
}

echo "== docs/install.md: every file its table lists is installed"
n_files=0
while read -r path; do
    [ "${ENGRAM_INSTALL_DEBUG:-0}" = 1 ] && [[ "$path" == lib/.debug/* ]] && continue
    [ -e "$PREFIX/$path" ] || { echo "FAIL docs/install.md lists $path, not in the installed tree:"; (cd "$PREFIX" && find . -type f -o -type l | sort); exit 1; }
    n_files=$((n_files + 1))
done < <(doc_block docs/install.md files | tail -n +3 | cut -d'|' -f2 | grep -o '`[^`]*`' | tr -d '`')
[ "$n_files" -ge 8 ] || { echo "FAIL docs/install.md's table lists only $n_files files"; exit 1; }
echo "  $n_files files present"

echo "== docs/install.md, CMake against the install (find_package), with examples/cpp_host/main.cpp"
R="$WORK/doc-find-package"
doc_block docs/install.md cmake-find-package | doc_project "$R"
cp examples/cpp_host/main.cpp "$R/main.cpp"
cmake -S "$R" -B "$R/build" -DCMAKE_PREFIX_PATH="$PREFIX" >"$R.log" 2>&1 || { cat "$R.log"; exit 1; }
cmake --build "$R/build" >>"$R.log" 2>&1 || { cat "$R.log"; exit 1; }
run_example "docs find_package" "$R/build/engine"

echo "== docs/install.md, pkg-config (its commands as written, on README.md's GGUF example and examples/cpp_host)"
R="$WORK/doc-pkg-config"
mkdir -p "$R"
# README.md's whole C program that opens a GGUF file (the last ```c block with a main).
awk '/^```c$/{f=1;buf="";next} /^```$/{if(f&&buf~/int main\(/)last=buf;f=0;next} f{buf=buf $0 "\n"} END{printf "%s", last}' \
    README.md >"$R/app.c"
grep -q 'int main' "$R/app.c" || { echo "FAIL README.md has no C program with a main"; exit 1; }
cp examples/cpp_host/main.cpp "$R/app.cpp"
doc_block docs/install.md pkg-config >"$R/recipe.sh"
(cd "$R" && PKG_CONFIG_PATH= bash -euo pipefail recipe.sh) >"$R.log" 2>&1 || { cat "$R/recipe.sh" "$R.log"; exit 1; }
for exe in "$R"/app_*; do
    name="docs pkg-config, $(basename "$exe")"
    if [[ "$exe" == *static* ]] && readelf -d "$exe" | grep -q 'NEEDED.*libengram'; then
        echo "FAIL $name needs libengram.so"
        exit 1
    fi
    if [ "$(basename "$exe")" != app_cpp ]; then
        out="$("$exe" tests/golden/data/tiny.gguf 2>&1)" || { echo "$out"; echo "FAIL $name"; exit 1; }
        echo "  [$name] $out"
    else
        run_example "$name" "$exe"
    fi
done
[ -x "$R/app_c" ] && [ -x "$R/app_cpp" ] && [ -x "$R/app_c_static" ] ||
    { echo "FAIL the pkg-config recipe built $(ls "$R")"; exit 1; }

echo "== docs/ggml.md, the ggml op against the installed tree (integrations/ggml/test_ggml.c as the engine)"
GGML="$(bash scripts/ggml-build.sh 2>"$WORK/ggml-build.log")" || { cat "$WORK/ggml-build.log"; exit 1; }
R="$WORK/doc-ggml"
{ doc_block docs/ggml.md ggml
  # The test's own helper (c_tests/check.h), not part of the recipe.
  echo "target_include_directories(engine PRIVATE \"$ROOT/c_tests\")"; } | doc_project "$R"
cp integrations/ggml/test_ggml.c "$R/engine.c"
cmake -S "$R" -B "$R/build" -DCMAKE_PREFIX_PATH="$PREFIX;$GGML" >"$R.log" 2>&1 || { cat "$R.log"; exit 1; }
cmake --build "$R/build" >>"$R.log" 2>&1 || { cat "$R.log"; exit 1; }
out="$("$R/build/engine" tests/golden/data/tiny.gguf 2 2>&1)" || { echo "$out" | grep -v '^PASS'; echo "FAIL docs ggml recipe"; exit 1; }
echo "$out" | tail -n 1 | sed 's/^/  [docs ggml recipe] /'

# ---------------------------------------------------------------------------
# The root CMakeLists.txt: an engine's CMake pulls the checkout in.

# target_props: a CMake snippet that writes what an engine sees of the two
# targets to FILE (paths reduced to what they name), so the targets of
# add_subdirectory and of the installed package can be compared.
target_props() {
    cat <<CMAKE
set(_out "")
foreach(_t engram::engram engram::engram_static)
  foreach(_p TYPE IMPORTED IMPORTED_SONAME IMPORTED_LINK_INTERFACE_LANGUAGES INTERFACE_LINK_LIBRARIES)
    get_target_property(_v \${_t} \${_p})
    string(APPEND _out "\${_t} \${_p} \${_v}\\n")
  endforeach()
  get_target_property(_v \${_t} IMPORTED_LOCATION)
  get_filename_component(_v "\${_v}" NAME)
  string(APPEND _out "\${_t} IMPORTED_LOCATION .../\${_v}\\n")
  get_target_property(_v \${_t} INTERFACE_INCLUDE_DIRECTORIES)
  file(GLOB _h RELATIVE "\${_v}" "\${_v}/*.h")
  string(APPEND _out "\${_t} headers \${_h}\\n")
endforeach()
string(APPEND _out "engram_VERSION \${engram_VERSION}\\nengram_STATIC_SYSTEM_LIBS \${engram_STATIC_SYSTEM_LIBS}\\n")
file(WRITE "$1" "\${_out}")
CMAKE
}

# The CMake builds below reuse the release build install.sh made (same cargo
# arguments, same target dir): no second build of the crate.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
{ doc_block docs/install.md cmake-find-package; target_props "$WORK/props-installed.txt"; } | doc_project "$WORK/props-installed"
cp examples/cpp_host/main.cpp "$WORK/props-installed/main.cpp"
cmake -S "$WORK/props-installed" -B "$WORK/props-installed/build" -DCMAKE_PREFIX_PATH="$PREFIX" >"$WORK/props.log" 2>&1 ||
    { cat "$WORK/props.log"; exit 1; }

for way in cmake-add-subdirectory cmake-fetchcontent; do
    echo "== docs/install.md, $way of this checkout (the root CMakeLists.txt), with examples/cpp_host/main.cpp"
    R="$WORK/doc-$way"
    { doc_block docs/install.md "$way" | sed "s|/opt/src/engram|$ROOT|g"
      # Beyond the recipe: the static target too, and what both targets look like.
      printf 'add_executable(engine_static main.cpp)\ntarget_link_libraries(engine_static PRIVATE engram::engram_static)\n'
      target_props "$R/props.txt"; } | doc_project "$R"
    mkdir -p "$R/third_party"
    ln -s "$ROOT" "$R/third_party/engram"
    cp examples/cpp_host/main.cpp "$R/main.cpp"
    cmake -S "$R" -B "$R/build" -DFETCHCONTENT_FULLY_DISCONNECTED=ON -DCMAKE_INSTALL_PREFIX="$R/prefix" \
        -DCMAKE_COMPILE_WARNING_AS_ERROR=ON >"$R.log" 2>&1 || { cat "$R.log"; exit 1; }
    cmake --build "$R/build" >>"$R.log" 2>&1 || { cat "$R.log"; exit 1; }
    diff -u "$WORK/props-installed.txt" "$R/props.txt" ||
        { echo "FAIL $way's targets differ from the installed package's (above)"; exit 1; }
    echo "  engram::engram and engram::engram_static as the installed package defines them"
    dyn="$(readelf -d "$R/build/engine_static")"
    if grep -q 'NEEDED.*libengram' <<<"$dyn"; then
        echo "FAIL $way: engine_static (engram::engram_static) needs libengram.so"
        exit 1
    fi
    run_example "$way, shared" "$R/build/engine"
    run_example "$way, static" "$R/build/engine_static"
done

echo "== cmake --install of the add_subdirectory build installs what scripts/install.sh installs"
R="$WORK/doc-cmake-add-subdirectory"
cmake --install "$R/build" >"$R-install.log" 2>&1 || { cat "$R-install.log"; exit 1; }
listing() { (cd "$1" && find . \( -type f -o -type l \) -printf '%p %y %m\n' | sort); }
diff -u <(listing "$PREFIX") <(listing "$R/prefix") ||
    { echo "FAIL the files installed by CMake (+) differ from install.sh's (-)"; exit 1; }
for f in lib/pkgconfig/engram.pc lib/pkgconfig/engram-static.pc lib/cmake/engram/engramConfig.cmake \
    lib/cmake/engram/engramConfigVersion.cmake include/engram.h include/engram_ggml.h; do
    diff -u <(sed "s|$PREFIX|PREFIX|g" "$PREFIX/$f") <(sed "s|$R/prefix|PREFIX|g" "$R/prefix/$f") ||
        { echo "FAIL $f differs between the two installs"; exit 1; }
done
real="$(basename "$(readlink -f "$PREFIX/lib/libengram.so")")"
for f in "lib/$real" lib/libengram.a; do
    cmp -s "$PREFIX/$f" "$R/prefix/$f" || { echo "FAIL $f differs between the two installs"; exit 1; }
done
sections="$(readelf -S --wide "$R/prefix/lib/libengram.a")"
! grep -q '\.debug_info' <<<"$sections" || { echo "FAIL CMake installed an unstripped libengram.a"; exit 1; }
echo "  $(listing "$R/prefix" | wc -l) files, the same names, kinds, modes and contents as install.sh's"
B="$WORK/cmake-installed-by-cmake"
cmake -S examples/cpp_host -B "$B" -DCMAKE_PREFIX_PATH="$R/prefix" >"$B.log" 2>&1 && cmake --build "$B" >>"$B.log" 2>&1 ||
    { cat "$B.log"; exit 1; }
run_example "cmake, the package cmake --install wrote" "$B/cpp_host"
echo "check-install: ok"
