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

from conftest import EPS, TINY_GGUF, bf16, bf16_to_f32, values

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
