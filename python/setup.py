"""Build hooks of the engram package (the rest is in pyproject.toml).

`pip install ./python` runs `build_py` below, which
1. builds libengram.so from this checkout with cargo, as scripts/install.sh
   does (the same `cargo rustc --release --lib` command and flags, so a
   release build the install check already made is reused, not redone;
   CARGO_TARGET_DIR is honoured, default <checkout>/target), and copies it
   into the package; ENGRAM_LIB=/path/to/libengram.so ships a library built
   elsewhere instead (no cargo);
2. generates engram/_structs.py from include/engram.h (_headergen.py), so the
   ctypes structs follow the header, and checks their sizes and offsets against
   the C compiler's (skipped with a warning only when no C compiler exists).
The wheel is platform-specific (it carries a shared library).
"""

import os
import re
import shutil
import subprocess
import sys
import warnings

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _headergen  # noqa: E402

ROOT = os.environ.get("ENGRAM_SOURCE_DIR") or os.path.dirname(HERE)
HEADER = os.path.join(ROOT, "include", "engram.h")


def cargo_version():
    with open(os.path.join(ROOT, "Cargo.toml"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r'^\[package\][^\[]*?^version\s*=\s*"([^"]+)"', text, re.M | re.S)
    if not m:
        raise RuntimeError("cannot read [package] version from Cargo.toml")
    return m.group(1)


def build_library():
    """Path of a libengram.so built from ROOT (or given by ENGRAM_LIB)."""
    given = os.environ.get("ENGRAM_LIB")
    if given:
        if not os.path.isfile(given):
            raise RuntimeError(f"ENGRAM_LIB={given} is not a file")
        return given
    if not os.path.isfile(os.path.join(ROOT, "Cargo.toml")):
        raise RuntimeError(
            f"no Cargo.toml in {ROOT}: build from the engram checkout "
            "(pip install ./python), or set ENGRAM_SOURCE_DIR or ENGRAM_LIB"
        )
    version = cargo_version()
    major, minor = version.split(".")[:2]
    soname = f"libengram.so.0.{minor}" if major == "0" else f"libengram.so.{major}"
    # The same command and flags as scripts/install.sh: cargo's fingerprint
    # then matches, and an existing release build is reused.
    cmd = [
        "cargo", "rustc", "--release", "--lib", "--",
        "-C", f"link-arg=-Wl,-soname,{soname}", "--print", "native-static-libs",
    ]
    print("engram: " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)
    target = os.environ.get("CARGO_TARGET_DIR") or "target"
    target = os.path.join(ROOT, target)  # a relative dir is cargo's cwd's: ROOT
    so = os.path.join(target, "release", "libengram.so")
    if not os.path.isfile(so):
        raise RuntimeError(f"cargo built no {so}")
    return so


class BuildPy(build_py):
    def run(self):
        super().run()
        pkg = os.path.join(self.build_lib, "engram")
        os.makedirs(pkg, exist_ok=True)
        structs = os.path.join(pkg, "_structs.py")
        _headergen.generate(HEADER, structs)
        self._verify(structs)
        shutil.copyfile(build_library(), os.path.join(pkg, "libengram.so"))

    @staticmethod
    def _verify(structs_path):
        import importlib.util

        spec = importlib.util.spec_from_file_location("_engram_structs_check", structs_path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        try:
            problems = _headergen.verify_layout(HEADER, mod)
        except (FileNotFoundError, subprocess.CalledProcessError) as e:
            warnings.warn(f"engram: struct layouts not checked against a C compiler ({e})")
            return
        if problems:
            raise RuntimeError("generated ctypes structs differ from the C layout:\n" + "\n".join(problems))


class BinaryDistribution(Distribution):
    """A wheel tagged for this platform: it ships libengram.so."""

    def has_ext_modules(self):
        return True


setup(version=cargo_version(), cmdclass={"build_py": BuildPy}, distclass=BinaryDistribution)
