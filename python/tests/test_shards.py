"""The split points and shard contexts through the package (numpy), ranks
simulated in one process: tiny.gguf, every layout (table row ranges summed
in rank order, heads reassembled, wkv output ranges joined) at world sizes
1..5, each rank a shard context, against one unsharded apply bit for bit;
and the bad inputs as exceptions. The multi-process form with
torch.distributed is test_distributed.py.
"""

import numpy as np
import pytest

import engram

from conftest import EPS, TINY_GGUF, values

WORLDS = [1, 2, 3, 4, 5]


def part(total, rank, world):
    return total * rank // world, total * (rank + 1) // world


@pytest.fixture(scope="module")
def batch():
    """A step of 7 tokens over two sequences, one dead, and each layer's
    reference highway (one unsharded apply after another, as a model runs)."""
    with engram.Context.from_gguf(TINY_GGUF, eps=EPS) as ctx:
        inf = ctx.info()
        tokens = [5, 17, engram.TOKEN_DEAD, 9, 33, 2, 41]
        seqs = [0, 0, 0, 0, 1, 1, 1]
        pos = [0, 1, 2, 3, 0, 1, 2]
        ids = ctx.hash(tokens, seqs, pos)
        n = len(tokens)
        hw0 = values("shards.highway", n * inf.hc * inf.hidden_size, 1.0, 0.0).reshape(n, inf.hc, inf.hidden_size)
        ref = {}
        for layer in inf.layers:
            h = hw0.copy()
            ref[layer.layer_id] = ctx.apply(layer.layer_id, ids, h)
        rows_full = {lay.layer_id: ctx.gather_rows(lay.layer_id, ids) for lay in inf.layers}
        return inf, ids, hw0, ref, rows_full


def shard_ctx(table=(0, 1), wkv=(0, 1)):
    """A shard-only context: the loader reads only its part of wkv."""
    return engram.Context.from_gguf(TINY_GGUF, eps=EPS, shard_table=table, shard_wkv=wkv)


@pytest.mark.parametrize("world", WORLDS)
def test_shard_contexts_load_only_their_share(batch, world):
    inf = batch[0]
    with engram.Context.from_gguf(TINY_GGUF, eps=EPS) as whole:
        w_loaded, w_ctx = whole.memory()
        w_bytes = {lay.layer_id: whole.shard_bytes(lay.layer_id) for lay in inf.layers}
    rows = {lay.layer_id: lay.table_rows for lay in inf.layers}
    ctxs = [shard_ctx(table=(r, world), wkv=(r, world)) for r in range(world)]
    try:
        for lid, (w_table, w_wkv) in w_bytes.items():
            held = [c.shard_bytes(lid) for c in ctxs]
            assert sum(t for t, _ in held) == w_table
            assert sum(w for _, w in held) == w_wkv
            for r, (t, w) in enumerate(held):
                lo, hi = part(rows[lid], r, world)
                assert t == w_table // rows[lid] * (hi - lo)
        all_wkv = sum(w for _, w in w_bytes.values())
        for c in ctxs:
            loaded, ctx_bytes = c.memory()
            mine = sum(c.shard_bytes(lid)[1] for lid in w_bytes)
            # The loader read only this rank's wkv (owned arrays are 16-byte words).
            assert abs((w_loaded - loaded) - (all_wkv - mine)) <= 64, (w_loaded, loaded, all_wkv, mine)
            assert ctx_bytes == w_ctx
    finally:
        for c in ctxs:
            c.close()


def test_bad_shard_specs_at_load_raise():
    for table, wkv in [((0, 0), (0, 1)), ((1, 1), (0, 1)), ((0, 1), (2, 2))]:
        with pytest.raises(engram.EngramError) as ei:
            engram.Context.from_gguf(TINY_GGUF, eps=EPS, shard_table=table, shard_wkv=wkv)
        assert ei.value.status == engram.Status.ERR_INVALID_ARGUMENT and "shard" in ei.value.message
    with shard_ctx(wkv=(0, 2)) as c:
        with pytest.raises(engram.EngramError) as ei:
            c.set_shard(wkv=(1, 2))
        assert ei.value.status == engram.Status.ERR_INVALID_ARGUMENT


@pytest.mark.parametrize("world", WORLDS)
def test_row_ranges_sum_to_the_whole_layer(batch, world):
    inf, ids, hw0, ref, rows_full = batch
    ctxs = [shard_ctx(table=(r, world)) for r in range(world)]
    try:
        for layer in inf.layers:
            lid = layer.layer_id
            total = None
            for r, c in enumerate(ctxs):
                held, outs = c.shard_held(lid)
                assert held == part(layer.table_rows, r, world)
                assert outs == (0, inf.hidden_size * (inf.hc + 1))
                p = c.gather_rows(lid, ids)
                total = p if total is None else total + p
            assert np.array_equal(total.view(np.uint32), rows_full[lid].view(np.uint32))
            hw = hw0.copy()
            ctxs[-1].apply_rows(lid, ids, total.reshape(len(ids), -1), hw)
            assert np.array_equal(hw.view(np.uint32), ref[lid].view(np.uint32)), f"layer {lid} world {world}"
    finally:
        for c in ctxs:
            c.close()


@pytest.mark.parametrize("world", WORLDS)
def test_heads_gathered_and_joined_give_the_whole_layer(batch, world):
    inf, ids, hw0, ref, _ = batch
    nh, _ = (inf.n_heads, inf.max_ngram - 1)
    with engram.Context.from_gguf(TINY_GGUF, eps=EPS) as ctx:
        for layer in inf.layers:
            lid = layer.layer_id
            parts = [ctx.gather_rows(lid, ids, heads=part(nh, r, world), dtype=np.uint16)
                     for r in range(world) if part(nh, r, world)[0] < part(nh, r, world)[1]]
            rows = np.ascontiguousarray(np.concatenate(parts, axis=2)).reshape(len(ids), -1)
            hw = hw0.copy()
            ctx.apply_rows(lid, ids, rows, hw)
            assert np.array_equal(hw.view(np.uint32), ref[lid].view(np.uint32))


@pytest.mark.parametrize("world", WORLDS)
def test_wkv_output_ranges_joined_give_the_whole_layer(batch, world):
    inf, ids, hw0, ref, rows_full = batch
    ctxs = [shard_ctx(wkv=(r, world)) for r in range(world)]
    try:
        for layer in inf.layers:
            lid = layer.layer_id
            rows = rows_full[lid].reshape(len(ids), -1)
            kv = np.concatenate([c.kv_columns(lid, rows) for c in ctxs], axis=1)
            _, kv_ref = ctxs[0].read_back(lid, ids) if world == 1 else (None, None)
            if kv_ref is not None:
                live = ids[:, 0, 0] != engram.ROW_ID_DEAD
                assert np.array_equal((kv.view(np.uint32) >> 16)[live], kv_ref[live])
            hw = hw0.copy()
            ctxs[0].gate_from_kv(lid, ids, np.ascontiguousarray(kv), hw)
            assert np.array_equal(hw.view(np.uint32), ref[lid].view(np.uint32))
    finally:
        for c in ctxs:
            c.close()


def test_bad_inputs_raise(batch):
    inf, ids, hw0, _, rows_full = batch
    lid = inf.layers[0].layer_id
    rows_n = inf.layers[0].table_rows
    with shard_ctx(table=(1, 3), wkv=(1, 2)) as c:
        (b, e), (ob, oe) = c.shard_held(lid)
        with pytest.raises(engram.EngramError) as ei:
            c.gather_rows(lid, ids, rows=(0, rows_n))
        assert ei.value.status == engram.Status.ERR_INVALID_ARGUMENT and "holds" in ei.value.message
        with pytest.raises(engram.EngramError):
            c.gather_rows(lid, ids, rows=(b, b))
        with pytest.raises(engram.EngramError):
            c.gather_rows(lid, ids, heads=(0, inf.n_heads + 1))
        with pytest.raises(engram.EngramError) as ei:
            c.apply(lid, ids, hw0.copy())
        assert "shard" in ei.value.message
        with pytest.raises(engram.EngramError):
            c.apply_rows(lid, ids, rows_full[lid].reshape(len(ids), -1), hw0.copy())
        with pytest.raises(engram.EngramError):
            c.kv_columns(lid, rows_full[lid].reshape(len(ids), -1), outs=(0, ob))
        with pytest.raises(engram.EngramError) as ei:
            c.set_shard(table=(3, 3))
        assert ei.value.status == engram.Status.ERR_INVALID_ARGUMENT
        with pytest.raises(TypeError):
            c.gather_rows(lid, ids, dtype=np.float64)
        with pytest.raises(ValueError):
            c.gather_rows(lid, ids, out=np.empty((1, 2), np.float32))
    with engram.Context.from_gguf(TINY_GGUF, eps=EPS) as c:
        hw = hw0.copy()
        with pytest.raises(engram.EngramError):
            c.gate_from_kv(lid, ids, np.zeros((len(ids), 3), np.float32), hw)
        assert np.array_equal(hw, hw0)
