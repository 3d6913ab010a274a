#!/usr/bin/env python3
"""docs/sharding.md's figures: what each layout hands to the collectives per
token and holds per rank, measured by python/tests/test_distributed.py
(ENGRAM_SHARD_FIGURES=PATH) on the tiny model, checked against the formulas
of docs/sharding.md at the tiny geometry, then the same formulas at
DeepSeek-V4.1's geometry.

    ENGRAM_SHARD_FIGURES=/tmp/figures.json <torch venv>/bin/python -m pytest python/tests/test_distributed.py
    python3 scripts/shard_figures.py /tmp/figures.json

Exits 1 if a measured figure differs from its formula.
"""

import json
import sys

LAYOUTS = ("rows", "heads", "wkv", "both")


def part(total, rank, world):
    return total * rank // world, total * (rank + 1) // world


def ceil_div(a, b):
    return -(-a // b)


class Geo:
    """A model's geometry as the formulas need it (per engram layer)."""

    def __init__(self, d, hc, hd, heads, n, layers, table_rows, table_row_bytes, wkv_bytes, fixed, elem=4):
        self.d, self.hc, self.hd, self.heads, self.n1 = d, hc, hd, heads, n - 1
        self.layers = layers
        self.table_rows = table_rows  # per layer
        self.table_row_bytes = table_row_bytes  # per layer
        self.wkv_bytes = wkv_bytes  # per layer
        self.fixed = fixed  # bytes a loader owns besides wkv (q, k, headers, token map)
        self.elem = elem  # bytes of a value handed to a collective (4: f32, 2: bf16)
        self.k_in = self.n1 * heads * hd
        self.k_out = d * (hc + 1)


def moved(g, layout, rank, world, n_tokens):
    """Bytes a rank hands to the collectives per token per layer: (passed,
    own) as test_distributed's Traffic counts them (all-gathers padded to
    the largest part; the kv all-gather first gathers each part's size, one
    int64 per rank per call)."""
    e = g.elem
    rows = g.k_in * e
    o0, o1 = part(g.k_out, rank, world)
    kv_pass = ceil_div(g.k_out, world) * e + 8 / n_tokens
    kv_own = (o1 - o0) * e + 8 / n_tokens
    h0, h1 = part(g.heads, rank, world)
    heads_pass = g.n1 * ceil_div(g.heads, world) * g.hd * e
    heads_own = g.n1 * (h1 - h0) * g.hd * e
    return {
        "rows": (rows, rows),
        "heads": (heads_pass, heads_own),
        "wkv": (kv_pass, kv_own),
        "both": (rows + kv_pass, rows + kv_own),
    }[layout]


def held(g, layout, rank, world):
    """Bytes a rank's context holds over every layer: table rows, wkv, and
    what its loader owns."""
    t_split = layout in ("rows", "both")
    w_split = layout in ("wkv", "both")
    table = wkv = 0
    for li in range(g.layers):
        r0, r1 = part(g.table_rows[li], rank, world) if t_split else (0, g.table_rows[li])
        table += (r1 - r0) * g.table_row_bytes[li]
        o0, o1 = part(g.k_out, rank, world) if w_split else (0, g.k_out)
        wkv += (o1 - o0) * (g.wkv_bytes[li] // g.k_out)
    return {"table": table, "wkv": wkv, "loaded": g.fixed + wkv}


def check(figures):
    """Every measured figure against its formula at the tiny geometry."""
    bad = checked = 0
    w1 = figures["1"]
    whole = w1["whole"]
    tiny = Geo(64, 4, 64, 2, 3, 2, [420, 508], [128, 128], [320 * 256 * 2, 320 * 256 * 4],
               fixed=whole["loaded"] - whole["wkv"])
    for w, f in sorted(figures.items(), key=lambda kv: int(kv[0])):
        world, n = int(w), f["tokens"]
        for rank, m in enumerate(f["ranks"]):
            for layout in LAYOUTS:
                got = m[layout]
                passed, own = moved(tiny, layout, rank, world, n)
                want = {"passed": passed * n * tiny.layers, "own": own * n * tiny.layers,
                        **held(tiny, layout, rank, world)}
                for k, v in want.items():
                    checked += 1
                    if abs(got[k] - v) > 1e-9:
                        print(f"MISMATCH world {world} rank {rank} {layout} {k}: measured {got[k]}, formula {v}")
                        bad += 1
    print(f"{checked} measured figures checked against the formulas")
    return tiny, bad


def table_measured(figures, tiny):
    out = ["| layout | world | handed to collectives, bytes/token/layer (padded; own part) | table bytes/rank | wkv bytes/rank | loader-owned bytes/rank |",
           "|---|---|---|---|---|---|"]
    for layout in LAYOUTS:
        for w, f in sorted(figures.items(), key=lambda kv: int(kv[0])):
            n, L = f["tokens"], f["layers"]
            rs = [r[layout] for r in f["ranks"]]
            span = lambda k, div=1: (f"{min(r[k] for r in rs) / div:g}" if min(r[k] for r in rs) == max(r[k] for r in rs)
                                     else f"{min(r[k] for r in rs) / div:g}–{max(r[k] for r in rs) / div:g}")
            out.append(f"| {layout} | {w} | {span('passed', n * L)}; {span('own', n * L)} | {span('table')} | "
                       f"{span('wkv')} | {span('loaded')} |")
    return "\n".join(out)


def table_v41():
    """The formulas at V4.1 (bf16 values on the wire, fp8 tables, a bf16 or
    block fp8 wkv), per rank, worlds 1..5 and 8."""
    gib, mb = 1 << 30, 1e6
    rows_total = 188.8 * gib / 264  # both layers' fp8 + e8m0 rows, 264 bytes each
    out = ["| layout | world | bytes/token/layer handed in (bf16) | on the wire per rank, ring | tables/rank (GiB) | wkv/rank bf16 (MB) | wkv/rank block fp8 (MB) |",
           "|---|---|---|---|---|---|---|"]
    for layout in LAYOUTS:
        for world in (1, 2, 3, 4, 5, 8):
            g = Geo(5120, 4, 256, 8, 4, 2, [rows_total / 2] * 2, [264, 264], [25600 * 6144 * 2] * 2, 0, elem=2)
            e = 2
            rows = g.k_in * e
            kv_part = ceil_div(g.k_out, world) * e
            heads_part = g.n1 * ceil_div(g.heads, world) * g.hd * e
            hand = {"rows": rows, "heads": heads_part, "wkv": kv_part, "both": rows + kv_part}[layout]
            ring_ar = 2 * (world - 1) / world * rows
            wire = {"rows": ring_ar, "heads": (world - 1) * heads_part, "wkv": (world - 1) * kv_part,
                    "both": ring_ar + (world - 1) * kv_part}[layout]
            t_split = layout in ("rows", "both")
            w_split = layout in ("wkv", "both")
            tables = 188.8 / (world if t_split else 1)
            wkv_bf16 = 25600 * 6144 * 2 / mb / (world if w_split else 1)
            blocks = ceil_div(25600, 128)
            b0, b1 = part(blocks, 0, world) if w_split else (0, blocks)
            b_hi = max(part(blocks, r, world)[1] - part(blocks, r, world)[0] for r in range(world)) if w_split else blocks
            fp8 = lambda nb: (nb * 128 * 6144 + nb * ceil_div(6144, 128)) / mb
            fp8s = f"{fp8(b1 - b0):.1f}" if fp8(b1 - b0) == fp8(b_hi) else f"{fp8(b1 - b0):.1f}–{fp8(b_hi):.1f}"
            out.append(f"| {layout} | {world} | {hand:,.0f} | {wire:,.0f} | {tables:.1f} | {wkv_bf16:.1f} | {fp8s} |")
    return "\n".join(out)


def main():
    figures = json.load(open(sys.argv[1]))
    tiny, bad = check(figures)
    print(table_measured(figures, tiny))
    print()
    print(table_v41())
    print(f"\n{bad} measured figures differ from the formulas")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
