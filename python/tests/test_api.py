"""The package's API over tiny.gguf: every error path as an EngramError with
its status and the library's message, the Python-side checks (raised before
any call), arrays updated in place (no copies), history, states, info."""

import ctypes
import json

import numpy as np
import pytest

import engram
from engram import EngramError, Status

from conftest import DATA, EPS, TINY_GGUF

S = Status


def raises(status, fn, *args, **kw):
    with pytest.raises(EngramError) as ei:
        fn(*args, **kw)
    e = ei.value
    assert e.status == status, f"{e!r}"
    assert isinstance(e.status, Status)
    assert e.message, "the library's message (engram_last_error) is carried"
    assert e.message in str(e) and e.status.name in str(e)
    return e


def prefill(ctx, n=6, seq=0):
    return ctx.hash(list(range(20, 20 + n)), [seq] * n, list(range(n)))


# ---- statuses --------------------------------------------------------------


def test_loader_errors(tmp_path):
    raises(S.ERR_IO, engram.Context.from_gguf, tmp_path / "missing.gguf")
    raises(S.ERR_FORMAT, engram.Context.from_gguf, DATA / "tiny.json")
    raises(S.ERR_NULL_ARGUMENT, engram.Context.from_gguf, None)
    raises(S.ERR_INVALID_CONFIG, engram.Context.from_gguf, TINY_GGUF, eps=-1.0)
    raises(S.ERR_INVALID_CONFIG, engram.Context.from_gguf, TINY_GGUF, n_threads=5000)
    raises(S.ERR_IO, engram.Context.from_safetensors, tmp_path / "no_model")
    raises(S.ERR_IO, engram.Context.from_tables, tmp_path / "c.json", tmp_path / "t.json")


def test_cuda_without_a_device_is_err_device():
    try:
        ctx = engram.Context.from_gguf(TINY_GGUF, backend="cuda")
    except EngramError as e:
        assert e.status == S.ERR_DEVICE, repr(e)
    else:
        # A numpy (host) highway is refused on a CUDA context before any call.
        with ctx:
            ids = prefill(ctx)
            with pytest.raises(ValueError):
                ctx.apply(1, ids, np.zeros((6, 4, 64), np.float32))
            rows, kv = ctx.read_back(1, ids)  # host buffers on every backend
            assert rows.any()


def test_apply_refuses_a_host_highway_on_a_cuda_context(tiny):
    """The guard itself, on this machine's CPU context marked as CUDA (the
    real CUDA context is exercised above where a device exists): raised
    before the call, the highway untouched."""
    ids = prefill(tiny)
    hw = np.zeros((6, 4, 64), np.float32)
    tiny._backend = engram.Backend.CUDA
    with pytest.raises(ValueError, match="device highway"):
        tiny.apply(1, ids, hw)
    assert not hw.any()


def test_hash_errors(tiny):
    raises(S.ERR_INVALID_TOKEN, tiny.hash, [48], [0], [0])  # vocab is 48 tokens
    raises(S.ERR_INVALID_SEQUENCE, tiny.hash, [20], [64], [0])  # max_seqs 64
    raises(S.ERR_INVALID_SEQUENCE, tiny.hash, [20], [0], [200000])
    raises(S.ERR_MISSING_HISTORY, tiny.hash, [20], [1], [5])  # look-back to 3, 4: never hashed


def test_capacity():
    with engram.Context.from_gguf(TINY_GGUF, max_tokens=4) as ctx:
        raises(S.ERR_CAPACITY, prefill, ctx, 5)


def test_apply_errors(tiny):
    ids = prefill(tiny)
    hw = np.zeros((6, 4, 64), np.float32)
    raises(S.ERR_UNKNOWN_LAYER, tiny.apply, 2, ids, hw)
    bad = ids.copy()
    bad[0, 0, 0] = 10**6
    raises(S.ERR_INVALID_ROW_ID, tiny.apply, 1, bad, hw)
    raises(S.ERR_INVALID_ROW_ID, tiny.prefetch, 1, bad)
    raises(S.ERR_INVALID_ROW_ID, tiny.read_back, 1, bad)
    raises(S.ERR_UNKNOWN_LAYER, tiny.gate_weights, 7)
    assert not hw.any(), "a refused apply leaves the highway unchanged"


def test_no_weights():
    m = json.loads((DATA / "tiny.json").read_text())["model"]
    # The built-in config path (engram_create): the tiny model's constants.
    with engram.Context.create(
        hidden_size=m["D"], hc=m["hc"], head_dim=m["Hd"], n_heads=m["H"], max_ngram=m["N"],
        layer_ids=m["layer_ids"], token_map=m["token_map"], pad_id=m["pad_id"],
        multipliers=np.array(m["multipliers"], dtype=np.uint64), primes=m["primes"],
        offsets=m["offsets"], max_tokens=64, max_seqs=4, max_positions=1024,
    ) as ctx:
        ids = prefill(ctx)
        with engram.Context.from_gguf(TINY_GGUF, eps=EPS) as g:
            assert np.array_equal(prefill(g), ids), "create() hashes as the GGUF context"
        raises(S.ERR_NO_WEIGHTS, ctx.apply, 1, ids, np.zeros((6, 4, 64), np.float32))
        # An fp8 wkv holding an e4m3 NaN code is refused, and the layer stays unset.
        codes = np.zeros((320, 256), np.uint8)
        codes[5, 7] = 0x7F
        w = dict(table=np.zeros((508, 64), np.uint16), table_type=engram.Type.BF16, wkv=codes,
                 wkv_type=engram.Type.FP8_E4M3_E8M0_BLOCK, q=np.ones((4, 64), np.float32),
                 k=np.ones((4, 64), np.float32), qk_type=engram.Type.F32,
                 wkv_scales=np.full((3, 2), 127, np.uint8), wkv_block=(128, 128))
        raises(S.ERR_INVALID_DATA, ctx.set_layer, 3, **w)
        raises(S.ERR_NO_WEIGHTS, ctx.apply, 3, ids, np.zeros((6, 4, 64), np.float32))
        codes[5, 7] = 0
        ctx.set_layer(3, **w)
        ctx.apply(3, ids, np.zeros((6, 4, 64), np.float32))
        raises(S.ERR_UNKNOWN_LAYER, ctx.set_layer, 2, **w)
        info = ctx.info()
        assert [(l.layer_id, l.table_type, l.table_rows, l.wkv_type) for l in info.layers] == [
            (1, None, 0, None), (3, engram.Type.BF16, 508, engram.Type.FP8_E4M3_E8M0_BLOCK)]
        assert [l.rows_needed for l in info.layers] == m["rows"]


def test_config_errors():
    m = json.loads((DATA / "tiny.json").read_text())["model"]
    kw = dict(hidden_size=m["D"], hc=m["hc"], head_dim=m["Hd"], n_heads=m["H"], max_ngram=m["N"],
              layer_ids=m["layer_ids"], token_map=m["token_map"], pad_id=m["pad_id"],
              multipliers=np.array(m["multipliers"], dtype=np.uint64), primes=m["primes"],
              offsets=m["offsets"])
    raises(S.ERR_INVALID_CONFIG, engram.Context.create, **dict(kw, eps=float("nan")))
    even = np.array(m["multipliers"], dtype=np.uint64) & ~np.uint64(1)
    raises(S.ERR_INVALID_CONFIG, engram.Context.create, **dict(kw, multipliers=even))
    with pytest.raises(TypeError):
        engram.Context.create(**dict(kw, no_such_field=1))


def test_history_errors(tiny):
    prefill(tiny)
    raises(S.ERR_INVALID_SEQUENCE, tiny.seq_rm, 64)
    raises(S.ERR_INVALID_SEQUENCE, tiny.seq_rm, 0, 5, 2)
    raises(S.ERR_INVALID_SEQUENCE, tiny.seq_cp, 0, 99)
    raises(S.ERR_INVALID_SEQUENCE, tiny.seq_keep, -2)
    raises(S.ERR_INVALID_SEQUENCE, tiny.seq_add, 0, 0, -1, 200000)
    raises(S.ERR_UNSUPPORTED, tiny.seq_div, 0, 0, -1, 2)
    raises(S.ERR_INVALID_ARGUMENT, tiny.seq_div, 0, 0, -1, 0)
    tiny.seq_div(0, 0, -1, 1)  # d = 1: nothing changes
    state = bytearray(tiny.seq_state(0))
    raises(S.ERR_FORMAT, tiny.seq_restore, 1, state[:-1])
    state[-1] ^= 0xFF
    raises(S.ERR_FORMAT, tiny.seq_restore, 1, state)
    raises(S.ERR_INVALID_ARGUMENT, tiny.set_threads, 5000)


# ---- Python-side checks: raised before the call ------------------------------


def test_array_checks(tiny):
    ids = prefill(tiny)
    hw = np.zeros((6, 4, 64), np.float32)
    with pytest.raises(TypeError):
        tiny.apply(1, ids, hw.astype(np.float64))
    with pytest.raises(ValueError):
        tiny.apply(1, ids, np.zeros((6, 4, 128), np.float32)[:, :, ::2])  # strided: would be a copy
    with pytest.raises(ValueError):
        tiny.apply(1, ids, np.zeros((5, 4, 64), np.float32))
    ro = np.zeros((6, 4, 64), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError):
        tiny.apply(1, ids, ro)
    with pytest.raises(TypeError):
        tiny.apply(1, ids.astype(np.int32), hw)
    with pytest.raises(TypeError):
        tiny.apply(1, ids.tolist(), hw)
    with pytest.raises(ValueError):
        tiny.apply(1, ids.reshape(-1)[:7], hw)
    with pytest.raises(TypeError):
        tiny.hash(np.array([20], dtype=np.int64), [0], [0])
    with pytest.raises(ValueError):
        tiny.hash([20, 21], [0], [0, 1])
    with pytest.raises(ValueError):
        tiny.hash([20], [0], [0], out=np.zeros(9, np.int64))
    with pytest.raises(ValueError):
        tiny.read_back(1, ids, rows=np.zeros(3, np.uint16))
    assert not hw.any()


def test_closed_context():
    ctx = engram.Context.from_gguf(TINY_GGUF)
    ctx.close()
    ctx.close()  # idempotent
    with pytest.raises(ValueError):
        ctx.hash([20], [0], [0])
    assert repr(ctx) == "<engram.Context (closed)>"
    with engram.Context.from_gguf(TINY_GGUF) as c2:
        assert repr(c2) == "<engram.Context CPU D=64 hc=4 Hd=64 C=4 n_layers=2>"
    with pytest.raises(ValueError):
        c2.info()


# ---- no copies ---------------------------------------------------------------


def test_arrays_are_updated_in_place(tiny):
    out = np.full((6, 2, 4), -7, dtype=np.int64)
    got = tiny.hash(list(range(20, 26)), [0] * 6, list(range(6)), out=out)
    assert got is out and (out >= 0).all()
    big = np.ones((6, 4, 64), np.float32)
    hw = big  # the caller's own array: updated where it lies
    addr = hw.ctypes.data
    ret = tiny.apply(1, out, hw)
    assert ret is hw and hw.ctypes.data == addr and not np.array_equal(hw, np.ones_like(hw))
    # A view into a larger buffer (C-contiguous) is updated in the buffer itself.
    buf = np.ones((2, 6, 4, 64), np.float32)
    tiny.apply(1, out, buf[1])
    assert np.array_equal(buf[1], hw) and (buf[0] == 1).all()
    # bf16 as uint16 bits, in place.
    hb = np.full((6, 4, 64), 0x3F80, np.uint16)  # 1.0
    tiny.apply(1, out, hb)
    assert (hb != 0x3F80).any()
    rows = np.zeros((6, 256), np.uint16)
    kv = np.zeros((6, 320), np.uint16)
    r, k = tiny.read_back(1, out, rows=rows, kv=kv)
    assert r is rows and k is kv and rows.any() and kv.any()


# ---- history, states, info ---------------------------------------------------


def test_history_verbs_and_states(tiny):
    toks = list(range(20, 30))
    ids0 = tiny.hash(toks, [0] * 10, list(range(10)))
    tiny.seq_cp(0, 1)
    nxt0 = tiny.hash([31], [0], [10])
    assert np.array_equal(tiny.hash([31], [1], [10]), nxt0), "seq_cp copies the history"
    state = tiny.seq_state(0)
    tiny.seq_rm(0, 8, -1)
    raises(S.ERR_MISSING_HISTORY, tiny.hash, [31], [0], [10])
    tiny.seq_restore(0, state)
    assert np.array_equal(tiny.hash([31], [0], [10]), nxt0), "state restored"
    tiny.seq_restore(2, state)  # into another sequence
    assert np.array_equal(tiny.hash([31], [2], [10]), nxt0)
    tiny.seq_keep(2)
    raises(S.ERR_MISSING_HISTORY, tiny.hash, [31], [0], [10])
    # seq_add: move positions [0, 11) of seq 2 by +5: its look-back moves too.
    tiny.seq_add(2, 0, -1, 5)
    assert np.array_equal(tiny.hash([31], [2], [15]), nxt0)
    # The straight run of seq 0 again gives the first ids.
    assert np.array_equal(tiny.hash(toks, [0] * 10, list(range(10))), ids0)


def test_info(tiny, golden):
    m = golden["model"]
    info = tiny.info()
    assert info.backend == engram.Backend.CPU
    assert (info.hidden_size, info.hc, info.head_dim, info.n_heads, info.max_ngram, info.cols) == (
        m["D"], m["hc"], m["Hd"], m["H"], m["N"], m["C"])
    assert info.n_layers == 2 and info.row_ids_per_token == tiny.row_ids_per_token == 8
    assert info.n_threads == 2 and info.token_map_len == 48 and info.pad_id == m["pad_id"]
    assert np.float32(info.eps) == np.float32(EPS)
    assert [l.layer_id for l in info.layers] == m["layer_ids"]
    assert [l.table_rows for l in info.layers] == m["rows"]
    assert info.layers[1].wkv_type == engram.Type.F32
    tiny.set_threads(1)
    assert tiny.info(layers=False).n_threads == 1 and tiny.info(layers=False).layers == []
    assert tiny.gate_weights(1).shape == (4, 64)
    tiny.check()


def test_struct_layouts_follow_the_header():
    """The generated ctypes structs against the C compiler's layout of include/engram.h."""
    import shutil
    import sys

    from conftest import ROOT

    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    sys.path.insert(0, str(ROOT / "python"))
    import _headergen
    from engram import _structs

    assert _headergen.verify_layout(str(ROOT / "include" / "engram.h"), _structs) == []
    assert ctypes.sizeof(_structs.engram_config) > 0


def test_from_tables_and_gguf_companions_give_the_expected_ids():
    """Hash tables from config.json + tokenizer.json (Context.from_tables) and
    a GGUF file without hash constants completed by the same two files
    (from_gguf's config_json/tokenizer_json) both give gguf_expected.json's ids."""
    want = json.loads((DATA / "gguf_expected.json").read_text())
    cfg, tok = DATA / "tiny_config.json", DATA / "deepseek_v4_tokenizer.json"
    with engram.Context.from_tables(cfg, tok, max_tokens=64, max_seqs=2, max_positions=1024) as t, \
            engram.Context.from_gguf(DATA / "tiny_noconst.gguf", config_json=cfg, tokenizer_json=tok) as g:
        info = t.info()
        assert (info.hidden_size, info.hc, info.head_dim) == (64, 4, 64)
        assert [l.rows_needed for l in info.layers] == want["rows"]
        assert info.table_fingerprint == g.info().table_fingerprint
        for text in want["texts"]:
            n = len(text["tokens"])
            for ctx in (t, g):
                ids = ctx.hash(text["tokens"], [0] * n, list(range(n)))
                assert ids.reshape(-1).tolist() == text["ids"], text["text"]
    raises(S.ERR_INVALID_CONFIG, engram.Context.from_gguf, DATA / "tiny_noconst.gguf")


def test_from_safetensors_checkpoint():
    """The checkpoint fixture (tests/golden/data/dialects/checkpoint): hash
    constants derived from its config.json and the tokenizer, so the first
    tokens of gguf_expected.json's text hash to its ids; tables as the
    checkpoint stores them (fp8 codes and scales in two tensors)."""
    want = json.loads((DATA / "gguf_expected.json").read_text())["texts"][0]
    tok = DATA / "deepseek_v4_tokenizer.json"
    with engram.Context.from_safetensors(DATA / "dialects" / "checkpoint", tokenizer_json=tok,
                                         max_tokens=16, max_seqs=2, max_positions=64) as ctx:
        ids = ctx.hash(want["tokens"][:4], [0] * 4, list(range(4)))
        assert ids.reshape(-1).tolist() == want["ids"][: 4 * ctx.row_ids_per_token]
        info = ctx.info()
        assert (info.max_tokens, info.max_seqs, info.max_positions) == (16, 2, 64)
        assert engram.Type.FP8_E4M3_E8M0_SPLIT in [l.table_type for l in info.layers]
        hw = np.zeros((4, 4, 64), np.float32)
        for l in info.layers:
            ctx.apply(l.layer_id, ids, hw)
        assert hw.any()
    raises(S.ERR_IO, engram.Context.from_safetensors, DATA / "dialects" / "checkpoint",
           tokenizer_json=DATA / "no_such_tokenizer.json")


def test_exact_quant_wkv_option():
    # engram_gguf_options.exact_quant_wkv through from_gguf (a field of the
    # generated struct, not a stray attribute): the tiny model's wkv is not
    # Q4_K, so both settings give the same bits.
    from engram import _structs
    assert "exact_quant_wkv" in [f[0] for f in _structs.engram_gguf_options._fields_]
    assert "exact_quant_wkv" in [f[0] for f in _structs.engram_config._fields_]
    outs = []
    for exact in (None, False, True):
        with engram.Context.from_gguf(TINY_GGUF, eps=EPS, n_threads=2, exact_quant_wkv=exact) as ctx:
            ids = prefill(ctx)
            hw = np.ones((6, 4, 64), np.float32)
            ctx.apply(1, ids, hw)
            outs.append(hw)
    assert all(np.array_equal(o, outs[0]) for o in outs)
