#!/usr/bin/env bash
# The C ABI tests: build the library (unless ENGRAM_LIB_DIR points at one),
# check the exported symbols against include/engram.h, compile every
# c_tests/test_*.c as C11 and as C++17 with warnings as errors under
# AddressSanitizer + UndefinedBehaviorSanitizer, link them against the shared
# library and run them (LeakSanitizer on), and link one test against the static
# library and run it.
#
# Every check prints one line ("PASS ..." / "FAIL ...", "SKIP ..." for a check
# that cannot run here and is not counted); the last line is "N passed, M failed",
# and the exit status is nonzero if anything failed.
#
# Usage: bash c_tests/run.sh            (from anywhere)
#   ENGRAM_LIB_DIR=/path/with/libengram.so  use a prebuilt library, no cargo build
#   CC=... CXX=...                          other compilers (default gcc / g++)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CC="${CC:-gcc}"
CXX="${CXX:-g++}"
HEADER="$ROOT/include/engram.h"
FIXTURE="$ROOT/tests/golden/data/c_fixture.txt"
GOLDEN_JSON="$ROOT/tests/golden/data/tiny.json"

PASSED=0
FAILED=0
pass() { echo "PASS $*"; PASSED=$((PASSED + 1)); }
fail() { echo "FAIL $*"; FAILED=$((FAILED + 1)); }
skip() { echo "SKIP $*"; }
finish() {
    echo "$PASSED passed, $FAILED failed"
    if [ "$FAILED" -ne 0 ]; then exit 1; fi
    exit 0
}

WORK="$(mktemp -d "${TMPDIR:-/tmp}/engram_c_tests.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# --- The library -------------------------------------------------------------
if [ -n "${ENGRAM_LIB_DIR:-}" ]; then
    LIB_DIR="$(cd "$ENGRAM_LIB_DIR" && pwd)"
    echo "# using the library in ENGRAM_LIB_DIR=$LIB_DIR (no cargo build)"
else
    LIB_DIR="$ROOT/target/debug"
    echo "# cargo build (library in $LIB_DIR)"
    if cargo build --quiet --lib >"$WORK/cargo.log" 2>&1; then
        pass "cargo build"
    else
        cat "$WORK/cargo.log"
        fail "cargo build"
        finish
    fi
fi
SO="$LIB_DIR/libengram.so"
A="$LIB_DIR/libengram.a"
if [ ! -f "$SO" ]; then
    fail "libengram.so exists in $LIB_DIR"
    finish
fi

# --- Exported symbols ----------------------------------------------------------
# Every function the header declares must be exported by the shared library, and
# every exported engram_* function must be in the header (else the header is stale).
# Declarations start a line (comments are indented); the header's own inline
# init helpers (static inline, calling the exported *_init_sized) are not exports.
mapfile -t HEADER_FUNCS < <(grep -E '^[A-Za-z_].*\bengram_[a-z0-9_]+\(' "$HEADER" | grep -v '^static inline' |
    grep -oE '\bengram_[a-z0-9_]+\(' | tr -d '(' | sort -u)
mapfile -t EXPORTED < <(nm -D --defined-only "$SO" | awk '$2 == "T" || $2 == "t" || $2 == "W" {print $3}' |
    grep -E '^engram_' | sort -u || true)
if [ "${#HEADER_FUNCS[@]}" -lt 4 ]; then
    fail "found the function declarations in include/engram.h (got ${#HEADER_FUNCS[@]})"
fi
mapfile -t WANTED < <(printf '%s\n' engram_create engram_hash engram_apply engram_free "${HEADER_FUNCS[@]}" | sort -u)
# (grep -x >/dev/null, not grep -q: under pipefail, a grep -q that exits at its
# first match can leave printf writing into a closed pipe, and SIGPIPE fails
# the pipeline at random.)
for f in "${WANTED[@]}"; do
    if printf '%s\n' "${EXPORTED[@]}" | grep -x -- "$f" >/dev/null; then
        pass "nm -D --defined-only libengram.so exports $f"
    else
        fail "nm -D --defined-only libengram.so exports $f"
    fi
done
for f in "${EXPORTED[@]}"; do
    if printf '%s\n' "${HEADER_FUNCS[@]}" | grep -x -- "$f" >/dev/null; then :; else
        fail "exported function $f is declared in include/engram.h"
    fi
done

# --- The golden fixture ----------------------------------------------------------
# tests/golden/c_fixture.py converts tiny.json into the plain format test_golden.c
# reads; regenerate it when it is missing or older than the JSON.
# (After a fresh checkout the order of the two mtimes is arbitrary; regenerating
# writes the same bytes.) Without python3 the committed fixture is used as is.
if [ -f "$GOLDEN_JSON" ] && { [ ! -f "$FIXTURE" ] || [ "$GOLDEN_JSON" -nt "$FIXTURE" ]; }; then
    if ! command -v python3 >/dev/null 2>&1; then
        skip "no python3: tests/golden/data/c_fixture.txt is not regenerated from tiny.json"
    elif python3 "$ROOT/tests/golden/c_fixture.py" "$GOLDEN_JSON" "$FIXTURE" >"$WORK/fixture.log" 2>&1; then
        pass "regenerated tests/golden/data/c_fixture.txt from tiny.json"
    else
        cat "$WORK/fixture.log"
        fail "regenerate tests/golden/data/c_fixture.txt (python3 tests/golden/c_fixture.py)"
    fi
fi

# --- Sanitizers ----------------------------------------------------------------
FLAGS=(-Wall -Wextra -Werror -g -fsanitize=address,undefined -fno-omit-frame-pointer
    -I"$ROOT/include" -I"$ROOT/c_tests")
LINK_SO=(-L"$LIB_DIR" -lengram -Wl,-rpath,"$LIB_DIR" -lm)
# The native libraries Rust's std needs with a staticlib, as printed by
# `rustc --crate-type staticlib --print native-static-libs` on x86_64 Linux
# (`cargo rustc --lib -- --print native-static-libs` prints the same for this crate).
STATIC_LIBS=(-lgcc_s -lutil -lrt -lpthread -lm -ldl -lc)
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"

# LeakSanitizer needs to stop the process's threads with ptrace-like machinery,
# which some sandboxes (containers without CAP_SYS_PTRACE, seccomp filters,
# running under a debugger) refuse: then it dies with "LeakSanitizer has
# encountered a fatal error". Probe it with a planted leak of an engram context;
# if it cannot catch that, fall back to detect_leaks=0 (ASan's other checks stay
# on) and say so.
cat >"$WORK/lsan_probe.c" <<'EOF'
#include "engram.h"
/* Create a valid context and never free it: LeakSanitizer must report it. */
int main(void) {
    static const uint32_t layers[1] = {0};
    static const int32_t token_map[1] = {0};
    static const uint64_t mult[2] = {1, 1}, primes[1] = {2}, offsets[1] = {0};
    engram_config c;
    engram_config_init(&c);
    c.hidden_size = 1; c.hc = 1; c.head_dim = 1; c.n_heads = 1; c.max_ngram = 2;
    c.layer_ids = layers; c.n_layers = 1; c.token_map = token_map; c.token_map_len = 1;
    c.multipliers = mult; c.n_multipliers = 2; c.primes = primes; c.n_primes = 1;
    c.offsets = offsets; c.n_offsets = 1; c.max_tokens = 1; c.max_seqs = 1; c.max_positions = 1;
    engram_context *ctx = 0;
    return engram_create(&c, &ctx) == ENGRAM_STATUS_OK ? 0 : 3;
}
EOF
LSAN=1
if "$CC" -std=c11 -g -fsanitize=address -fno-omit-frame-pointer -I"$ROOT/include" "$WORK/lsan_probe.c" \
    "${LINK_SO[@]}" -o "$WORK/lsan_probe" >"$WORK/lsan_build.log" 2>&1; then
    set +e
    ASAN_OPTIONS="detect_leaks=1" "$WORK/lsan_probe" >"$WORK/lsan.log" 2>&1
    set -e
    if grep -q "ERROR: LeakSanitizer: detected memory leaks" "$WORK/lsan.log"; then
        pass "LeakSanitizer works here (it reports a leaked engram_context)"
    else
        LSAN=0
        skip "LeakSanitizer does not work here ($(grep -m1 -i 'sanitizer' "$WORK/lsan.log" || echo 'planted leak not reported')); running with detect_leaks=0"
    fi
else
    cat "$WORK/lsan_build.log"
    fail "build the LeakSanitizer probe"
    LSAN=0
fi
export ASAN_OPTIONS="detect_leaks=$LSAN:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1"

# --- Deprecated aliases --------------------------------------------------------
# engram_seq_copy / _drop (and the _device twins) are declared behind
# ENGRAM_DEPRECATED: a call warns (an error under -Werror), naming the verb to
# use, and an engine that defines the macro empty before the include compiles.
cat >"$WORK/deprecated.c" <<'EOF2'
#include "engram.h"
int main(void) { return engram_seq_copy(0, 0, 1) == ENGRAM_STATUS_ERR_NULL_ARGUMENT ? 0 : 1; }
EOF2
for lang in c c++; do
    x=(-x c -std=c11)
    if [ "$lang" = c++ ]; then x=(-x c++ -std=c++17); fi
    if "$CC" "${x[@]}" -Wall -Werror -I"$ROOT/include" -c "$WORK/deprecated.c" -o "$WORK/deprecated.o" \
        >"$WORK/deprecated.log" 2>&1; then
        fail "[$lang] a call of engram_seq_copy is refused under -Werror (deprecated)"
    elif grep -q "use engram_seq_cp" "$WORK/deprecated.log"; then
        pass "[$lang] a call of engram_seq_copy warns, naming engram_seq_cp"
    else
        cat "$WORK/deprecated.log"
        fail "[$lang] a call of engram_seq_copy warns, naming engram_seq_cp"
    fi
    if "$CC" "${x[@]}" -Wall -Werror '-DENGRAM_DEPRECATED(msg)=' -I"$ROOT/include" -c "$WORK/deprecated.c" \
        -o "$WORK/deprecated.o" >"$WORK/deprecated.log" 2>&1; then
        pass "[$lang] ENGRAM_DEPRECATED defined empty silences it"
    else
        cat "$WORK/deprecated.log"
        fail "[$lang] ENGRAM_DEPRECATED defined empty silences it"
    fi
done

# --- Compile and run every test ------------------------------------------------
# run_test TAG BINARY [ARGS...]: run it, prefix its PASS/FAIL lines with TAG, count
# them, and add one check for its exit status (a crash or a sanitizer report
# fails here even when every check it printed passed).
run_test() {
    local tag="$1" bin="$2"
    shift 2
    local name
    name="$(basename "$bin")"
    local rc=0
    "$bin" "$@" >"$WORK/$name.out" 2>&1 || rc=$?
    local p f
    p=$(grep -c '^PASS ' "$WORK/$name.out" || true)
    f=$(grep -c '^FAIL ' "$WORK/$name.out" || true)
    sed -e "s/^\(PASS\|FAIL\) /\1 [$tag] /" "$WORK/$name.out"
    PASSED=$((PASSED + p))
    FAILED=$((FAILED + f))
    if [ "$rc" -eq 0 ]; then
        pass "[$tag] $name exits 0 (no sanitizer report)"
    else
        fail "[$tag] $name exits $rc"
    fi
}

TESTS=("$ROOT"/c_tests/test_*.c)
for src in "${TESTS[@]}"; do
    base="$(basename "$src" .c)"
    args=()
    if [ "$base" = test_golden ]; then
        args=("$FIXTURE")
    fi
    for lang in c c++; do
        bin="$WORK/${base}_${lang/++/xx}"
        if [ "$lang" = c ]; then
            cmd=("$CC" -std=c11 "${FLAGS[@]}" "$src" -x none "${LINK_SO[@]}" -o "$bin")
        else
            cmd=("$CXX" -x c++ -std=c++17 "${FLAGS[@]}" "$src" -x none "${LINK_SO[@]}" -o "$bin")
        fi
        if "${cmd[@]}" >"$WORK/build.log" 2>&1; then
            pass "[$lang] $base compiles with -Wall -Wextra -Werror (ASan+UBSan)"
            run_test "$lang" "$bin" "${args[@]}"
        else
            cat "$WORK/build.log"
            fail "[$lang] $base compiles with -Wall -Wextra -Werror (ASan+UBSan)"
        fi
    done
done

# --- The front page's C examples -----------------------------------------------
# Every ```c block of README.md is a whole translation unit: each one must
# compile as C11 and as C++17 with -Wall -Wextra -Werror against the header, and
# one that has a main() is linked and run on the golden's tiny GGUF model and
# must exit 0. So the front page cannot drift from the ABI.
README="$ROOT/README.md"
TINY_GGUF="$ROOT/tests/golden/data/tiny.gguf"
awk -v dir="$WORK" '
    /^```c[[:space:]]*$/ { n++; f = sprintf("%s/readme_example_%d.c", dir, n); inside = 1; next }
    inside && /^```/ { inside = 0; close(f); next }
    inside { print > f }
' "$README"
README_EXAMPLES=("$WORK"/readme_example_*.c)
if [ ! -f "${README_EXAMPLES[0]}" ]; then
    fail "README.md has C examples (\`\`\`c blocks)"
else
    README_RUN=0
    for src in "${README_EXAMPLES[@]}"; do
        base="$(basename "$src" .c)"
        for lang in c c++; do
            if [ "$lang" = c ]; then compiler=("$CC" -std=c11); else compiler=("$CXX" -x c++ -std=c++17); fi
            if grep -q '^int main(' "$src"; then
                bin="$WORK/${base}_${lang/++/xx}"
                if "${compiler[@]}" "${FLAGS[@]}" "$src" -x none "${LINK_SO[@]}" -o "$bin" >"$WORK/build.log" 2>&1; then
                    pass "[$lang] README.md $base compiles and links with -Wall -Wextra -Werror"
                    rc=0
                    "$bin" "$TINY_GGUF" >"$WORK/$base.out" 2>&1 || rc=$?
                    if [ "$rc" -eq 0 ]; then
                        pass "[$lang] README.md $base runs on tiny.gguf: $(head -n1 "$WORK/$base.out")"
                        README_RUN=$((README_RUN + 1))
                    else
                        cat "$WORK/$base.out"
                        fail "[$lang] README.md $base runs on tiny.gguf (exit $rc)"
                    fi
                else
                    cat "$WORK/build.log"
                    fail "[$lang] README.md $base compiles and links with -Wall -Wextra -Werror"
                fi
            elif "${compiler[@]}" "${FLAGS[@]}" -c "$src" -o "$WORK/$base.o" >"$WORK/build.log" 2>&1; then
                pass "[$lang] README.md $base compiles with -Wall -Wextra -Werror"
            else
                cat "$WORK/build.log"
                fail "[$lang] README.md $base compiles with -Wall -Wextra -Werror"
            fi
        done
    done
    if [ "$README_RUN" -eq 0 ]; then
        fail "README.md has a C example with a main() that runs"
    fi
fi

# --- Static library ----------------------------------------------------------
if [ -f "$A" ]; then
    for base in test_golden test_errors; do
        src="$ROOT/c_tests/$base.c"
        bin="$WORK/${base}_static"
        args=()
        if [ "$base" = test_golden ]; then args=("$FIXTURE"); fi
        if "$CC" -std=c11 "${FLAGS[@]}" "$src" "$A" "${STATIC_LIBS[@]}" -o "$bin" >"$WORK/build.log" 2>&1; then
            pass "[static] $base links against libengram.a (${STATIC_LIBS[*]})"
            if ldd "$bin" | grep -q 'libengram'; then
                fail "[static] $base does not load libengram.so"
            else
                pass "[static] $base does not load libengram.so"
            fi
            run_test static "$bin" "${args[@]}"
        else
            cat "$WORK/build.log"
            fail "[static] $base links against libengram.a"
        fi
    done
else
    skip "no libengram.a in $LIB_DIR: the static-library link is not tested"
fi

finish
