#!/usr/bin/env python3
"""GGUF fixtures of the golden's tiny model, written by the `gguf` package
(gguf-py, PyPI), so that the library's GGUF reader is checked against an
independent writer.

Writes, under data/ next to this file:
  tiny.gguf            the tiny model (README "The tiny model") with every
                       deepseek41.engram.* hash constant in the SPEC's widths
                       (u64 multipliers/primes/offsets, i32 token map, u32 pad);
                       tables in bf16 holding exactly the golden's dequantised
                       rows (layer 1's fp8 values are bf16-exact), wkv/q/k in the
                       golden's dtypes: the library must reproduce the golden.
                       Two unrelated tensors (f32 and q4_1) stand in for the rest
                       of a model file.
  tiny_u32.gguf        the same hash constants in the other widths seen in the
                       wild: u32 layer ids and primes, i64 multipliers, u32 token
                       map (-1 as 0xFFFFFFFF), no offsets (prefix sums), pad id
                       as i32; layer 3's table as q8_0, wkv bf16 in both layers.
  tiny_noconst.gguf    tiny_u32.gguf's tensors without the five hash constants
                       (as published files have shipped), to be completed from
  tiny_config.json     a V4.1-style config.json for the tiny hash (engram vocab
                       100, layers [1, 3], N = 3, H = 2, pad token 2) and the
                       DeepSeek tokenizer (data/deepseek_v4_tokenizer.json);
  gguf_expected.json   for tiny_noconst + tiny_config + the tokenizer: the
                       derived constants and the hash ids of two real texts,
                       computed with gen.py's reference hasher.

Deterministic: two runs write the same bytes.
"""

import json
import os
import sys

import ml_dtypes
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
sys.path.insert(0, HERE)

import gen  # noqa: E402

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import GGUFValueType as VT  # noqa: E402

ARCH = "deepseek41"
K = f"{ARCH}.engram."


def bf16_u16(a):
    a = np.asarray(a, dtype=np.float32)
    b = a.astype(ml_dtypes.bfloat16)
    assert np.array_equal(b.astype(np.float32), a), "value is not bf16-exact"
    return b.view(np.uint16)


def tiny_tensors(variant):
    """[(name, array, raw_dtype)] for the tiny model's engram layers."""
    m = gen.build_tiny()
    out = []
    for layer in m["layers"]:
        lid = layer["lid"]
        p = f"blk.{lid}."
        table = layer["table"]  # [rows, Hd] f32, bf16-exact
        if variant != "main" and lid == 3:
            q8 = gguf.quantize(table.astype(np.float32), QT.Q8_0)
            out.append((p + "engram_embd", q8, QT.Q8_0))
        else:
            out.append((p + "engram_embd", bf16_u16(table), QT.BF16))
        wkv = layer["wkv"]  # [D*(hc+1), C*Hd] f32
        if variant == "main" and gen.WKV_DTYPE[lid] == "f32":
            out.append((p + "engram_wkv", wkv.astype(np.float32), QT.F32))
        else:
            out.append((p + "engram_wkv", bf16_u16(gen.bf16_round(wkv)), QT.BF16))
        q = gen.value_array(f"layers.{lid}.engram.q", gen.HC * gen.D, 2.0**-3, 1.0).reshape(gen.HC, gen.D)
        k = gen.value_array(f"layers.{lid}.engram.k", gen.HC * gen.D, 2.0**-3, 1.0).reshape(gen.HC, gen.D)
        if gen.QK_DTYPE[lid] == "bf16":
            out.append((p + "engram_q", bf16_u16(gen.bf16_round(q)), QT.BF16))
            out.append((p + "engram_k", bf16_u16(gen.bf16_round(k)), QT.BF16))
        else:
            out.append((p + "engram_q", q.astype(np.float32), QT.F32))
            out.append((p + "engram_k", k.astype(np.float32), QT.F32))
    # Unrelated tensors of a model file: the reader must size and skip them.
    out.insert(0, ("token_embd.weight", gen.value_array("gguf.token_embd", 48 * 32, 1.0, 0.0).reshape(48, 32), QT.F32))
    q41 = gguf.quantize(gen.value_array("gguf.output", 2 * 64, 1.0, 0.0).reshape(2, 64), QT.Q4_1)
    out.append(("output.weight", q41, QT.Q4_1))
    return out


def write(path, kvs, tensors):
    w = gguf.GGUFWriter(path, arch=ARCH, use_temp_file=False)
    w.add_name("engram tiny golden model")
    for key, val, vt, sub in kvs:
        w.add_key_value(key, val, vt, sub_type=sub)
    for name, arr, dt in tensors:
        w.add_tensor(name, arr, raw_dtype=dt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def geometry_kvs(layer_ids_type):
    return [
        (K + "layer_ids", list(gen.LAYER_IDS), VT.ARRAY, layer_ids_type),
        (K + "head_count", gen.H, VT.UINT32, None),
        (K + "key_length", gen.HD, VT.UINT32, None),
        (K + "max_ngram_size", gen.N, VT.UINT32, None),
    ]


def main():
    m = gen.build_tiny()
    mult = gen.flat(m["mult"])
    primes = gen.flat(m["primes"])
    offs = gen.flat(m["offsets"])
    tmap = m["token_map"]

    kv_main = geometry_kvs(VT.INT32) + [
        (K + "multipliers", mult, VT.ARRAY, VT.UINT64),
        (K + "primes", primes, VT.ARRAY, VT.UINT64),
        (K + "offsets", offs, VT.ARRAY, VT.UINT64),
        (K + "token_map", tmap, VT.ARRAY, VT.INT32),
        (K + "pad_id", m["pad_id"], VT.UINT32, None),
    ]
    write(os.path.join(DATA, "tiny.gguf"), kv_main, tiny_tensors("main"))

    kv_u32 = geometry_kvs(VT.UINT32) + [
        (K + "multipliers", [gen.to_i64(x) for x in mult], VT.ARRAY, VT.INT64),
        (K + "primes", primes, VT.ARRAY, VT.UINT32),
        (K + "token_map", [t & 0xFFFFFFFF for t in tmap], VT.ARRAY, VT.UINT32),
        (K + "pad_id", m["pad_id"], VT.INT32, None),
    ]
    write(os.path.join(DATA, "tiny_u32.gguf"), kv_u32, tiny_tensors("u32"))
    write(os.path.join(DATA, "tiny_noconst.gguf"), geometry_kvs(VT.INT32), tiny_tensors("u32"))

    # The config + tokenizer that complete tiny_noconst.gguf.
    cfg = {
        "text_config": {
            "hidden_size": gen.D,
            "hc_mult": gen.HC,
            "engram_layer_ids": gen.LAYER_IDS,
            "engram_max_ngram_size": gen.N,
            "engram_n_heads": gen.H,
            "engram_vocab_size": gen.TINY_ENGRAM_VOCAB,
            "engram_head_dim": gen.HD,
            "engram_pad_token_id": 2,
            "engram_num_embeddings": m["rows"],
            "engram_compressed_vocab_size": gen.V41_COMPRESSED,
        }
    }
    gen.write(os.path.join(DATA, "tiny_config.json"), json.dumps(cfg, indent=2))

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(DATA, "deepseek_v4_tokenizer.json"))
    rmap, count, _ = gen.v41_token_map(tok)
    half = (2**63 - 1) // count // 2
    rmult = []
    for lid in gen.LAYER_IDS:
        r = np.random.default_rng(10007 * lid).integers(0, half, size=gen.N, dtype=np.int64)
        rmult.append([int(v) * 2 + 1 for v in r])
    pad = rmap[2]
    texts = []
    for text in ("The quick brown fox jumps over the lazy dog.", "深度求索发布了新的语言模型。"):
        ids_tok = tok.encode(text, add_special_tokens=False).ids
        hasher = gen.Hasher(rmap, pad, rmult, m["primes"], m["offsets"], gen.H, gen.N)
        n = len(ids_tok)
        hids, _ = hasher.call(ids_tok, [0] * n, list(range(n)))
        texts.append({"text": text, "tokens": ids_tok, "ids": gen.flat(hids)})
    exp = {
        "pad_id": pad,
        "multipliers": gen.flat(rmult),
        "primes": primes,
        "offsets": offs,
        "rows": m["rows"],
        "texts": texts,
    }
    gen.write(os.path.join(DATA, "gguf_expected.json"), gen.dump(exp))
    for name in ("tiny.gguf", "tiny_u32.gguf", "tiny_noconst.gguf", "tiny_config.json", "gguf_expected.json"):
        print(f"{name}: {os.path.getsize(os.path.join(DATA, name))} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
