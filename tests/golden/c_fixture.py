#!/usr/bin/env python3
"""Convert the golden `data/tiny.json` into `data/c_fixture.txt` for the C tests.

C cannot read JSON comfortably, so the C golden test (`c_tests/test_golden.c`)
reads this plain whitespace format instead: one record per line,

    name count v1 v2 ... v_count

with integers in decimal (i64 values as their u64 bits, f32 as u32 bits, bf16
as u16 bits, exactly as tiny.json stores them) and a few single-word strings
(regime and highway names, formats). Records come in a fixed order that the C
parser expects; see `c_tests/test_golden.c`. Layer rows and kv (`rows_bf16`,
`kv_bf16`, every token's; zero for a dead token) are there for `engram_read_back`.

Python 3 standard library only. Usage (from anywhere):

    python3 tests/golden/c_fixture.py [tiny.json [c_fixture.txt]]

The output is deterministic (same input, same bytes).
"""

import json
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
U64 = (1 << 64) - 1

# engram_type numbers of the formats and dtypes named in tiny.json.
TYPES = {"f32": 0, "f16": 1, "bf16": 30, "fp8": 1000}


def main(argv):
    src = argv[1] if len(argv) > 1 else os.path.join(HERE, "data", "tiny.json")
    dst = argv[2] if len(argv) > 2 else os.path.join(HERE, "data", "c_fixture.txt")
    with open(src, encoding="utf-8") as f:
        g = json.load(f)

    lines = []

    def rec(name, values):
        values = list(values)
        for v in values:
            if isinstance(v, bool):
                raise TypeError(f"{name}: bool {v} (convert first)")
        lines.append(" ".join([name, str(len(values))] + [str(v) for v in values]))

    def ints(name, values, mask=None):
        out = []
        for v in values:
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"{name}: {v!r} is not an integer")
            out.append(v & mask if mask is not None else v)
        rec(name, out)

    def word(name, s):
        s = str(s)
        if not s or any(c.isspace() for c in s):
            raise ValueError(f"{name}: {s!r} is not a single word")
        rec(name, [s])

    m = g["model"]
    n_layers = len(m["layer_ids"])
    rec("engram_c_fixture", [1])
    for k in ("D", "hc", "Hd", "H", "N", "C", "vocab", "pad_token_id", "pad_id"):
        ints(k, [m[k]])
    ints("eps_f32", [m["eps_f32"]])
    ints("layer_ids", m["layer_ids"])
    ints("token_map", m["token_map"])
    ints("multipliers", m["multipliers"], U64)
    ints("primes", m["primes"], U64)
    ints("offsets", m["offsets"], U64)
    ints("rows", m["rows"])
    ints("table_format", [TYPES[x] for x in m["table_format"]])
    ints("wkv_dtype", [TYPES[x] for x in m["wkv_dtype"]])
    ints("qk_dtype", [TYPES[x] for x in m["qk_dtype"]])
    assert len(m["table_format"]) == n_layers

    fc = g["filler_check"]
    word("check_name", fc["name"])
    ints("check_bits", fc["bits"], U64)
    ints("check_unit_f32", fc["unit_f32"])
    # value scale and offset are small dyadic numbers: store them as f32 bits.
    def f32bits(x):
        return struct.unpack("<I", struct.pack("<f", float(x)))[0]

    ints("check_value_scale_f32", [f32bits(fc["value_scale"])])
    ints("check_value_offset_f32", [f32bits(fc["value_offset"])])
    ints("check_value_f32", fc["value_f32"])

    regimes = g["regimes"]
    ints("n_regimes", [len(regimes)])
    for rname, r in regimes.items():
        word("regime", rname)
        calls = r["calls"]
        ints("n_calls", [len(calls)])
        for c in calls:
            n = len(c["tokens"])
            word("highway_name", c["highway_name"])
            ints("tokens", c["tokens"])
            ints("seq_ids", c["seq_ids"])
            ints("pos", c["pos"])
            ints("dead", [1 if d else 0 for d in c["dead"]])
            ints("ids", c["ids"], U64)
            assert len(c["ids"]) == n * n_layers * m["C"], rname
            assert len(c["layers"]) == n_layers, rname
            for li, layer in enumerate(c["layers"]):
                assert layer["layer_id"] == m["layer_ids"][li], rname
                ints("layer_id", [layer["layer_id"]])
                hw = n * m["hc"] * m["D"]
                assert len(layer["highway_out_f32"]) == hw, rname
                assert len(layer["highway_out_bf16"]) == hw, rname
                ints("highway_out_f32", layer["highway_out_f32"])
                ints("highway_out_bf16", layer["highway_out_bf16"])
                assert len(layer["rows_bf16"]) == n * m["C"] * m["Hd"], rname
                assert len(layer["kv_bf16"]) == n * m["D"] * (m["hc"] + 1), rname
                ints("rows_bf16", layer["rows_bf16"])
                ints("kv_bf16", layer["kv_bf16"])
        # Only `rollback` has these; the others get empty records.
        ints("straight_tokens", r.get("straight_tokens", []))
        ints("straight_ids", r.get("straight_ids", []), U64)
    rec("end", [])

    tmp = dst + ".tmp"
    with open(tmp, "w", encoding="ascii", newline="\n") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, dst)
    print(f"wrote {dst} ({len(lines)} records)")


if __name__ == "__main__":
    main(sys.argv)
