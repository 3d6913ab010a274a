"""The layer sharded across processes with torch.distributed (gloo, this
machine), world sizes 1..5 (5 divides neither the heads nor anything else):
each rank a shard context of tiny.gguf that hashes the step itself, then

- row ranges: ``gather_rows`` of the rows it holds, ``all_reduce`` (sum),
  ``apply_rows_``;
- heads: ``gather_rows`` of its heads, ``all_gather`` (padded to the largest
  part), joined in head order, ``apply_rows_``;
- wkv outputs: ``kv_columns`` of the outputs it holds, ``all_gather``
  (padded), joined, ``gate_from_kv_``;
- both: row ranges + ``all_reduce``, then ``kv_columns`` + ``all_gather``,
  ``gate_from_kv_``;

and every rank's highway must equal one unsharded ``apply`` bit for bit.
The row and wkv shards are shard-only contexts (the loader's
``shard_table`` / ``shard_wkv``: each rank reads only its part of wkv).
Each rank also records the bytes it hands to the collectives and the bytes
its context holds (:class:`Traffic`); with ``ENGRAM_SHARD_FIGURES=path``
they are written there as JSON (docs/sharding.md's measured table).
The CPU backend (test_distributed_cuda.py runs the layouts on the CUDA
backend's emulation).
Skipped when torch is not importable.
"""

import json
import os
import socket

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
mp = pytest.importorskip("torch.multiprocessing")

import engram  # noqa: E402

from conftest import EPS, TINY_GGUF, values  # noqa: E402

TOKENS = [5, 17, engram.TOKEN_DEAD, 9, 33, 2, 41, 8]
SEQS = [0, 0, 0, 0, 1, 1, 1, 1]
POS = [0, 1, 2, 3, 0, 1, 2, 3]
LAYOUTS = ("rows", "heads", "wkv", "both")


def part(total, rank, world):
    return total * rank // world, total * (rank + 1) // world


class Traffic:
    """The collectives a rank calls, counting the bytes it hands to each:
    ``passed`` (the buffer given, padding included) and ``own`` (the values
    that are this rank's part: all of an all-reduce's buffer, the unpadded
    part of an all-gather's)."""

    def __init__(self):
        self.passed = 0
        self.own = 0

    def all_reduce(self, t):
        self.passed += t.numel() * t.element_size()
        self.own += t.numel() * t.element_size()
        dist.all_reduce(t, op=dist.ReduceOp.SUM)

    def all_gather(self, out, t, own=None):
        self.passed += t.numel() * t.element_size()
        self.own += (t.numel() if own is None else own) * t.element_size()
        dist.all_gather(out, t)


def gather_padded(t, world, size, traffic):
    """all_gather of tensors whose first axis may differ (padded to ``size``)."""
    pad = torch.zeros((size,) + tuple(t.shape[1:]), dtype=t.dtype)
    pad[: t.shape[0]] = t
    out = [torch.empty_like(pad) for _ in range(world)]
    traffic.all_gather(out, pad, own=t.numel())
    return out


def held_bytes(ctx, layers):
    """What a rank's context holds: its table and wkv bytes over every
    layer, and the bytes its loader owns."""
    table = sum(ctx.shard_bytes(lay.layer_id)[0] for lay in layers)
    wkv = sum(ctx.shard_bytes(lay.layer_id)[1] for lay in layers)
    return {"table": table, "wkv": wkv, "loaded": ctx.memory()[0]}


def kv_gathered(h, lid, rows, ctx, inf, world, traffic):
    """This rank's ``kv`` outputs of the assembled rows, all-gathered and
    joined in output order."""
    _, (o0, o1) = ctx.shard_held(lid)
    kv = torch.ops.engram.kv_columns(h, lid, rows, o0, o1)
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(world)]
    traffic.all_gather(sizes, torch.tensor([o1 - o0], dtype=torch.int64))
    parts = gather_padded(kv.t().contiguous(), world, max(int(x) for x in sizes), traffic)
    return torch.cat([parts[r][: int(sizes[r])] for r in range(world)], dim=0).t().contiguous()


def run_layout(rank, world, ref, layout):
    """One layout on this rank: the number of layers whose highway differs,
    the bytes handed to collectives and the bytes held."""
    from engram import torch_ops

    table = (rank, world) if layout in ("rows", "both") else (0, 1)
    wkv = (rank, world) if layout in ("wkv", "both") else (0, 1)
    ctx = engram.Context.from_gguf(TINY_GGUF, eps=EPS, shard_table=table, shard_wkv=wkv)
    traffic = Traffic()
    h = torch_ops.register(ctx)
    inf = ctx.info()
    n = len(TOKENS)
    ids = torch.ops.engram.hash(h, torch.tensor(TOKENS, dtype=torch.int32),
                                torch.tensor(SEQS, dtype=torch.int32), torch.tensor(POS, dtype=torch.int32))
    bad = 0
    for layer in inf.layers:
        lid = layer.layer_id
        x = torch.from_numpy(ref["x"].copy())
        if layout in ("rows", "both"):
            (r0, r1), _ = ctx.shard_held(lid)
            rows = torch.ops.engram.gather_rows(h, lid, ids, r0, r1, 0, inf.n_heads)
            traffic.all_reduce(rows)
            if layout == "rows":
                torch.ops.engram.apply_rows_(h, lid, ids, rows.reshape(n, -1), x)
            else:
                kv_all = kv_gathered(h, lid, rows.reshape(n, -1), ctx, inf, world, traffic)
                torch.ops.engram.gate_from_kv_(h, lid, ids, kv_all, x)
        elif layout == "heads":
            nh = inf.n_heads
            h0, h1 = part(nh, rank, world)
            mine = torch.ops.engram.gather_rows(h, lid, ids, 0, layer.table_rows, h0, h1) if h0 < h1 else \
                torch.zeros((n, inf.max_ngram - 1, 0, inf.head_dim))
            parts = gather_padded(mine.permute(2, 0, 1, 3).contiguous(), world, -(-nh // world), traffic)
            heads = [parts[r][: part(nh, r, world)[1] - part(nh, r, world)[0]] for r in range(world)]
            rows = torch.cat(heads, dim=0).permute(1, 2, 0, 3).contiguous()
            torch.ops.engram.apply_rows_(h, lid, ids, rows.reshape(n, -1), x)
        else:
            full = torch.from_numpy(ref[f"rows{lid}"])
            kv_all = kv_gathered(h, lid, full, ctx, inf, world, traffic)
            torch.ops.engram.gate_from_kv_(h, lid, ids, kv_all, x)
        if not np.array_equal(x.numpy().view(np.uint32), ref[f"hw{lid}"].view(np.uint32)):
            bad += 1
    held = held_bytes(ctx, inf.layers)
    torch_ops.unregister(h)
    ctx.close()
    return bad, {"passed": traffic.passed, "own": traffic.own, **held}


def run_rank(rank, world, port, ref_path, result_path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ref = np.load(ref_path)
        runs = {layout: run_layout(rank, world, ref, layout) for layout in LAYOUTS}
        with open(f"{result_path}.{rank}", "w") as f:
            json.dump({layout: {"bad": b, **m} for layout, (b, m) in runs.items()}, f)
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("dist") / "ref.npz"
    with engram.Context.from_gguf(TINY_GGUF, eps=EPS) as ctx:
        inf = ctx.info()
        n = len(TOKENS)
        ids = ctx.hash(TOKENS, SEQS, POS)
        x = values("dist.highway", n * inf.hc * inf.hidden_size, 1.0, 0.0).reshape(n, inf.hc, inf.hidden_size)
        arrays = {"x": x}
        for layer in inf.layers:
            arrays[f"hw{layer.layer_id}"] = ctx.apply(layer.layer_id, ids, x.copy())
            arrays[f"rows{layer.layer_id}"] = ctx.gather_rows(layer.layer_id, ids).reshape(n, -1)
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_sharded_across_processes_equals_the_whole_layer(reference, tmp_path, world):
    result = str(tmp_path / "result")
    mp.start_processes(run_rank, args=(world, free_port(), reference, result), nprocs=world, join=True,
                       start_method="fork")
    ranks = []
    for r in range(world):
        with open(f"{result}.{r}") as f:
            ranks.append(json.load(f))
        bad = {layout: m["bad"] for layout, m in ranks[r].items()}
        assert bad == {layout: 0 for layout in LAYOUTS}, f"world {world}, rank {r}: layers that differ: {bad}"
    record_figures(world, ranks)


def record_figures(world, ranks):
    """Each layout's parts tile what the whole layer holds; with
    ``ENGRAM_SHARD_FIGURES`` set, the measured bytes go to that JSON file
    (one key per world)."""
    with engram.Context.from_gguf(TINY_GGUF, eps=EPS) as whole:
        want = held_bytes(whole, whole.info().layers)
    for layout, table_split, wkv_split in (("rows", 1, 0), ("wkv", 0, 1), ("both", 1, 1), ("heads", 0, 0)):
        for what, split in (("table", table_split), ("wkv", wkv_split)):
            got = [m[layout][what] for m in ranks]
            assert (sum(got) if split else max(got)) == want[what], (layout, what, got, want)
    path = os.environ.get("ENGRAM_SHARD_FIGURES")
    if path:
        figures = json.load(open(path)) if os.path.exists(path) else {}
        figures[str(world)] = {"tokens": len(TOKENS), "layers": 2, "whole": want, "ranks": ranks}
        with open(path, "w") as f:
            json.dump(figures, f, indent=1)
