#!/usr/bin/env bash
# Build libengram_simt.so: the engram CUDA kernels (kernels/*.cu, unmodified)
# compiled as host C++ with the SIMT shim, and its self-test.
#
#   tests/simt/build.sh OUTDIR [-DNAME=VALUE ...]
#
# Writes OUTDIR/libengram_simt.so, OUTDIR/selftest, OUTDIR/simt_abi.h (and
# OUTDIR/obj/). Extra -D flags go to the kernels' translation unit, as NVRTC
# options would (src/cuda/kernels.rs's OPTIONS are read for -D literals too).
#
# Environment:
#   CXX=g++          the compiler (g++ 12 or newer)
#   FMAD=1|0         contract a*b+c into FMA instructions in the kernels, as NVRTC
#                    does with --fmad=true (the default when kernels.rs passes it
#                    or passes no --fmad); 0 for CPUs without FMA
#   SANITIZE=1       AddressSanitizer + UndefinedBehaviorSanitizer everywhere
#   TSAN=1           ThreadSanitizer (the runtime itself uninstrumented; see README)
#   UCONTEXT=1       switch fibers with ucontext instead of the x86-64 assembly
#   SELFTEST=0       do not build the self-test
set -euo pipefail

OUT="${1:?usage: tests/simt/build.sh OUTDIR [-DNAME=VALUE ...]}"
shift
EXTRA_DEFS=()
for a in "$@"; do
    case "$a" in
    -D*) EXTRA_DEFS+=("$a") ;;
    *) echo "build.sh: unexpected argument '$a' (only -DNAME=VALUE flags follow OUTDIR)" >&2; exit 2 ;;
    esac
done

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
KDIR="$ROOT/kernels"
KRS="$ROOT/src/cuda/kernels.rs"
CXX="${CXX:-g++}"
mkdir -p "$OUT/obj"
OUT="$(cd "$OUT" && pwd)"
OBJ="$OUT/obj"

die() { echo "build.sh: $*" >&2; exit 1; }

# --- the kernel files: every kernels/*.cu is in kernels_host.cpp, in the order
# of the CUDA backend's translation unit (MODULE_MAIN in src/cuda/kernels.rs).
mapfile -t CU_FILES < <(cd "$KDIR" && ls -1 -- *.cu | sort)
mapfile -t HOST_INCS < <(grep -o '^#include "[^"]*\.cu"' "$HERE/kernels_host.cpp" | sed 's/^#include "\(.*\)"$/\1/')
[ "$(printf '%s\n' "${CU_FILES[@]}")" = "$(printf '%s\n' "${HOST_INCS[@]}" | sort)" ] ||
    die "kernels/*.cu is {${CU_FILES[*]}} but tests/simt/kernels_host.cpp includes {${HOST_INCS[*]}}: add the new kernel file there"
NVRTC_OPTS=""
if [ -f "$KRS" ]; then
    MODULE_INCS="$(awk '/MODULE_MAIN/{f=1} f{print} f&&/;/{exit}' "$KRS" | grep -o '[A-Za-z0-9_.-]*\.cu' || true)"
    if [ -n "$MODULE_INCS" ]; then
        [ "$MODULE_INCS" = "$(printf '%s\n' "${HOST_INCS[@]}")" ] ||
            die "src/cuda/kernels.rs MODULE_MAIN includes {$(echo $MODULE_INCS)}, kernels_host.cpp {${HOST_INCS[*]}}"
    else
        echo "build.sh: note: no MODULE_MAIN in $KRS; the include order is not checked" >&2
    fi
    NVRTC_OPTS="$(awk '/pub const OPTIONS/{f=1} f{print} f&&/;/{exit}' "$KRS" | grep -o '"-[^"]*"' | tr -d '"' | tr '\n' ' ' || true)"
else
    echo "build.sh: note: $KRS not found; the NVRTC options and include order are not checked" >&2
fi
for o in $NVRTC_OPTS; do
    case "$o" in
    -D*) EXTRA_DEFS+=("$o") ;;
    --use_fast_math | -use_fast_math | --ftz=true | -ftz=true | --prec-div=false | -prec-div=false | --prec-sqrt=false | -prec-sqrt=false)
        echo "build.sh: WARNING: NVRTC option $o is not modelled (the emulation keeps IEEE division, square root and subnormals)" >&2 ;;
    esac
done
if [ -z "${FMAD:-}" ]; then
    case " $NVRTC_OPTS " in
    *" --fmad=false "* | *" -fmad=false "*) FMAD=0 ;;
    *) FMAD=1 ;;
    esac
fi

# --- flags
WARN=(-Wall -Wextra -Werror)
BASE=(-std=c++17 -O2 -g -fPIC -fvisibility=hidden -pthread)
SAN=()
SAN_NAME=none
if [ "${SANITIZE:-0}" = 1 ]; then
    SAN=(-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer)
    SAN_NAME=address,undefined
fi
RT_SAN=("${SAN[@]}")
if [ "${TSAN:-0}" = 1 ]; then
    [ "${SANITIZE:-0}" = 1 ] && die "SANITIZE=1 and TSAN=1 cannot be combined"
    SAN=(-fsanitize=thread -fno-omit-frame-pointer)
    RT_SAN=(-DSIMT_TSAN=1 -fno-omit-frame-pointer) # the runtime is not instrumented (README.md)
    SAN_NAME=thread
fi
CTX=()
CTX_NAME=asm
if [ "${UCONTEXT:-0}" = 1 ]; then
    CTX=(-DSIMT_UCONTEXT=1)
    CTX_NAME=ucontext
fi
if [ "$FMAD" = 1 ]; then
    FP=(-mfma -ffp-contract=fast -DSIMT_FMAD=1)
else
    FP=(-ffp-contract=off -DSIMT_FMAD=0)
fi
# The kernels' TU: device memory is untyped (no strict aliasing), no errno from
# sqrtf, `#pragma unroll` unknown to g++ (see kernels_host.cpp).
KFLAGS=("${BASE[@]}" "${WARN[@]}" -Wno-unknown-pragmas -fno-strict-aliasing -fno-math-errno "${FP[@]}" "${SAN[@]}"
    -I"$KDIR" -I"$HERE" "${EXTRA_DEFS[@]}")
INFO="fmad=$FMAD sanitize=$SAN_NAME context=$CTX_NAME defines=${EXTRA_DEFS[*]:-none} cxx=$($CXX -dumpfullversion)"
echo "build.sh: $INFO"

# --- pass 1: list the kernels (the functions __global__ puts in section simt_kernels)
"$CXX" "${KFLAGS[@]}" -O0 -c "$HERE/kernels_host.cpp" -o "$OBJ/kernels_pass1.o"
mapfile -t KERNELS < <(objdump -t "$OBJ/kernels_pass1.o" | awk '$4 == "simt_kernels" && $3 == "F" {print $NF}' |
    grep -v '\.' | sort -u)
[ "${#KERNELS[@]}" -gt 0 ] || die "no kernel found in the sources"
for k in "${KERNELS[@]}"; do
    case "$k" in
    _Z*) die "kernel $k ($(echo "$k" | c++filt)) is not extern \"C\": the CUDA backend looks kernels up by plain name" ;;
    esac
done
{
    echo "// Generated by tests/simt/build.sh from the kernels in kernels/*.cu."
    printf 'SIMT_REGISTER(%s)\n' "${KERNELS[@]}"
} >"$OBJ/simt_registry.inc.new"
mv "$OBJ/simt_registry.inc.new" "$OBJ/simt_registry.inc"
echo "build.sh: ${#KERNELS[@]} kernels: ${KERNELS[*]}"
# The kernels' dynamic shared memory: the thread-local arrays their `extern
# __shared__` declarations leave undefined (kernels_host.cpp defines them;
# simt_* are the runtime's own).
mapfile -t DYNSHARED < <(readelf -sW "$OBJ/kernels_pass1.o" | awk '$4 == "TLS" && $7 == "UND" && $8 !~ /^simt_/ {print $8}' | sort -u)
{
    echo "// Generated by tests/simt/build.sh: the kernels' extern __shared__ arrays."
    for n in "${DYNSHARED[@]}"; do echo "SIMT_DYNAMIC_SHARED($n)"; done
} >"$OBJ/simt_dynshared.inc.new"
mv "$OBJ/simt_dynshared.inc.new" "$OBJ/simt_dynshared.inc"
if [ "${#DYNSHARED[@]}" -gt 0 ]; then echo "build.sh: dynamic shared memory: ${DYNSHARED[*]}"; fi

# --- pass 2: the library
"$CXX" "${KFLAGS[@]}" -DSIMT_REGISTRY_INC="\"$OBJ/simt_registry.inc\"" \
    -DSIMT_DYNSHARED_INC="\"$OBJ/simt_dynshared.inc\"" -DSIMT_BUILD_INFO="\"$INFO\"" \
    -c "$HERE/kernels_host.cpp" -o "$OBJ/kernels_host.o" &
"$CXX" "${BASE[@]}" "${WARN[@]}" "${RT_SAN[@]}" "${CTX[@]}" -I"$HERE" -c "$HERE/simt_runtime.cpp" -o "$OBJ/simt_runtime.o"
wait $!
"$CXX" -shared "${BASE[@]}" "${SAN[@]}" -o "$OUT/libengram_simt.so" "$OBJ/kernels_host.o" "$OBJ/simt_runtime.o" -ldl
cp "$HERE/simt_abi.h" "$OUT/simt_abi.h"
echo "build.sh: wrote $OUT/libengram_simt.so"

# --- the self-test (its own kernels use the shim too)
if [ "${SELFTEST:-1}" = 1 ]; then
    "$CXX" -std=c++17 -O2 -g -pthread "${WARN[@]}" -ffp-contract=off "${SAN[@]}" -I"$HERE" -I"$KDIR" "$HERE/selftest.cpp" \
        -o "$OUT/selftest" -L"$OUT" -lengram_simt -Wl,-rpath,"$OUT"
    echo "build.sh: wrote $OUT/selftest"
fi
