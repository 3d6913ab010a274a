#!/usr/bin/env python3
"""Condense engram-replay --json outputs into the Markdown tables of
BENCHMARKS.md: usage: summarize.py NAME=FILE.json ..."""
import json
import sys


def mib(b):
    return f"{b >> 30} GiB" if b >= 1 << 30 else f"{b >> 20} MiB"


def main():
    runs = [(a.split("=", 1)[0], json.load(open(a.split("=", 1)[1]))) for a in sys.argv[1:]]
    print("| corpus | tokens | requests | schedule | RAM | hit % lru / clock / s3fifo / mmap pages | read B/token lru / clock / s3fifo / mmap | s3fifo vs mmap bytes |")
    print("|---|---|---|---|---|---|---|---|")
    for name, d in runs:
        reqs = d.get("requests", d.get("texts"))
        for s in d["schedules"]:
            for size in d["sizes"]:
                row = {c["policy"]: c for c in s["caches"] if c["bytes"] == size}
                hit = " / ".join(f"{row[p]['hit_rate'][-1] * 100:.1f}" for p in ("lru", "clock", "s3fifo", "mmap") if p in row)
                bt = " / ".join(f"{row[p]['read_bytes_per_token']:.0f}" for p in ("lru", "clock", "s3fifo", "mmap") if p in row)
                ratio = row["s3fifo"]["read_bytes_per_token"] / row["mmap"]["read_bytes_per_token"]
                print(f"| {name} | {d['tokens']} | {reqs} | {s['schedule']} | {mib(size)} | {hit} | {bt} | {ratio:.3f} |")
    print()
    print("| corpus | " + " | ".join(x["schedule"] for x in runs[0][1]["dedup"]) + " |")
    print("|---|" + "---|" * len(runs[0][1]["dedup"]))
    for name, d in runs:
        print(f"| {name} | " + " | ".join(f"{x['distinct_over_lookups'][-1]:.3f}" for x in d["dedup"]) + " |")
    print()
    for name, d in runs:
        for p, v in d["verdict"].items():
            below = ", ".join(v["below_lru"]) or "never"
            print(f"- {name} {p}: below LRU at: {below}; mmap bytes / its bytes at 1 and 4 GiB >= {v['min_mmap_over_cache_at_1_4_gib']:.2f}")


main()
