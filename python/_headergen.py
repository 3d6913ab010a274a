"""Generate the package's ctypes view of include/engram.h at build time.

Nothing about the C ABI's structs is written by hand: this module reads the
committed header (the one cbindgen renders from the Rust sources) and emits
``engram/_structs.py`` with

- one ``ctypes.Structure`` per ``typedef struct engram_* { ... }`` (fields in
  header order, C types mapped one to one; every pointer is ``c_void_p`` or,
  for ``char *``, ``c_char_p``),
- the ``engram_status`` and ``engram_type`` enumerators and the header's
  integer ``#define``s,
- the header's version string.

``verify_layout`` then compiles a small C program against the same header
that prints ``sizeof`` and every field's ``offsetof``, and compares them with
what ctypes computes for the generated classes, so a header the parser
misreads fails the build instead of corrupting memory at run time.

Standard library only (it runs inside the build backend).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile

# C scalar types of the header -> ctypes names.
SCALARS = {
    "size_t": "c_size_t",
    "uint8_t": "c_uint8",
    "uint16_t": "c_uint16",
    "uint32_t": "c_uint32",
    "uint64_t": "c_uint64",
    "int8_t": "c_int8",
    "int16_t": "c_int16",
    "int32_t": "c_int32",
    "int64_t": "c_int64",
    "float": "c_float",
    "double": "c_double",
}

# (header prefix, Python class, docstring) of the enums the package exposes.
ENUMS = (
    ("STATUS", "Status", "The C ABI's `engram_status` codes (ENGRAM_STATUS_*)."),
    ("TYPE", "Type", "Element, row and weight formats (`engram_type`, ENGRAM_TYPE_*)."),
    ("BACKEND", "Backend", "Where apply runs (`engram_backend`, ENGRAM_BACKEND_*)."),
)

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_STRUCT = re.compile(r"typedef\s+struct\s+(engram_\w+)\s*\{(.*?)\}\s*\1\s*;", re.S)
_FIELD = re.compile(r"^(?:const\s+)?(\w+)\s*(\**)\s*(\w+)$")
_ENUM = re.compile(r"^\s*(ENGRAM_(STATUS|TYPE|BACKEND)_\w+)\s*=\s*(\d+)\s*,", re.M)
_DEFINE = re.compile(r"^#define\s+(ENGRAM_\w+)\s+(-?\d+)\s*$", re.M)
_VERSION = re.compile(r'^#define\s+ENGRAM_VERSION_STRING\s+"([^"]+)"', re.M)


def parse(header_text: str):
    """(structs, enums, defines, version): structs is [(name, [(field, ctype)])]."""
    text = _COMMENT.sub("", header_text)
    structs = []
    for name, body in _STRUCT.findall(text):
        fields = []
        for decl in body.split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            m = _FIELD.match(decl)
            if not m:
                raise ValueError(f"{name}: cannot read the field declaration {decl!r}")
            base, stars, field = m.groups()
            if stars:
                ctype = "c_char_p" if (base == "char" and stars == "*") else "c_void_p"
            elif base in SCALARS:
                ctype = SCALARS[base]
            else:
                raise ValueError(f"{name}.{field}: unknown C type {base!r}")
            fields.append((field, ctype))
        structs.append((name, fields))
    if not structs:
        raise ValueError("no engram structs found in the header")
    enums = [(n, int(v)) for n, _, v in _ENUM.findall(text)]
    defines = [(n, int(v)) for n, v in _DEFINE.findall(header_text)]
    m = _VERSION.search(header_text)
    if not m:
        raise ValueError("the header has no ENGRAM_VERSION_STRING")
    return structs, enums, defines, m.group(1)


def render(header_text: str) -> str:
    structs, enums, defines, version = parse(header_text)
    out = [
        '"""Generated at build time from include/engram.h by _headergen.py: do not edit."""',
        "",
        "import ctypes",
        "import enum",
        "",
        f"HEADER_VERSION = {version!r}",
        "",
    ]
    for n, v in defines:
        out.append(f"{n} = {v}")
    out.append("")
    for kind, cls, doc in ENUMS:
        members = [(n, v) for n, v in enums if n.startswith(f"ENGRAM_{kind}_")]
        out.append("")
        out.append(f"class {cls}(enum.IntEnum):")
        out.append(f'    """{doc}"""')
        out.append("")
        for n, v in members:
            out.append(f"    {n[len(f'ENGRAM_{kind}_'):]} = {v}")
        out.append("")
    for name, fields in structs:
        out.append("")
        out.append(f"class {name}(ctypes.Structure):")
        out.append("    _fields_ = [")
        for field, ctype in fields:
            out.append(f"        ({field!r}, ctypes.{ctype}),")
        out.append("    ]")
        out.append("")
    out.append("")
    out.append("STRUCTS = {")
    for name, _ in structs:
        out.append(f"    {name!r}: {name},")
    out.append("}")
    out.append("")
    return "\n".join(out)


def generate(header_path: str, out_path: str) -> None:
    with open(header_path, encoding="utf-8") as f:
        text = f.read()
    src = render(text)
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(src)


def c_layout(header_path: str, structs, cc: str | None = None) -> dict:
    """{struct: (sizeof, {field: offsetof})} as the C compiler lays them out."""
    cc = cc or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise FileNotFoundError("no C compiler (set CC)")
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "engram.h"', "int main(void) {"]
    for name, fields in structs:
        lines.append(f'    printf("S {name} %zu\\n", sizeof(struct {name}));')
        for field, _ in fields:
            lines.append(f'    printf("F {name} {field} %zu\\n", offsetof(struct {name}, {field}));')
    lines += ["    return 0;", "}"]
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "layout.c")
        exe = os.path.join(tmp, "layout")
        with open(src, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        inc = os.path.dirname(os.path.abspath(header_path))
        subprocess.run([cc, "-std=c11", "-I", inc, src, "-o", exe], check=True)
        res = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    layout: dict = {}
    for line in res.splitlines():
        parts = line.split()
        if parts[0] == "S":
            layout[parts[1]] = (int(parts[2]), {})
        else:
            layout[parts[1]][1][parts[2]] = int(parts[3])
    return layout


def verify_layout(header_path: str, structs_module, cc: str | None = None) -> list:
    """Differences between the C compiler's layout and the generated ctypes classes."""
    with open(header_path, encoding="utf-8") as f:
        structs, _, _, _ = parse(f.read())
    want = c_layout(header_path, structs, cc)
    problems = []
    for name, fields in structs:
        cls = structs_module.STRUCTS[name]
        size, offsets = want[name]
        import ctypes

        if ctypes.sizeof(cls) != size:
            problems.append(f"{name}: ctypes size {ctypes.sizeof(cls)}, C size {size}")
        for field, _ in fields:
            got = getattr(cls, field).offset
            if got != offsets[field]:
                problems.append(f"{name}.{field}: ctypes offset {got}, C offset {offsets[field]}")
    return problems
