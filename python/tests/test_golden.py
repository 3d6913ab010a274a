"""The golden (tests/golden/data/tiny.json) through the Python package:
tiny.gguf loaded with engram.Context.from_gguf, every regime and call.

- hash row ids: exactly the golden's;
- read_back rows: exactly the golden's (bf16 bits) for live tokens, zero for dead ones;
- read_back kv: equal, or within the Rust golden's bound
  (K+2) * 2^-24 * sum|row * w| + 1 bf16 ulp (tests/common/bounds.rs, kv_bound);
- apply, f32 and bf16 highways: within the C golden test's bounds
  (c_tests/test_golden.c: f32 2^-6 * (1 + |ref|), bf16 2 ulps + 2^-6),
  dead tokens bit-identical to their input;
- a context with one thread and one with two, and an apply after a
  prefetch, give the same bits.
"""

import numpy as np
import pytest

import engram

from conftest import EPS, TINY_GGUF, bf16, bf16_to_f32, bits, values

REGIMES = ["prefill", "decode", "chunked", "interleaved", "rollback", "dead"]


def ulp_bf16(x):
    x = np.maximum(np.abs(x), np.finfo(np.float32).tiny)
    return np.exp2(np.floor(np.log2(x)) - 7)


def wkv_f32(m, li, lid):
    """The tiny model's wkv for layer index li (bf16-rounded for bf16 layers), f64."""
    k_in = m["C"] * m["Hd"]
    k_out = m["D"] * (m["hc"] + 1)
    w = values(f"layers.{lid}.engram.wkv", k_out * k_in, 2.0**-4, 0.0)
    if m["wkv_dtype"][li] == "bf16":
        w = bf16_to_f32(bf16(w))
    return w.astype(np.float64).reshape(k_out, k_in)


@pytest.mark.parametrize("regime", REGIMES)
def test_golden_regime(golden, regime):
    m = golden["model"]
    d, hc, hd, cols = m["D"], m["hc"], m["Hd"], m["C"]
    k_in, k_out = cols * hd, d * (hc + 1)
    wkvs = {lid: wkv_f32(m, li, lid) for li, lid in enumerate(m["layer_ids"])}
    worst = 0.0
    with engram.Context.from_gguf(TINY_GGUF, eps=EPS, n_threads=2) as ctx, \
            engram.Context.from_gguf(TINY_GGUF, eps=EPS, n_threads=1) as one:
        assert ctx.row_ids_per_token == len(m["layer_ids"]) * cols
        for ci, c in enumerate(golden["regimes"][regime]["calls"]):
            at = f"{regime} call {ci}"
            n = len(c["tokens"])
            ids = ctx.hash(c["tokens"], c["seq_ids"], c["pos"])
            assert ids.shape == (n, len(m["layer_ids"]), cols)
            assert ids.reshape(-1).tolist() == c["ids"], f"{at}: hash ids"
            assert np.array_equal(one.hash(c["tokens"], c["seq_ids"], c["pos"]), ids), at
            dead = np.array(c["dead"], dtype=bool)
            x = values(c["highway_name"], n * hc * d, 1.0, 0.0).reshape(n, hc, d)
            for lg in c["layers"]:
                lid = lg["layer_id"]
                atl = f"{at} layer {lid}"
                rows, kv = ctx.read_back(lid, ids)
                want_rows = np.array(lg["rows_bf16"], dtype=np.uint16).reshape(n, k_in)
                assert np.array_equal(rows[~dead], want_rows[~dead]), f"{atl}: rows"
                assert not rows[dead].any() and not kv[dead].any(), f"{atl}: dead token's read-back"
                want_kv = np.array(lg["kv_bf16"], dtype=np.uint16).reshape(n, k_out)
                got_f, want_f = bf16_to_f32(kv).astype(np.float64), bf16_to_f32(want_kv).astype(np.float64)
                r = bf16_to_f32(rows).astype(np.float64)
                s_abs = np.abs(r) @ np.abs(wkvs[lid]).T
                bound = (k_in + 2) * 2.0**-24 * s_abs + ulp_bf16(np.maximum(np.abs(got_f), np.abs(want_f)))
                bad = np.abs(got_f - want_f) > bound
                assert not bad[~dead].any(), f"{atl}: kv outside its bound at {np.argwhere(bad & ~dead[:, None])[:3]}"

                # f32 highway, in place.
                h32 = x.copy()
                out = ctx.apply(lid, ids, h32)
                assert out is h32
                ref = np.array(lg["highway_out_f32"], dtype=np.uint32).view(np.float32).reshape(n, hc, d)
                assert np.array_equal(h32[dead].view(np.uint32), x[dead].view(np.uint32)), f"{atl}: dead token changed"
                err = np.abs(h32.astype(np.float64) - ref)
                b32 = 2.0**-6 * (1 + np.abs(ref.astype(np.float64)))
                assert (err[~dead] <= b32[~dead]).all(), f"{atl}: f32 highway outside 2^-6 (1 + |ref|)"
                worst = max(worst, float((err / b32).max()))

                # bf16 highway (uint16 bits), in place.
                xb = bf16(x).reshape(n, hc, d)
                hb = xb.copy()
                ctx.apply(lid, ids, hb)
                refb = bf16_to_f32(np.array(lg["highway_out_bf16"], dtype=np.uint16)).reshape(n, hc, d)
                assert np.array_equal(hb[dead], xb[dead]), f"{atl}: dead token changed (bf16)"
                errb = np.abs(bf16_to_f32(hb).astype(np.float64) - refb)
                bb = 2 * ulp_bf16(refb.astype(np.float64)) + 2.0**-6
                assert (errb[~dead] <= bb[~dead]).all(), f"{atl}: bf16 highway outside 2 ulps + 2^-6"

                # The same bits with one thread, and after a prefetch.
                h1 = x.copy()
                one.apply(lid, ids, h1)
                assert np.array_equal(h1.view(np.uint32), h32.view(np.uint32)), f"{atl}: 1 vs 2 threads"
                hp = x.copy()
                ctx.prefetch(lid, ids)
                ctx.apply(lid, ids, hp)
                assert np.array_equal(hp.view(np.uint32), h32.view(np.uint32)), f"{atl}: prefetched apply"
    print(f"{regime}: worst f32 highway error {worst:.3g} of its bound")


def test_rollback_then_rehash_equals_the_straight_run(golden):
    r = golden["regimes"]["rollback"]
    with engram.Context.from_gguf(TINY_GGUF, eps=EPS) as ctx:
        toks = r["straight_tokens"]
        n = len(toks)
        ids = ctx.hash(toks, [0] * n, list(range(n)))
        assert ids.reshape(-1).tolist() == r["straight_ids"]


def tiny_weights(m):
    """The tiny model's layers rebuilt from the filler (tests/golden/README.md,
    "The tiny model"): {layer_id: set_layer keyword arguments}."""
    d, hc, hd, cols = m["D"], m["hc"], m["Hd"], m["C"]
    k_in, k_out = cols * hd, d * (hc + 1)
    T = engram.Type
    out = {}
    for li, lid in enumerate(m["layer_ids"]):
        name, rows = f"layers.{lid}.engram.table", m["rows"][li]
        if m["table_format"][li] == "fp8":
            codes = (bits(name, rows * hd) & np.uint64(0xBF)).astype(np.uint8).reshape(rows, hd)
            scales = (np.uint64(125) + bits(name + ".scale", rows * hd // 32) % np.uint64(5)).astype(np.uint8)
            table, table_type = np.ascontiguousarray(np.hstack([codes, scales.reshape(rows, hd // 32)])), T.FP8_E4M3_E8M0
        else:
            assert m["table_format"][li] == "bf16"
            table, table_type = bf16(values(name, rows * hd, 1.0, 0.0)).reshape(rows, hd), T.BF16
        wkv = values(f"layers.{lid}.engram.wkv", k_out * k_in, 2.0**-4, 0.0).reshape(k_out, k_in)
        q = values(f"layers.{lid}.engram.q", hc * d, 2.0**-3, 1.0).reshape(hc, d)
        k = values(f"layers.{lid}.engram.k", hc * d, 2.0**-3, 1.0).reshape(hc, d)
        if m["wkv_dtype"][li] == "bf16":
            wkv, wkv_type = bf16(wkv).reshape(k_out, k_in), T.BF16
        else:
            wkv_type = T.F32
        if m["qk_dtype"][li] == "bf16":
            q, k, qk_type = bf16(q).reshape(hc, d), bf16(k).reshape(hc, d), T.BF16
        else:
            qk_type = T.F32
        out[lid] = dict(table=table, table_type=table_type, wkv=wkv, wkv_type=wkv_type, q=q, k=k, qk_type=qk_type)
    return out


def test_create_and_set_layer_equal_the_gguf_context_bit_for_bit(golden):
    """The built-in config path (Context.create + set_layer with the filler's
    weights, fp8 and bf16 tables, bf16 and f32 wkv) against the GGUF context
    of the same model: the same ids, rows, kv and highways, bit for bit."""
    m = golden["model"]
    d, hc = m["D"], m["hc"]
    ctx = engram.Context.create(
        hidden_size=d, hc=hc, head_dim=m["Hd"], n_heads=m["H"], max_ngram=m["N"],
        layer_ids=m["layer_ids"], token_map=m["token_map"], pad_id=m["pad_id"],
        multipliers=np.array(m["multipliers"], dtype=np.uint64), primes=m["primes"],
        offsets=m["offsets"], eps=EPS, n_threads=2, max_tokens=64, max_seqs=8, max_positions=4096,
    )
    with ctx, engram.Context.from_gguf(TINY_GGUF, eps=EPS) as g:
        for lid, w in tiny_weights(m).items():
            ctx.set_layer(lid, **w)
        info = ctx.info()
        assert [l.table_type for l in info.layers] == [engram.Type.FP8_E4M3_E8M0, engram.Type.BF16]
        assert [l.table_rows for l in info.layers] == m["rows"]
        for regime in REGIMES:
            for seq in range(8):
                ctx.seq_rm(seq)
                g.seq_rm(seq)
            for c in golden["regimes"][regime]["calls"]:
                n = len(c["tokens"])
                ids = ctx.hash(c["tokens"], c["seq_ids"], c["pos"])
                assert np.array_equal(ids, g.hash(c["tokens"], c["seq_ids"], c["pos"]))
                x = values(c["highway_name"], n * hc * d, 1.0, 0.0).reshape(n, hc, d)
                for lid in m["layer_ids"]:
                    for a, b in zip(ctx.read_back(lid, ids), g.read_back(lid, ids)):
                        assert np.array_equal(a, b), f"{regime} layer {lid}: read-back"
                    for h0 in (x, bf16(x).reshape(n, hc, d)):
                        ha, hb = h0.copy(), h0.copy()
                        ctx.apply(lid, ids, ha)
                        g.apply(lid, ids, hb)
                        assert ha.tobytes() == hb.tobytes(), f"{regime} layer {lid}: highway ({h0.dtype})"
