#!/usr/bin/env python3
"""Oracle for engram's GGUF block formats (q8_0, q4_0, q2_K, q3_K, q4_K, q5_K, q6_K).

Writes data/gguf_blocks.json: for each format, raw ggml blocks and the f32 values
that the `gguf` PyPI package's numpy dequantisers (`gguf.quants.dequantize`)
give for them. `tests/formats_gguf.rs` checks the library against it bit for bit.

Two references, each written from its own source, must agree before anything is
written:
  - gguf-py's `dequantize` (the oracle stored in the file), and
  - `ggml_row`, below: a scalar transcription of ggml's C `dequantize_row_*`
    loops (ggml-quants.c) with one f32 rounding per C operation, in C's order
    and without fused multiply-adds.
The transcription also asserts that every f32 product is exact (see "Rounding"
in the data file's `notes`): only the final subtraction of q2_K/q4_K/q5_K
rounds, so no compiler's operation order or FMA contraction changes a value.

Blocks (the filler is tests/golden/README.md's `bits(name, i)`):
  - random: byte k of random block i of format F is
    `bits("gguf.F.random", i * 256 + k) & 0xFF`, then each f16 field (`d`, and
    `dmin` where the format has it) is replaced by a finite f16 with random sign,
    exponent field `bits(...) % 31` (0 = zero/subnormal .. 30) and random mantissa;
  - edge: `d` (and separately `dmin`) at +-0, +-1, the largest and smallest
    normal f16, the smallest and largest subnormal, +-inf and NaN; `d = dmin = 0`;
    every quant bit clear / set; every scale code clear / set; and blocks whose
    scales run through every code (6-bit packed K-quant scales 0..63 for both
    scale and min, q2_K's 4-bit pairs, q6_K's int8 scales -128..127, q8_0's int8
    codes, q4_0's nibbles).

Everything is deterministic: two runs write the same bytes.
"""

import json
import os
import sys

import gguf
import numpy as np
from gguf.quants import dequantize
from gguf.constants import GGMLQuantizationType as T

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")

M64 = (1 << 64) - 1


# --- the filler (tests/golden/README.md) --------------------------------------


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & M64
    return h


def mix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


class Filler:
    def __init__(self, name: str):
        self.h = fnv1a64(("engram-golden-v1:" + name).encode("utf-8"))

    def bits(self, i: int) -> int:
        return mix64(self.h ^ mix64(i & M64))


# --- formats ------------------------------------------------------------------

# name: (ggml type, values per block, bytes per block,
#        offsets of the f16 fields (d first), byte ranges of scales, of quants)
FORMATS = {
    "q8_0": (T.Q8_0, 32, 34, [0], [], [(2, 34)]),
    "q4_0": (T.Q4_0, 32, 18, [0], [], [(2, 18)]),
    "q2_K": (T.Q2_K, 256, 84, [80, 82], [(0, 16)], [(16, 80)]),
    "q3_K": (T.Q3_K, 256, 110, [108], [(96, 108)], [(0, 96)]),
    "q4_K": (T.Q4_K, 256, 144, [0, 2], [(4, 16)], [(16, 144)]),
    "q5_K": (T.Q5_K, 256, 176, [0, 2], [(4, 16)], [(16, 176)]),
    "q6_K": (T.Q6_K, 256, 210, [208], [(192, 208)], [(0, 192)]),
}

N_RANDOM = {"q8_0": 256, "q4_0": 256}  # K-quants: the default below
N_RANDOM_K = 64

F16_EDGES = [
    ("+0", 0x0000),
    ("-0", 0x8000),
    ("+1", 0x3C00),
    ("-1", 0xBC00),
    ("max normal", 0x7BFF),
    ("-max normal", 0xFBFF),
    ("min normal", 0x0400),
    ("min subnormal", 0x0001),
    ("max subnormal", 0x03FF),
    ("-min subnormal", 0x8001),
    ("+inf", 0x7C00),
    ("-inf", 0xFC00),
    ("nan", 0x7E00),
]
F16_ONE = 0x3C00
F16_SIXTEENTH = 0x2C00  # 0.0625


def put_f16(blk: bytearray, at: int, bits16: int):
    blk[at] = bits16 & 0xFF
    blk[at + 1] = bits16 >> 8


def tame_f16(b: int) -> int:
    """A finite f16 from 64 random bits: random sign and mantissa, exponent 0..30."""
    sign = (b >> 63) & 1
    exp = (b >> 16) % 31
    man = b & 0x3FF
    return (sign << 15) | (exp << 10) | man


def random_block(name: str, i: int) -> bytearray:
    _, _, nbytes, f16s, _, _ = FORMATS[name]
    f = Filler(f"gguf.{name}.random")
    blk = bytearray(f.bits(i * 256 + k) & 0xFF for k in range(nbytes))
    for j, at in enumerate(f16s):
        put_f16(blk, at, tame_f16(f.bits(i * 256 + 250 + j)))
    return blk


def pack_k4(sc, mn) -> bytes:
    """The 12 scale bytes of q4_K / q5_K for 6-bit scales `sc[8]` and mins `mn[8]`
    (the inverse of ggml's get_scale_min_k4)."""
    b = [0] * 12
    for j in range(4):
        b[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6)
        b[j + 4] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6)
        b[j + 8] = (sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4)
    return bytes(b)


def pack_q3(codes) -> bytes:
    """The 12 scale bytes of q3_K for 6-bit codes `codes[16]` (scale = code - 32)."""
    b = [0] * 12
    for j, c in enumerate(codes):
        if j < 8:
            b[j] |= c & 0xF
        else:
            b[j - 8] |= (c & 0xF) << 4
        b[8 + j % 4] |= (c >> 4) << (2 * (j // 4))
    return bytes(b)


def edge_blocks(name: str):
    """(label, block) pairs of the edge cases for one format."""
    _, _, nbytes, f16s, scale_ranges, quant_ranges = FORMATS[name]
    out = []
    k = 0

    def base():
        # Random bytes (quants and scales) with tame f16 fields of 1 and 1/16.
        nonlocal k
        f = Filler(f"gguf.{name}.edge")
        blk = bytearray(f.bits(k * 256 + j) & 0xFF for j in range(nbytes))
        k += 1
        put_f16(blk, f16s[0], F16_ONE)
        if len(f16s) > 1:
            put_f16(blk, f16s[1], F16_SIXTEENTH)
        return blk

    for label, v in F16_EDGES:
        blk = base()
        put_f16(blk, f16s[0], v)
        out.append((f"d = {label}", blk))
    if len(f16s) > 1:
        for label, v in F16_EDGES:
            blk = base()
            put_f16(blk, f16s[1], v)
            out.append((f"dmin = {label}", blk))
        blk = base()
        put_f16(blk, f16s[0], 0)
        put_f16(blk, f16s[1], 0)
        out.append(("d = dmin = 0", blk))
    for qlabel, qb in (("quant bits all clear", 0x00), ("quant bits all set", 0xFF)):
        blk = base()
        for a, b in quant_ranges:
            blk[a:b] = bytes([qb]) * (b - a)
        out.append((qlabel, blk))
    for slabel, sb in (("scale bits all clear", 0x00), ("scale bits all set", 0xFF)):
        for a, b in scale_ranges:
            blk = base()
            blk[a:b] = bytes([sb]) * (b - a)
            out.append((slabel, blk))
            for qlabel, qb in (("quant bits all clear", 0x00), ("quant bits all set", 0xFF)):
                blk = bytearray(blk)
                for qa, qe in quant_ranges:
                    blk[qa:qe] = bytes([qb]) * (qe - qa)
                out.append((f"{slabel}, {qlabel}", blk))
    # Every code of the scales (or, for q8_0 / q4_0, of the quants).
    if name in ("q4_K", "q5_K"):
        for c0 in range(0, 64, 8):
            sc = [(c0 + j) % 64 for j in range(8)]
            mn = [(c0 + 37 + j) % 64 for j in range(8)]
            blk = base()
            blk[4:16] = pack_k4(sc, mn)
            out.append((f"scales {sc[0]}..{sc[-1]}, mins {mn[0]}..{mn[-1]} mod 64", blk))
    elif name == "q3_K":
        for c0 in range(0, 64, 16):
            codes = [c0 + j for j in range(16)]
            blk = base()
            blk[96:108] = pack_q3(codes)
            out.append((f"scale codes {codes[0]}..{codes[-1]}", blk))
    elif name in ("q2_K", "q6_K"):
        a, b = scale_ranges[0]
        for s0 in range(0, 256, 16):
            blk = base()
            blk[a:b] = bytes((s0 + j) & 0xFF for j in range(16))
            out.append((f"scale bytes {s0}..{s0 + 15}", blk))
    elif name == "q8_0":
        for s0 in range(0, 256, 32):
            blk = base()
            blk[2:34] = bytes((s0 + j) & 0xFF for j in range(32))
            out.append((f"quant bytes {s0}..{s0 + 31}", blk))
    elif name == "q4_0":
        for s0 in range(0, 256, 16):
            blk = base()
            blk[2:18] = bytes((s0 + j) & 0xFF for j in range(16))
            out.append((f"quant bytes {s0}..{s0 + 15}", blk))
    return out


# --- a scalar transcription of ggml's dequantize_row_* ------------------------
# One np.float32 operation per C operation, in C's order; ints become f32 where
# C converts them (exactly: they are small).

F32 = np.float32
EXACT = [0]  # products checked exact


def mul(a, b):
    """An f32 product (one C `*`), asserting that it is exact: every product in
    these formats has at most 23 significant bits (an 11-bit f16 times small
    integers), so none rounds, and only q2_K/q4_K/q5_K's final subtraction does."""
    r = F32(a) * F32(b)
    if np.isfinite(r):
        assert float(r) == float(a) * float(b), (a, b, r)
        EXACT[0] += 1
    return r


def f16(blk, at):
    return np.frombuffer(bytes(blk[at : at + 2]), dtype="<f2")[0].astype(np.float32)


def get_scale_min_k4(j, q):
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def ggml_row(name, blk):
    y = []
    if name == "q8_0":
        d = f16(blk, 0)
        for j in range(32):
            y.append(mul(F32(np.uint8(blk[2 + j]).view(np.int8)), d))
    elif name == "q4_0":
        d = f16(blk, 0)
        lo, hi = [], []
        for j in range(16):
            lo.append(mul(F32((blk[2 + j] & 0x0F) - 8), d))
            hi.append(mul(F32((blk[2 + j] >> 4) - 8), d))
        y = lo + hi
    elif name == "q2_K":
        sc, qs = blk[0:16], blk[16:80]
        d, mn = f16(blk, 80), f16(blk, 82)
        is_ = 0
        for n in (0, 128):
            q = qs[n // 4 :]
            for shift in (0, 2, 4, 6):
                for off in (0, 16):
                    s = sc[is_]
                    is_ += 1
                    dl, ml = mul(d, s & 0xF), mul(mn, s >> 4)
                    for l in range(16):
                        y.append(mul(dl, (q[l + off] >> shift) & 3) - ml)
    elif name == "q3_K":
        hm, qs, raw = blk[0:32], blk[32:96], blk[96:108]
        d_all = f16(blk, 108)
        scales = []
        for j in range(16):
            low = raw[j] & 0xF if j < 8 else raw[j - 8] >> 4
            high = (raw[8 + j % 4] >> (2 * (j // 4))) & 3
            scales.append((low | (high << 4)) - 32)
        is_ = 0
        m = 1
        for n in (0, 128):
            q = qs[n // 4 :]
            for shift in (0, 2, 4, 6):
                for off in (0, 16):
                    dl = mul(d_all, scales[is_])
                    is_ += 1
                    for l in range(16):
                        v = ((q[l + off] >> shift) & 3) - (0 if hm[l + off] & m else 4)
                        y.append(mul(dl, v))
                m <<= 1
    elif name in ("q4_K", "q5_K"):
        d, mn = f16(blk, 0), f16(blk, 2)
        raw = blk[4:16]
        if name == "q4_K":
            qh, ql = None, blk[16:144]
        else:
            qh, ql = blk[16:48], blk[48:176]
        is_ = 0
        u1, u2 = 1, 2
        for j in range(0, 256, 64):
            q = ql[j // 2 :]
            sc, m = get_scale_min_k4(is_, raw)
            d1, m1 = mul(d, sc), mul(mn, m)
            sc, m = get_scale_min_k4(is_ + 1, raw)
            d2, m2 = mul(d, sc), mul(mn, m)
            for l in range(32):
                v = (q[l] & 0xF) + (16 if qh is not None and qh[l] & u1 else 0)
                y.append(mul(d1, v) - m1)
            for l in range(32):
                v = (q[l] >> 4) + (16 if qh is not None and qh[l] & u2 else 0)
                y.append(mul(d2, v) - m2)
            is_ += 2
            u1 <<= 2
            u2 <<= 2
    elif name == "q6_K":
        d = f16(blk, 208)
        y = [None] * 256
        for n in (0, 128):
            ql = blk[n // 2 : n // 2 + 64]
            qh = blk[128 + n // 4 : 128 + n // 4 + 32]
            sc = [int(np.uint8(b).view(np.int8)) for b in blk[192 + n // 16 : 192 + n // 16 + 8]]
            for l in range(32):
                is_ = l // 16
                q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32
                q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32
                q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32
                q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32
                y[n + l] = mul(mul(d, sc[is_]), q1)
                y[n + l + 32] = mul(mul(d, sc[is_ + 2]), q2)
                y[n + l + 64] = mul(mul(d, sc[is_ + 4]), q3)
                y[n + l + 96] = mul(mul(d, sc[is_ + 6]), q4)
    else:
        raise ValueError(name)
    out = np.array(y, dtype=np.float32)
    assert out.dtype == np.float32 and out.shape == (FORMATS[name][1],)
    return out


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit, except that any NaN equals any NaN."""
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a.view(np.uint32)[~nan], b.view(np.uint32)[~nan]))


# --- output -------------------------------------------------------------------


def format_json(name):
    qtype, nvals, nbytes, _, _, _ = FORMATS[name]
    labelled = [(f"random {i}", random_block(name, i)) for i in range(N_RANDOM.get(name, N_RANDOM_K))]
    labelled += edge_blocks(name)
    raw = np.frombuffer(b"".join(bytes(b) for _, b in labelled), dtype=np.uint8).reshape(-1, nbytes)
    with np.errstate(all="ignore"):
        oracle = dequantize(raw, qtype)
        assert oracle.dtype == np.float32 and oracle.shape == (len(labelled), nvals)
        for (label, blk), want in zip(labelled, oracle):
            got = ggml_row(name, blk)
            if not same_bits(got, want):
                bad = int(np.nonzero(got.view(np.uint32) != want.view(np.uint32))[0][0])
                raise SystemExit(
                    f"{name} {label}: gguf-py and the ggml transcription differ at {bad}: "
                    f"{want[bad]!r} vs {got[bad]!r}"
                )
    blocks = []
    for (label, blk), vals in zip(labelled, oracle):
        blocks.append(
            {
                "label": label,
                "bytes": bytes(blk).hex(),
                "f32": "".join(f"{int(u):08x}" for u in vals.view(np.uint32)),
            }
        )
    return {
        "ggml_type": int(qtype),
        "block_values": nvals,
        "block_bytes": nbytes,
        "n_random": N_RANDOM.get(name, N_RANDOM_K),
        "blocks": blocks,
    }


NOTES = [
    "bytes: one ggml block, hex. f32: the block's values as f32 bit patterns, 8 hex digits "
    "each (most significant first), from gguf-py's gguf.quants.dequantize.",
    "Rounding: every product in these formats is exact in f32 (an f16 d has 11 significant "
    "bits; times a scale of at most 7 bits and a quant of at most 5 bits that is at most 23 "
    "bits, and no f32 overflow or subnormal is reachable from a finite f16), so q8_0, q4_0, "
    "q3_K and q6_K values are exact and q2_K, q4_K, q5_K ((d*sc)*q - (dmin*m)) round once, "
    "in the subtraction. So the order of the multiplications and FMA contraction (GCC's "
    "-ffp-contract=fast, nvcc's --fmad=true) cannot change any value: ggml's C, gguf-py and "
    "a CUDA kernel agree bit for bit. gen_formats.py asserts every product exact.",
]


def main():
    os.makedirs(DATA, exist_ok=True)
    doc = {
        "generator": "tests/golden/gen_formats.py",
        "gguf_version": gguf.__version__ if hasattr(gguf, "__version__") else None,
        "numpy_version": np.__version__,
        "notes": NOTES,
        "formats": {name: format_json(name) for name in FORMATS},
    }
    if doc["gguf_version"] is None:
        from importlib.metadata import version

        doc["gguf_version"] = version("gguf")
    # One block per line keeps the file diffable.
    lines = ["{"]
    for key in ("generator", "gguf_version", "numpy_version", "notes"):
        lines.append(f" {json.dumps(key)}: {json.dumps(doc[key])},")
    lines.append(' "formats": {')
    names = list(doc["formats"])
    for fi, name in enumerate(names):
        f = doc["formats"][name]
        lines.append(f"  {json.dumps(name)}: {{")
        for key in ("ggml_type", "block_values", "block_bytes", "n_random"):
            lines.append(f"   {json.dumps(key)}: {json.dumps(f[key])},")
        lines.append('   "blocks": [')
        bl = f["blocks"]
        for bi, b in enumerate(bl):
            sep = "," if bi + 1 < len(bl) else ""
            lines.append("    " + json.dumps(b, separators=(",", ":")) + sep)
        lines.append("   ]")
        lines.append("  }" + ("," if fi + 1 < len(names) else ""))
    lines.append(" }")
    lines.append("}")
    path = os.path.join(DATA, "gguf_blocks.json")
    with open(path, "w", encoding="utf-8", newline="\n") as fh:
        fh.write("\n".join(lines) + "\n")
    json.load(open(path))  # well-formed
    counts = ", ".join(f"{n} {len(doc['formats'][n]['blocks'])}" for n in names)
    print(
        f"gguf_blocks.json: {os.path.getsize(path)} bytes ({counts}); {EXACT[0]} exact products",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
