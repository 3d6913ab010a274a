#!/usr/bin/env bash
# Install engram for C and C++ builds under PREFIX:
#
#   PREFIX/include/engram.h
#   PREFIX/include/engram_ggml.h   the ggml custom op (header only, docs/ggml.md)
#   PREFIX/lib/libengram.so.X.Y.Z, libengram.so.<soname>, libengram.so   (shared)
#   PREFIX/lib/libengram.a                                               (static)
#   PREFIX/lib/.debug/libengram.so.X.Y.Z.debug   the shared library's debug info
#   PREFIX/lib/pkgconfig/engram.pc, engram-static.pc
#   PREFIX/lib/cmake/engram/engramConfig.cmake, engramConfigVersion.cmake
#
# Usage: bash scripts/install.sh PREFIX
#   DESTDIR=/stage bash scripts/install.sh /usr/local   stages the files under
#   /stage/usr/local while the .pc files still name /usr/local (packaging).
#   CARGO_TARGET_DIR is honoured (default: target/).
#   ENGRAM_INSTALL_DEBUG=1 installs both libraries with their debug info in
#   them (the release profile's `debug = 1`: 40+ MB for the static one).
#
# The installed libraries are stripped of debug info (the release build keeps
# it, for profiling from target/). The shared library's is split off into
# lib/.debug/, linked by a .gnu_debuglink, where gdb finds it by itself; see
# docs/install-symbols.md.
#
# Linux (GNU toolchain) only: the SONAME is set with a GNU ld flag. Needs cargo,
# a C compiler (rustc links with it) and binutils (readelf, objcopy, strip);
# not cmake.
set -euo pipefail

usage() { echo "usage: bash scripts/install.sh PREFIX" >&2; exit 2; }
[ $# -eq 1 ] && [ -n "$1" ] || usage
case "$(uname -s)" in
    Linux) ;;
    *) echo "install.sh: only Linux is supported (got $(uname -s))" >&2; exit 1 ;;
esac

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PREFIX="$(realpath -m "$1")"
DEST="${DESTDIR:-}${PREFIX}"
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"

# The version comes from Cargo.toml's [package] section; the committed header
# must carry the same one (a stale header would be caught by the tests too).
VERSION="$(awk '/^\[/{p=($0=="[package]")} p&&/^version *=/{gsub(/.*= *"|".*/,"");print;exit}' Cargo.toml)"
[[ "$VERSION" =~ ^([0-9]+)\.([0-9]+)\.([0-9]+)$ ]] || { echo "install.sh: cannot read the version from Cargo.toml (got '$VERSION')" >&2; exit 1; }
MAJOR="${BASH_REMATCH[1]}"; MINOR="${BASH_REMATCH[2]}"
grep -q "^#define ENGRAM_VERSION_STRING \"$VERSION\"$" include/engram.h || {
    echo "install.sh: include/engram.h is not version $VERSION; refresh it with ENGRAM_UPDATE_HEADER=1 cargo build" >&2
    exit 1
}

# SONAME: the part of the version that promises ABI compatibility. Before 1.0
# a minor release may change the ABI (Cargo's rule for 0.x), so 0.Y.Z gets
# libengram.so.0.Y; from 1.0 on, X.Y.Z gets libengram.so.X.
if [ "$MAJOR" = 0 ]; then SOVERSION="0.$MINOR"; else SOVERSION="$MAJOR"; fi
SONAME="libengram.so.$SOVERSION"
REALNAME="libengram.so.$VERSION"

# One release build of the library (cdylib, staticlib, rlib, as Cargo.toml
# says) that also sets the SONAME of the shared library and prints the system
# libraries a static link needs. The flags apply to this crate only, so the
# dependencies' release builds are reused. Cargo replays the note when the
# build is already fresh.
echo "== cargo rustc --release --lib (SONAME $SONAME)"
LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT
if ! cargo rustc --release --lib -- \
        -C "link-arg=-Wl,-soname,$SONAME" --print native-static-libs >"$LOG" 2>&1; then
    cat "$LOG" >&2
    exit 1
fi
NATIVE_LIBS="$(sed -n 's/^note: native-static-libs: //p' "$LOG" | tail -n 1)"
[ -n "$NATIVE_LIBS" ] || { cat "$LOG" >&2; echo "install.sh: rustc printed no native-static-libs" >&2; exit 1; }
# CMake wants the names without -l.
NATIVE_LIBS_CMAKE="$(printf '%s\n' $NATIVE_LIBS | sed 's/^-l//' | paste -sd';')"

SO="$TARGET_DIR/release/libengram.so"
A="$TARGET_DIR/release/libengram.a"
for f in "$SO" "$A"; do [ -f "$f" ] || { echo "install.sh: $f was not built" >&2; exit 1; }; done

echo "== install into ${DEST}"
install -d "$DEST/include" "$DEST/lib/pkgconfig" "$DEST/lib/cmake/engram"
install -m 644 include/engram.h "$DEST/include/engram.h"
install -m 644 integrations/ggml/engram_ggml.h "$DEST/include/engram_ggml.h"
install -m 755 "$SO" "$DEST/lib/$REALNAME"
install -m 644 "$A" "$DEST/lib/libengram.a"
if [ "${ENGRAM_INSTALL_DEBUG:-0}" != 1 ]; then
    # The shared library: its debug info into lib/.debug/, then stripped and
    # linked to that file. The static library: stripped of debug info (its
    # symbols stay, so it still links; the unstripped one is in target/).
    install -d "$DEST/lib/.debug"
    objcopy --only-keep-debug "$DEST/lib/$REALNAME" "$DEST/lib/.debug/$REALNAME.debug"
    chmod 644 "$DEST/lib/.debug/$REALNAME.debug"
    objcopy --strip-debug --add-gnu-debuglink="$DEST/lib/.debug/$REALNAME.debug" "$DEST/lib/$REALNAME"
    strip --strip-debug "$DEST/lib/libengram.a"
fi
ln -sfn "$REALNAME" "$DEST/lib/$SONAME"
ln -sfn "$SONAME" "$DEST/lib/libengram.so"

# Another build in the same target dir (a plain `cargo build --release`) writes
# a libengram.so without SONAME; make sure the copy we installed has ours.
GOT="$(readelf -d "$DEST/lib/$REALNAME" | sed -n 's/.*Library soname: \[\(.*\)\].*/\1/p')"
[ "$GOT" = "$SONAME" ] || {
    echo "install.sh: installed library has SONAME '$GOT', expected '$SONAME' (a concurrent cargo build replaced it?); run again" >&2
    exit 1
}

subst() {
    sed -e "s|@PREFIX@|$PREFIX|g" -e "s|@VERSION@|$VERSION|g" \
        -e "s|@SONAME@|$SONAME|g" -e "s|@REALNAME@|$REALNAME|g" \
        -e "s|@NATIVE_LIBS@|$NATIVE_LIBS|g" -e "s|@NATIVE_LIBS_CMAKE@|$NATIVE_LIBS_CMAKE|g" \
        "$1" >"$2"
    chmod 644 "$2"
}
subst cmake/engram.pc.in "$DEST/lib/pkgconfig/engram.pc"
subst cmake/engram-static.pc.in "$DEST/lib/pkgconfig/engram-static.pc"
subst cmake/engramConfig.cmake.in "$DEST/lib/cmake/engram/engramConfig.cmake"
subst cmake/engramConfigVersion.cmake.in "$DEST/lib/cmake/engram/engramConfigVersion.cmake"

echo "installed engram $VERSION ($SONAME); static link needs: $NATIVE_LIBS"
echo "  pkg-config: PKG_CONFIG_PATH=$PREFIX/lib/pkgconfig pkg-config --cflags --libs engram"
echo "  CMake:      cmake -DCMAKE_PREFIX_PATH=$PREFIX ...   then find_package(engram) and engram::engram"
