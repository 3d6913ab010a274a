"""The torch ops (engram.torch_ops) against the numpy API bit for bit, on
CPU tensors used in place; torch.compile traces them through their fake
implementations (fullgraph, the aot_eager backend). Skipped when torch is
not importable (python/test.sh runs them in a venv that has it).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import engram  # noqa: E402
from engram import torch_ops  # noqa: E402

from conftest import EPS, TINY_GGUF, values  # noqa: E402

TOKENS = [5, 17, engram.TOKEN_DEAD, 9, 33, 2, 41]
SEQS = [0, 0, 0, 0, 1, 1, 1]
POS = [0, 1, 2, 3, 0, 1, 2]


@pytest.fixture
def pair():
    """Two contexts with the same history: one for numpy, one for torch."""
    a = engram.Context.from_gguf(TINY_GGUF, eps=EPS)
    b = engram.Context.from_gguf(TINY_GGUF, eps=EPS)
    h = torch_ops.register(b)
    yield a, b, h
    torch_ops.unregister(h)
    a.close()
    b.close()


def t32(x):
    return torch.tensor(x, dtype=torch.int32)


def highway(inf, n):
    return values("torch.highway", n * inf.hc * inf.hidden_size, 1.0, 0.0).reshape(n, inf.hc, inf.hidden_size)


def test_hash_and_apply_equal_the_numpy_calls_in_place(pair):
    a, b, h = pair
    inf = a.info()
    ids_np = a.hash(TOKENS, SEQS, POS)
    ids = torch.ops.engram.hash(h, t32(TOKENS), t32(SEQS), t32(POS))
    assert ids.dtype == torch.int64 and np.array_equal(ids.numpy(), ids_np)
    x = highway(inf, len(TOKENS))
    for dt in (torch.float32, torch.bfloat16):
        hw_t = torch.from_numpy(x.copy()).to(dt).contiguous()
        ref = hw_t.clone()
        ptr = hw_t.data_ptr()
        for layer in inf.layers:
            ref_np = ref.view(torch.int16).numpy().view(np.uint16) if dt == torch.bfloat16 else ref.numpy()
            a.apply(layer.layer_id, ids_np, ref_np)
            torch.ops.engram.apply_(h, layer.layer_id, ids, hw_t)
        assert hw_t.data_ptr() == ptr
        assert torch.equal(hw_t.view(torch.int16), ref.view(torch.int16)), dt


def test_split_ops_equal_the_numpy_calls(pair):
    a, b, h = pair
    inf = a.info()
    ids_np = a.hash(TOKENS, SEQS, POS)
    ids = torch.ops.engram.hash(h, t32(TOKENS), t32(SEQS), t32(POS))
    n, k_out = len(TOKENS), inf.hidden_size * (inf.hc + 1)
    for layer in inf.layers:
        lid, rows_n = layer.layer_id, layer.table_rows
        g_np = a.gather_rows(lid, ids_np, rows=(0, rows_n // 2), heads=(0, inf.n_heads))
        g = torch.ops.engram.gather_rows(h, lid, ids, 0, rows_n // 2, 0, inf.n_heads)
        assert np.array_equal(g.numpy().view(np.uint32), g_np.view(np.uint32))
        full = torch.ops.engram.gather_rows(h, lid, ids, 0, rows_n, 0, inf.n_heads).reshape(n, -1).contiguous()
        kv = torch.ops.engram.kv_columns(h, lid, full, 0, k_out)
        assert np.array_equal(kv.numpy(), a.kv_columns(lid, full.numpy(), outs=(0, k_out)))
        x = torch.from_numpy(highway(inf, n))
        y, z = x.clone(), x.clone()
        a.apply(lid, ids_np, x.numpy())
        torch.ops.engram.apply_rows_(h, lid, ids, full, y)
        torch.ops.engram.gate_from_kv_(h, lid, ids, kv, z)
        assert torch.equal(y.view(torch.int32), x.view(torch.int32))
        assert torch.equal(z.view(torch.int32), x.view(torch.int32))


def test_ops_trace_with_torch_compile(pair):
    a, b, h = pair
    inf = a.info()
    lid, rows_n = inf.layers[0].layer_id, inf.layers[0].table_rows

    def step(tokens, seqs, pos, hw):
        ids = torch.ops.engram.hash(h, tokens, seqs, pos)
        rows = torch.ops.engram.gather_rows(h, lid, ids, 0, rows_n, 0, inf.n_heads)
        torch.ops.engram.apply_rows_(h, lid, ids, rows.reshape(rows.shape[0], -1), hw)
        return hw

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    x = torch.from_numpy(highway(inf, len(TOKENS)))
    got = compiled(t32(TOKENS), t32(SEQS), t32(POS), x.clone())
    ids_np = a.hash(TOKENS, SEQS, POS)
    ref = x.clone()
    a.apply(lid, ids_np, ref.numpy())
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


def test_opcheck_of_the_in_place_ops(pair):
    a, b, h = pair
    inf = a.info()
    ids = torch.ops.engram.hash(h, t32(TOKENS), t32(SEQS), t32(POS))
    lid = inf.layers[0].layer_id
    x = torch.from_numpy(highway(inf, len(TOKENS)))
    torch.library.opcheck(torch.ops.engram.apply_.default, (h, lid, ids, x.clone()))
    rows = torch.ops.engram.gather_rows(h, lid, ids, 0, inf.layers[0].table_rows, 0, inf.n_heads)
    torch.library.opcheck(torch.ops.engram.gather_rows.default, (h, lid, ids, 0, inf.layers[0].table_rows, 0,
                                                                  inf.n_heads))
    torch.library.opcheck(torch.ops.engram.apply_rows_.default, (h, lid, ids, rows.reshape(len(TOKENS), -1),
                                                                  x.clone()))


def test_bad_tensors_raise(pair):
    a, b, h = pair
    inf = a.info()
    ids = torch.ops.engram.hash(h, t32(TOKENS), t32(SEQS), t32(POS))
    lid = inf.layers[0].layer_id
    x = torch.from_numpy(highway(inf, len(TOKENS)))
    with pytest.raises(TypeError):
        torch.ops.engram.apply_(h, lid, ids, x.double())
    with pytest.raises(ValueError):
        torch.ops.engram.apply_(h, lid, ids, x.transpose(1, 2))
    with pytest.raises(ValueError):
        torch.ops.engram.apply_(h, lid, ids, x[:3])
    with pytest.raises(TypeError):
        torch.ops.engram.hash(h, t32(TOKENS).long(), t32(SEQS), t32(POS))
    with pytest.raises(ValueError):
        torch.ops.engram.apply_(h + 1, lid, ids, x)
    with pytest.raises(engram.EngramError) as ei:
        torch.ops.engram.apply_(h, 999, ids, x)
    assert ei.value.status == engram.Status.ERR_UNKNOWN_LAYER
    with pytest.raises(engram.EngramError):
        torch.ops.engram.gather_rows(h, lid, ids, 5, 5, 0, inf.n_heads)
