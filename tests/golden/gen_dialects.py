#!/usr/bin/env python3
"""Fixtures of the golden's tiny model in every public DeepSeek-V4.1 engram
file dialect (GGUF converters and the released safetensors checkpoint), for
the library's multi-dialect loader. See DIALECTS.md beside this file for what
each writer does and where it was read; README.md ("Dialect fixtures") for
the files.

Each writer's layout is reimplemented here from its description in
DIALECTS.md; no converter code is imported or copied. The tiny model itself
(filler, token map, multipliers, primes, tables, wkv, q, k) comes from gen.py.

Writes, under data/dialects/ next to this file:
  vcruz305_split-0000{1,2,3}-of-00003.gguf   vcruz305 spelling, split as
                                              llama.cpp's gguf-split does
  vcruz305_deepseek4_prefix.gguf              the nine engram keys under the
                                              early literal `deepseek4.` prefix
  ds4.gguf                                    antirez/ds4 (264-byte-row style)
  tarruda.gguf                                tarruda/llama.cpp
  jigsawpt.gguf                               JigSawPT/llama.cpp
  deepstrix-00001-of-00001.gguf               deepstrix (tables in HF shards)
  ds4gw_style.gguf                            shard path + byte offsets
  checkpoint/                                 the released safetensors layout
  expected.json                               what a loader must arrive at

Deterministic: two runs write the same bytes (regen.sh checks it).
"""

import hashlib
import json
import os
import shutil
import struct
import sys

import ml_dtypes
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
OUT = os.path.join(DATA, "dialects")
sys.path.insert(0, HERE)

import gen  # noqa: E402

import gguf  # noqa: E402
import safetensors.numpy as st_numpy  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import GGUFValueType as VT  # noqa: E402

D, HC, HD, H, N, C = gen.D, gen.HC, gen.HD, gen.H, gen.N, gen.C
LIDS = list(gen.LAYER_IDS)
L = len(LIDS)
E4M3_MAX = 448.0

# The checkpoint fixture's directory name and the absolute directory the
# "tables elsewhere" writers record (they store the converting machine's
# absolute path; a loader keeps the file name and rebases the directory).
CKPT_DIR = "checkpoint"
RECORDED_MODEL_DIR = "/models/DeepSeek-V4.1-tiny"
CKPT_SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
TABLE_SHARD = CKPT_SHARDS[1]  # both engram tables live in the last shard, as released
# The dialects that store the pad as a raw token id get token 7, not the golden's 2:
# token_map[7] == token_map[2] == pad_id, so the hash is the golden's, but a loader
# that forgets to map the raw id through the token map hashes with 7 and fails.
RAW_PAD_ALIAS = 7

# ---------------------------------------------------------------------------
# Number formats.
# ---------------------------------------------------------------------------


def bf16_u16(a):
    a = np.asarray(a, dtype=np.float32)
    b = a.astype(ml_dtypes.bfloat16)
    assert np.array_equal(b.astype(np.float32), a), "value is not bf16-exact"
    return b.view(np.uint16)


def f16_exact(a):
    a = np.asarray(a, dtype=np.float32)
    h = a.astype(np.float16)
    assert np.array_equal(h.astype(np.float32), a), "value is not f16-exact"
    return h


def dequant_e4m3(codes, scale_codes, block_rows, block_cols):
    """codes u8 [r, c]; scale_codes u8 [r/block_rows, c/block_cols] -> f32."""
    vals = gen.E4M3[codes]
    sc = np.ldexp(np.float32(1.0), scale_codes.astype(np.int64) - 127).astype(np.float32)
    sc = np.repeat(np.repeat(sc, block_rows, axis=0), block_cols, axis=1)
    return (vals * sc).astype(np.float32)


def quant_e4m3(x, block_rows, block_cols):
    """The checkpoint's fp8 rule (scale = 2^ceil(log2(amax/448)), amax floored
    at 1e-4, one e8m0 scale per block; codes e4m3 round-to-nearest-even).
    Returns (codes u8, scale codes u8, dequantised f32)."""
    r, c = x.shape
    b = x.reshape(r // block_rows, block_rows, c // block_cols, block_cols).astype(np.float64)
    amax = np.maximum(np.abs(b).max(axis=(1, 3)), 1e-4)
    e = np.ceil(np.log2(amax / E4M3_MAX)).astype(np.int64)
    assert (e + 127 > 0).all() and (e + 127 < 255).all()
    scaled = (b / np.ldexp(1.0, e)[:, None, :, None]).astype(np.float32)
    assert np.abs(scaled).max() <= E4M3_MAX
    codes = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(r, c)
    scodes = (e + 127).astype(np.uint8)
    deq = dequant_e4m3(codes, scodes, block_rows, block_cols)
    return codes, scodes, deq


# ---------------------------------------------------------------------------
# The models: the golden (gen.py) and the checkpoint form of it.
# ---------------------------------------------------------------------------


def golden_model():
    """Per layer: storage forms and effective (dequantised) values of gen.py's tiny model."""
    m = gen.build_tiny()
    layers = []
    for li, lid in enumerate(LIDS):
        g = m["layers"][li]
        rows = m["rows"][li]
        name = f"layers.{lid}.engram.table"
        lay = {"lid": lid, "rows": rows}
        if gen.TABLE_FORMAT[lid] == "fp8":
            # README "The tiny model": code = bits & 0xBF, scale code = 125 + bits % 5.
            codes = np.array([b & 0xBF for b in gen.bits_array(name, rows * HD)], dtype=np.uint8).reshape(rows, HD)
            sc = np.array([125 + b % 5 for b in gen.bits_array(name + ".scale", rows * (HD // 32))], dtype=np.uint8)
            sc = sc.reshape(rows, HD // 32)
            assert np.array_equal(dequant_e4m3(codes, sc, 1, 32), g["table"]), "fp8 codes disagree with gen.py"
            lay["table_fp8"] = (codes, sc)
        lay["table"] = g["table"]
        lay["wkv"] = g["wkv"]
        q = gen.value_array(f"layers.{lid}.engram.q", HC * D, 2.0**-3, 1.0).reshape(HC, D)
        k = gen.value_array(f"layers.{lid}.engram.k", HC * D, 2.0**-3, 1.0).reshape(HC, D)
        if gen.QK_DTYPE[lid] == "bf16":
            q, k = gen.bf16_round(q), gen.bf16_round(k)
        assert np.array_equal((q * k).astype(np.float32), g["qk"])
        lay["q"], lay["k"] = q, k
        layers.append(lay)
    return m, layers


def checkpoint_model(golden):
    """The tiny model as the released checkpoint stores it. Layer 1 is the golden
    unchanged (its table is fp8 already; wkv and q/k are bf16). Layer 3's bf16
    table, f32 wkv and f32 q/k have no exact checkpoint form, so they are
    converted the checkpoint's way: table rows fp8 with one e8m0 per 32 values,
    wkv fp8 with one e8m0 per 32x32 block, q/k bf16. Its values change."""
    out = []
    for lay in golden:
        if "table_fp8" in lay:
            out.append(dict(lay, wkv_fp8=None))
            continue
        codes, sc, deq = quant_e4m3(lay["table"], 1, 32)
        wc, ws, wdeq = quant_e4m3(lay["wkv"], 32, 32)
        assert np.array_equal(gen.bf16_round(deq), deq) and np.array_equal(gen.bf16_round(wdeq), wdeq)
        out.append(
            {
                "lid": lay["lid"],
                "rows": lay["rows"],
                "table_fp8": (codes, sc),
                "table": deq,
                "wkv_fp8": (wc, ws),
                "wkv": wdeq,
                "q": gen.bf16_round(lay["q"]),
                "k": gen.bf16_round(lay["k"]),
            }
        )
    return out


def with_wkv(model, fn):
    return [dict(lay, wkv=fn(lay["wkv"])) for lay in model]


def q8_0_roundtrip(w):
    q = gguf.quantize(w.astype(np.float32), QT.Q8_0)
    return gguf.dequantize(q, QT.Q8_0).astype(np.float32).reshape(w.shape)


# ---------------------------------------------------------------------------
# Hash constants: the tiny ones, and the ones a loader derives from a config
# plus the DeepSeek tokenizer (the checkpoint and deepstrix carry none).
# ---------------------------------------------------------------------------


def tiny_constants(m):
    return {
        "token_map": list(m["token_map"]),
        "pad_token_id": gen.PAD_TOKEN_ID,
        "pad_id": m["pad_id"],
        "compressed_vocab_size": max(m["token_map"]) + 1,
        "multipliers": [[int(v) for v in row] for row in m["mult"]],
        "primes": m["primes"],
        "offsets": m["offsets"],
        "rows": m["rows"],
    }


def derived_constants(m):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(DATA, "deepseek_v4_tokenizer.json"))
    rmap, count, _ = gen.v41_token_map(tok)
    half = (2**63 - 1) // count // 2
    mult = []
    for lid in LIDS:
        r = np.random.default_rng(10007 * lid).integers(0, half, size=N, dtype=np.int64)
        mult.append([int(v) * 2 + 1 for v in r])
    with open(os.path.join(DATA, "gguf_expected.json"), encoding="utf-8") as f:
        ge = json.load(f)
    assert gen.flat(mult) == ge["multipliers"] and rmap[gen.PAD_TOKEN_ID] == ge["pad_id"]
    return {
        "token_map": rmap,
        "pad_token_id": gen.PAD_TOKEN_ID,
        "pad_id": rmap[gen.PAD_TOKEN_ID],
        "compressed_vocab_size": count,
        "multipliers": mult,
        "primes": m["primes"],
        "offsets": m["offsets"],
        "rows": m["rows"],
    }


# ---------------------------------------------------------------------------
# GGUF writing (gguf-py) and an independent header walker for offsets.
# ---------------------------------------------------------------------------


def write_gguf(path, arch, kvs, tensors, alignment=None, split_max_tensors=0):
    """kvs: [(key, value, VT, sub_type)]; tensors: [(name, array, raw_dtype or None)]."""
    w = gguf.GGUFWriter(path, arch=arch, use_temp_file=False, split_max_tensors=split_max_tensors)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, val, vt, sub in kvs:
        w.add_key_value(key, val, vt, sub_type=sub)
    for name, arr, dt in tensors:
        if dt is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=dt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def walk_gguf(path):
    """Offsets of every key's type tag and value and of every tensor's dims, type and
    offset fields, for byte-patch mutations. Written independently of gguf-py."""
    with open(path, "rb") as f:
        b = f.read()
    pos = 0

    def u32():
        nonlocal pos
        v = struct.unpack_from("<I", b, pos)[0]
        pos += 4
        return v

    def u64():
        nonlocal pos
        v = struct.unpack_from("<Q", b, pos)[0]
        pos += 8
        return v

    def string():
        nonlocal pos
        n = u64()
        s = b[pos : pos + n].decode("utf-8")
        pos += n
        return s

    assert b[:4] == b"GGUF"
    pos = 4
    assert u32() == 3
    n_t, n_kv = u64(), u64()
    kvs = {}
    for _ in range(n_kv):
        key_off = pos
        key = string()
        type_off = pos
        t = u32()
        val_off = pos
        rec = {"key_offset": key_off, "type_offset": type_off, "value_offset": val_off, "type": t}
        if t == 8:
            string()
        elif t == 9:
            et = u32()
            cnt = u64()
            rec.update(elem_type=et, count=cnt, elems_offset=pos)
            if et == 8:
                for _ in range(cnt):
                    string()
            else:
                pos += _FIXED[et] * cnt
        else:
            pos += _FIXED[t]
        kvs[key] = rec
    tensors = {}
    for _ in range(n_t):
        name_off = pos
        name = string()
        nd = u32()
        dims_off = pos
        dims = [u64() for _ in range(nd)]
        type_off = pos
        t = u32()
        off_off = pos
        rel = u64()
        tensors[name] = {
            "name_offset": name_off,
            "dims_offset": dims_off,
            "dims": dims,
            "type_offset": type_off,
            "type": t,
            "offset_offset": off_off,
            "rel_offset": rel,
        }
    return b, kvs, tensors


def read_value(b, rec):
    t = rec["type"]
    if t == 9:
        fmt = {4: "<I", 5: "<i", 10: "<Q", 11: "<q", 12: "<d", 6: "<f"}[rec["elem_type"]]
        sz = _FIXED[rec["elem_type"]]
        return [struct.unpack_from(fmt, b, rec["elems_offset"] + i * sz)[0] for i in range(rec["count"])]
    fmt = {4: "<I", 5: "<i", 10: "<Q", 11: "<q", 2: "<H", 7: "<?"}[t]
    return struct.unpack_from(fmt, b, rec["value_offset"])[0]


def patch(file, offset, old, new):
    assert len(old) == len(new)
    return {"op": "patch", "file": file, "offset": offset, "old_hex": old.hex(), "new_hex": new.hex()}


def rename_key(file, kvs, b, key, new_key):
    """Same-length rename: the key is then absent."""
    assert len(new_key) == len(key)
    off = kvs[key]["key_offset"] + 8
    assert b[off : off + len(key)] == key.encode()
    return patch(file, off, key.encode(), new_key.encode())


def retype_key(file, kvs, b, key, new_type):
    rec = kvs[key]
    off = rec["type_offset"]
    old = b[off : off + 4]
    assert struct.unpack("<I", old)[0] == rec["type"]
    assert _FIXED[new_type] == _FIXED[rec["type"]]
    return patch(file, off, old, struct.pack("<I", new_type))


def retype_array(file, kvs, b, key, new_elem):
    rec = kvs[key]
    off = rec["value_offset"]
    old = b[off : off + 4]
    assert struct.unpack("<I", old)[0] == rec["elem_type"] and _FIXED[new_elem] == _FIXED[rec["elem_type"]]
    return patch(file, off, old, struct.pack("<I", new_elem))


def set_elem(file, kvs, b, key, index, value):
    rec = kvs[key]
    et = rec["elem_type"]
    fmt = {4: "<I", 5: "<i", 10: "<Q", 11: "<q"}[et]
    off = rec["elems_offset"] + index * _FIXED[et]
    old = b[off : off + _FIXED[et]]
    return patch(file, off, old, struct.pack(fmt, value))


def set_scalar(file, kvs, b, key, value):
    rec = kvs[key]
    fmt = {4: "<I", 5: "<i", 10: "<Q", 11: "<q", 2: "<H"}[rec["type"]]
    off = rec["value_offset"]
    old = b[off : off + struct.calcsize(fmt)]
    return patch(file, off, old, struct.pack(fmt, value))


def set_dim(file, tensors, b, name, dim, value):
    off = tensors[name]["dims_offset"] + 8 * dim
    old = b[off : off + 8]
    assert struct.unpack("<Q", old)[0] == tensors[name]["dims"][dim]
    return patch(file, off, old, struct.pack("<Q", value))


def rename_tensor(file, tensors, b, name, new_name):
    assert len(new_name) == len(name)
    off = tensors[name]["name_offset"] + 8
    assert b[off : off + len(name)] == name.encode()
    return patch(file, off, name.encode(), new_name.encode())


def retype_tensor(file, tensors, b, name, new_type):
    off = tensors[name]["type_offset"]
    old = b[off : off + 4]
    return patch(file, off, old, struct.pack("<I", new_type))


def replace_text(file, old, new):
    return {"op": "replace_text", "file": file, "old": old, "new": new}


def mutation(name, ops, status, names, note=None):
    r = {"name": name, "ops": ops, "status_suggested": status, "message_names": names}
    if note:
        r["note"] = note
    return r


# ---------------------------------------------------------------------------
# Shared tensor helpers.
# ---------------------------------------------------------------------------


def fp8_rows_bytes(lay):
    """[rows, Hd + Hd/32] u8: each row's e4m3 codes followed by its e8m0 scales."""
    codes, sc = lay["table_fp8"]
    return np.concatenate([codes, sc], axis=1)


def q_k_f32(lay):
    return lay["q"].astype(np.float32), lay["k"].astype(np.float32)


def unrelated_gguf_tensors():
    """Two tensors that are not engram's (a reader must size and skip them)."""
    emb = gen.value_array("dialects.token_embd", 48 * 32, 1.0, 0.0).reshape(48, 32)
    q41 = gguf.quantize(gen.value_array("dialects.output", 2 * 64, 1.0, 0.0).reshape(2, 64), QT.Q4_1)
    return [("token_embd.weight", emb, None)], [("output.weight", q41, QT.Q4_1)]


def tensor_inventory(path):
    """{name: [ggml type name, ne...]} of a GGUF file (from the independent walker)."""
    _, _, tens = walk_gguf(path)
    names = {int(t): t.name for t in QT}
    return {n: {"type": names.get(t["type"], str(t["type"])), "ne": t["dims"]} for n, t in tens.items()}


def sha256_file(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def u32_list_dead_as_ffffffff(tmap):
    return [t & 0xFFFFFFFF for t in tmap]


# ---------------------------------------------------------------------------
# 1. vcruz305 / llama.cpp PR 28696 / ik_llama.cpp PR 2506.
# ---------------------------------------------------------------------------


def vcruz305_kvs(prefix, consts):
    k = prefix + ".engram."
    return [
        (k + "head_count", H, VT.UINT32, None),
        (k + "key_length", HD, VT.UINT32, None),
        (k + "max_ngram_size", N, VT.UINT32, None),
        # add_array() on Python ints: gguf-py picks INT32.
        (k + "layer_ids", LIDS, VT.ARRAY, VT.INT32),
        (k + "multipliers", gen.flat(consts["multipliers"]), VT.ARRAY, VT.UINT64),
        (k + "primes", gen.flat(consts["primes"]), VT.ARRAY, VT.UINT64),
        (k + "offsets", gen.flat(consts["offsets"]), VT.ARRAY, VT.UINT64),
        (k + "token_map", consts["token_map"], VT.ARRAY, VT.INT32),
        (k + "pad_id", consts["pad_id"], VT.UINT32, None),
    ]


def vcruz305_tensors(model, all_bf16=False):
    head, tail = unrelated_gguf_tensors()
    out = list(head)
    for lay in model:
        p = f"blk.{lay['lid']}."
        # The converter itself writes Q8_0 tables; bf16 holds the golden rows exactly.
        out.append((p + "engram_embd.weight", bf16_u16(lay["table"]), QT.BF16))
        if all_bf16:
            q, k = q_k_f32(lay)
            out.append((p + "engram_wkv.weight", bf16_u16(lay["wkv"]), QT.BF16))
            out.append((p + "engram_q.weight", bf16_u16(q), QT.BF16))
            out.append((p + "engram_k.weight", bf16_u16(k), QT.BF16))
            continue
        if gen.WKV_DTYPE[lay["lid"]] == "bf16":
            out.append((p + "engram_wkv.weight", bf16_u16(lay["wkv"]), QT.BF16))
        else:
            out.append((p + "engram_wkv.weight", lay["wkv"].astype(np.float32), QT.F32))
        q, k = q_k_f32(lay)
        if gen.QK_DTYPE[lay["lid"]] == "bf16":
            out.append((p + "engram_q.weight", bf16_u16(q), QT.BF16))
            out.append((p + "engram_k.weight", bf16_u16(k), QT.BF16))
        else:
            out.append((p + "engram_q.weight", q, QT.F32))
            out.append((p + "engram_k.weight", k, QT.F32))
    return out + tail


# ---------------------------------------------------------------------------
# 2. antirez/ds4 (gguf-tools/deepseek41_quantize.py + deepseek41_metadata.py).
# ---------------------------------------------------------------------------

DS4_ALIGNMENT = 16384


def ds4_encoding():
    return f"e4m3_e8m0_32_row{HD + HD // 32}"


def tiny_text_config(consts, vocab):
    return {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "quantization_config": {"weight_block_size": [32, 32]},
        "text_config": {
            "model_type": "deepseek_v41_text",
            "vocab_size": vocab,
            "hidden_size": D,
            "hc_mult": HC,
            "num_hidden_layers": 4,
            "engram_layer_ids": LIDS,
            "engram_num_embeddings": consts["rows"],
            "engram_max_ngram_size": N,
            "engram_n_heads": H,
            "engram_head_dim": HD,
            "engram_vocab_size": gen.TINY_ENGRAM_VOCAB,
            "engram_pad_token_id": gen.PAD_TOKEN_ID,
            "engram_compressed_vocab_size": consts["compressed_vocab_size"],
        },
    }


def ds4_file(model, consts):
    k = "deepseek41.engram."
    cfg = tiny_text_config(consts, gen.VOCAB)
    kvs = [
        ("general.name", "DeepSeek V4.1 tiny (engram golden)", VT.STRING, None),
        ("deepseek41.config", json.dumps(cfg, sort_keys=True, separators=(",", ":")), VT.STRING, None),
        (k + "encoding", ds4_encoding(), VT.STRING, None),
        (k + "layer_ids", LIDS, VT.ARRAY, VT.UINT32),
        (k + "rows", consts["rows"], VT.ARRAY, VT.UINT32),
        (k + "compressed_vocab_size", consts["compressed_vocab_size"], VT.UINT32, None),
        (k + "pad_id", consts["pad_id"], VT.UINT32, None),
        # ds4 maps every token; the tiny map's -1 (dead) entries become 0xFFFFFFFF here.
        (k + "token_map", u32_list_dead_as_ffffffff(consts["token_map"]), VT.ARRAY, VT.UINT32),
        (k + "primes", gen.flat(consts["primes"]), VT.ARRAY, VT.UINT32),
        (k + "multipliers", gen.flat(consts["multipliers"]), VT.ARRAY, VT.UINT64),
        ("deepseek41.vocab_size", gen.VOCAB, VT.UINT32, None),
        ("deepseek41.hidden_size", D, VT.UINT32, None),
        ("deepseek41.num_hidden_layers", 4, VT.UINT32, None),
        ("deepseek41.hc_mult", HC, VT.UINT32, None),
    ]
    tensors = [("token_embd.weight", gen.value_array("dialects.token_embd", 48 * 32, 1.0, 0.0).reshape(48, 32).astype(np.float16), None)]
    for lay in model:
        p = f"blk.{lay['lid']}."
        q, k_ = q_k_f32(lay)
        tensors.append((p + "engram_q_norm.weight", q, None))
        tensors.append((p + "engram_k_norm.weight", k_, None))
        tensors.append((p + "engram_kv.weight", f16_exact(lay["wkv"]), None))
    # The tables go last, outside the resident extent, raw 264-byte-style rows.
    for lay in model:
        tensors.append((f"blk.{lay['lid']}.engram_embd.weight", fp8_rows_bytes(lay).view(np.int8), None))
    return kvs, tensors


# ---------------------------------------------------------------------------
# 3. tarruda/llama.cpp (conversion/deepseek41.py; key types as its fixture exporter writes them).
# ---------------------------------------------------------------------------


def tarruda_file(model, consts):
    k = "deepseek41.engram."
    kvs = [
        ("deepseek41.embedding_length", D, VT.UINT32, None),
        ("deepseek41.hyper_connection.count", HC, VT.UINT32, None),
        (k + "layers", LIDS, VT.ARRAY, VT.UINT32),
        (k + "ngram_size", N, VT.UINT32, None),
        (k + "head_count", H, VT.UINT32, None),
        (k + "head_dim", HD, VT.UINT32, None),
        (k + "embedding_counts", consts["rows"], VT.ARRAY, VT.UINT32),
        (k + "head_offsets", gen.flat(consts["offsets"]), VT.ARRAY, VT.UINT32),
        (k + "head_bucket_sizes", gen.flat(consts["primes"]), VT.ARRAY, VT.UINT32),
        (k + "multipliers", gen.flat(consts["multipliers"]), VT.ARRAY, VT.UINT64),
        (k + "token_map", u32_list_dead_as_ffffffff(consts["token_map"]), VT.ARRAY, VT.UINT32),
        (k + "compressed_vocab_size", consts["compressed_vocab_size"], VT.UINT32, None),
        # Raw token id: the runtime maps it through token_map like an input token.
        (k + "pad_token_id", RAW_PAD_ALIAS, VT.UINT32, None),
    ]
    tensors = []
    # prepare_tensors writes the tables first, as I8 bytes: codes, then scales.
    for lay in model:
        codes, sc = lay["table_fp8"]
        tensors.append((f"blk.{lay['lid']}.engram_embd.weight", codes.view(np.int8), None))
        tensors.append((f"blk.{lay['lid']}.engram_embd_scale.weight", sc.view(np.int8), None))
    for lay in model:
        p = f"blk.{lay['lid']}."
        q, k_ = q_k_f32(lay)
        tensors.append((p + "engram_kv.weight", bf16_u16(lay["wkv"]), QT.BF16))
        tensors.append((p + "engram_q_weight.weight", bf16_u16(q), QT.BF16))
        tensors.append((p + "engram_k_weight.weight", bf16_u16(k_), QT.BF16))
    return kvs, tensors


# ---------------------------------------------------------------------------
# 4. JigSawPT/llama.cpp (conversion/deepseek_v41.py + deepseek_v41_engram.py).
# ---------------------------------------------------------------------------


def jigsawpt_file(model, consts):
    kvs = [
        ("deepseek41.engram.present", True, VT.BOOL, None),
        ("deepseek41.engram.layer_ids", LIDS, VT.ARRAY, VT.INT32),
        ("deepseek41.engram.num_embeddings", consts["rows"], VT.ARRAY, VT.INT32),
        ("deepseek41.engram_head_dim", HD, VT.UINT32, None),
        ("deepseek41.engram_n_heads", H, VT.UINT32, None),
        ("deepseek41.engram_max_ngram_size", N, VT.UINT32, None),
        ("deepseek41.engram_vocab_size", gen.TINY_ENGRAM_VOCAB, VT.UINT32, None),
        ("deepseek41.engram_compressed_vocab_size", consts["compressed_vocab_size"], VT.UINT32, None),
        ("deepseek41.engram_pad_token_id", RAW_PAD_ALIAS, VT.UINT32, None),
    ]
    pr = np.array(consts["primes"], dtype=np.int64).reshape(L, C)
    of = np.array(consts["offsets"], dtype=np.int64).reshape(L, C)
    mu = np.array(consts["multipliers"], dtype=np.int64).reshape(L, N)
    tensors = [
        ("engram_token_map.weight", np.array(consts["token_map"], dtype=np.int32), None),
        ("engram_primes.weight", pr, None),
        ("engram_offsets.weight", of, None),
        ("engram_multipliers.weight", mu, None),
    ]
    for lay in model:
        p = f"blk.{lay['lid']}."
        q, k_ = q_k_f32(lay)
        tensors.append((p + "engram_q.weight", bf16_u16(q), QT.BF16))
        tensors.append((p + "engram_k.weight", bf16_u16(k_), QT.BF16))
        tensors.append((p + "engram_wkv.weight", bf16_u16(lay["wkv"]), QT.BF16))
    # The lookup tables last, byte for byte as I8: codes and scales in two tensors.
    for lay in model:
        codes, sc = lay["table_fp8"]
        tensors.append((f"blk.{lay['lid']}.engram_embd.weight", codes.view(np.int8), None))
        tensors.append((f"blk.{lay['lid']}.engram_embd_scale.weight", sc.view(np.int8), None))
    return kvs, tensors


# ---------------------------------------------------------------------------
# 5a. deepstrix (scripts/v41_convert/to_gguf.py): tables stay in the HF shards.
# ---------------------------------------------------------------------------


def deepstrix_file(model, consts):
    a = "deepseek4"
    e = a + ".engram."
    shard = RECORDED_MODEL_DIR + "/" + TABLE_SHARD
    kvs = [
        ("general.name", "DeepSeek-V4.1-Flash (tiny engram golden)", VT.STRING, None),
        (a + ".variant", "v4.1-flash", VT.STRING, None),
        (a + ".block_count", 4, VT.UINT32, None),
        (a + ".embedding_length", D, VT.UINT32, None),
        (a + ".hyper_connection.count", HC, VT.UINT32, None),
        (e + "layer_ids", LIDS, VT.ARRAY, VT.INT32),
        (e + "num_embeddings", consts["rows"], VT.ARRAY, VT.INT32),
        (e + "max_ngram_size", N, VT.UINT32, None),
        (e + "vocab_size", gen.TINY_ENGRAM_VOCAB, VT.UINT32, None),
        (e + "head_count", H, VT.UINT32, None),
        (e + "head_dim", HD, VT.UINT32, None),
        # inference/config.json's engram_pad_id: the raw token id.
        (e + "pad_id", consts["pad_token_id"], VT.UINT32, None),
        (e + "compressed_vocab_size", consts["compressed_vocab_size"], VT.UINT32, None),
        (e + "table_shards", [shard for _ in LIDS], VT.ARRAY, VT.STRING),
        # Every part carries split keys; the tensor count is a placeholder never patched.
        ("split.no", 0, VT.UINT16, None),
        ("split.count", 1, VT.UINT16, None),
        ("split.tensors.count", -1, VT.INT32, None),
    ]
    tensors = [("output_norm.weight", gen.value_array("dialects.output_norm", D, 1.0, 0.0), None)]
    for lay in model:
        p = f"blk.{lay['lid']}."
        q, k_ = q_k_f32(lay)
        tensors.append((p + "engram_wkv.weight", gguf.quantize(lay["wkv"].astype(np.float32), QT.Q8_0), QT.Q8_0))
        tensors.append((p + "engram_q.weight", q, None))
        tensors.append((p + "engram_k.weight", k_, None))
    return kvs, tensors


# ---------------------------------------------------------------------------
# 5b. "ds4gw" style (shard path + byte offsets; the YoungAi engine's wire, read by
#     JLFN/ds4-dfm-rs crates/ds4-core/src/{v41,engram,layout}.rs).
# ---------------------------------------------------------------------------


def ds4gw_file(model, consts, table_offsets):
    a = "deepseek4"
    e = a + ".engram."
    kvs = [
        (e + "layer_ids", LIDS, VT.ARRAY, VT.UINT32),
        (e + "num_embeddings", consts["rows"], VT.ARRAY, VT.UINT64),
        (e + "max_ngram_size", N, VT.UINT32, None),
        (e + "head_count", H, VT.UINT32, None),
        (e + "head_dim", HD, VT.UINT32, None),
        (e + "pad_id_compressed", consts["pad_id"], VT.UINT32, None),
    ]
    for i, lid in enumerate(LIDS):
        w_off, s_off = table_offsets[lid]
        kvs += [
            (f"{e}{i}.table_path", RECORDED_MODEL_DIR + "/" + TABLE_SHARD, VT.STRING, None),
            (f"{e}{i}.weight_offset", w_off, VT.UINT64, None),
            (f"{e}{i}.scale_offset", s_off, VT.UINT64, None),
        ]
    tensors = [
        ("engram.token_map", np.array(consts["token_map"], dtype=np.int32), None),
        ("engram.multipliers", np.array(gen.flat(consts["multipliers"]), dtype=np.int64), None),
        ("engram.primes", np.array(gen.flat(consts["primes"]), dtype=np.int64), None),
        ("engram.offsets", np.array(gen.flat(consts["offsets"]), dtype=np.int64), None),
    ]
    for lay in model:
        p = f"blk.{lay['lid']}."
        q, k_ = q_k_f32(lay)
        # The engine's own files hold wkv in a private ggml type (44, "FP8_32X32");
        # bf16 stands in for it here (the dequantised values, exactly).
        tensors.append((p + "engram_wkv.weight", bf16_u16(lay["wkv"]), QT.BF16))
        tensors.append((p + "engram_q.weight", q, None))
        tensors.append((p + "engram_k.weight", k_, None))
    return kvs, tensors


# ---------------------------------------------------------------------------
# 6. The released checkpoint (safetensors, model.safetensors.index.json, config.json).
# ---------------------------------------------------------------------------


def checkpoint_tensors(model):
    """{shard: {name: array}} in the checkpoint's names, shapes (row-major) and dtypes."""
    s1, s2 = {}, {}
    s1["layers.0.attn_norm.weight"] = gen.bf16_round(gen.value_array("dialects.attn_norm", D, 1.0, 0.0)).astype(ml_dtypes.bfloat16)
    s2["norm.weight"] = gen.bf16_round(gen.value_array("dialects.norm", D, 1.0, 0.0)).astype(ml_dtypes.bfloat16)
    for lay in model:
        p = f"layers.{lay['lid']}.engram."
        codes, sc = lay["table_fp8"]
        s2[p + "embed.weight"] = codes.view(ml_dtypes.float8_e4m3fn)
        s2[p + "embed.scale"] = sc.view(ml_dtypes.float8_e8m0fnu)
        if lay.get("wkv_fp8") is not None:
            wc, ws = lay["wkv_fp8"]
            s1[p + "wkv.weight"] = wc.view(ml_dtypes.float8_e4m3fn)
            s1[p + "wkv.scale"] = ws.view(ml_dtypes.float8_e8m0fnu)
        else:
            s1[p + "wkv.weight"] = lay["wkv"].astype(ml_dtypes.bfloat16)
            assert np.array_equal(s1[p + "wkv.weight"].astype(np.float32), lay["wkv"])
        s1[p + "q_weight"] = lay["q"].astype(ml_dtypes.bfloat16)
        s1[p + "k_weight"] = lay["k"].astype(ml_dtypes.bfloat16)
        assert np.array_equal(s1[p + "q_weight"].astype(np.float32), lay["q"])
    return {CKPT_SHARDS[0]: s1, CKPT_SHARDS[1]: s2}


def safetensors_header(path):
    with open(path, "rb") as f:
        b = f.read()
    n = struct.unpack_from("<Q", b, 0)[0]
    return b, n, json.loads(b[8 : 8 + n])


def write_checkpoint(model, consts):
    d = os.path.join(OUT, CKPT_DIR)
    os.makedirs(d, exist_ok=True)
    shards = checkpoint_tensors(model)
    weight_map, total = {}, 0
    for shard, tensors in shards.items():
        blob = st_numpy.save(tensors, metadata={"format": "pt"})
        with open(os.path.join(d, shard), "wb") as f:
            f.write(blob)
        for name, arr in tensors.items():
            weight_map[name] = shard
            total += arr.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    gen.write(os.path.join(d, "model.safetensors.index.json"), json.dumps(index, indent=2))
    cfg = tiny_text_config(consts, gen.V41_VOCAB)
    gen.write(os.path.join(d, "config.json"), json.dumps(cfg, indent=2))
    # Byte offsets of the two table planes inside the table shard (for ds4gw style).
    b, n, hdr = safetensors_header(os.path.join(d, TABLE_SHARD))
    offs = {}
    for lay in model:
        p = f"layers.{lay['lid']}.engram.embed."
        offs[lay["lid"]] = (8 + n + hdr[p + "weight"]["data_offsets"][0], 8 + n + hdr[p + "scale"]["data_offsets"][0])
        codes, sc = lay["table_fp8"]
        w0, s0 = offs[lay["lid"]]
        assert b[w0 : w0 + codes.nbytes] == codes.tobytes() and b[s0 : s0 + sc.nbytes] == sc.tobytes()
    return offs


# ---------------------------------------------------------------------------
# Expected apply outputs for the fixtures whose values differ from tiny.json.
# ---------------------------------------------------------------------------

CHECK_TOKENS = 4
CHECK_HIGHWAY = "dialects.check.highway"


def check_call(model, consts, tokens):
    """One call, seq 0, pos 0..n: hash ids and per-layer rows/kv/highway_out_f32."""
    hasher = gen.Hasher(consts["token_map"], consts["pad_id"], consts["multipliers"], consts["primes"], consts["offsets"], H, N)
    n = len(tokens)
    ids, dead = hasher.call(tokens, [0] * n, list(range(n)))
    hw_in = gen.value_array(CHECK_HIGHWAY, n * HC * D, 1.0, 0.0).reshape(n, HC, D)
    layers = []
    for li, lay in enumerate(model):
        eff = {"lid": lay["lid"], "table": lay["table"], "wkv": lay["wkv"], "qk": (lay["q"] * lay["k"]).astype(np.float32)}
        rows, kv, o32, _ = gen.forward_layer(eff, [ids[t][li] for t in range(n)], dead, hw_in)
        layers.append(
            {
                "layer_id": lay["lid"],
                "rows_bf16": gen.bf16_bits(rows),
                "kv_bf16": gen.bf16_bits(kv),
                "highway_out_f32": gen.f32_bits(o32),
            }
        )
    return {
        "tokens": tokens,
        "seq_ids": [0] * n,
        "pos": list(range(n)),
        "dead": dead,
        "highway_name": CHECK_HIGHWAY,
        "ids": gen.flat(ids),
        "layers": layers,
    }


def weights_digest(model):
    h = hashlib.sha256()
    for lay in model:
        for key in ("table", "wkv", "q", "k"):
            h.update(np.ascontiguousarray(lay[key], dtype=np.float32).tobytes())
    return h.hexdigest()


def replay_tiny_json(model, layer_index, tj):
    """True when `model`'s layer `layer_index` reproduces tiny.json's outputs for that
    layer bit for bit in every regime (tiny hash constants)."""
    m = gen.build_tiny()
    args = (m["token_map"], m["pad_id"], m["mult"], m["primes"], m["offsets"], H, N)
    lay = model[layer_index]
    eff = {"lid": lay["lid"], "table": lay["table"], "wkv": lay["wkv"], "qk": (lay["q"] * lay["k"]).astype(np.float32)}
    for rname, calls in gen.regime_calls().items():
        hasher = gen.Hasher(*args)
        for ci, call in enumerate(calls):
            tokens = [c[2] for c in call]
            ids, dead = hasher.call(tokens, [c[0] for c in call], [c[1] for c in call])
            n = len(tokens)
            rec = tj["regimes"][rname]["calls"][ci]
            assert gen.flat(ids) == rec["ids"], (rname, ci)
            hw_in = gen.value_array(rec["highway_name"], n * HC * D, 1.0, 0.0).reshape(n, HC, D)
            rows, kv, o32, ob = gen.forward_layer(eff, [ids[t][layer_index] for t in range(n)], dead, hw_in)
            want = rec["layers"][layer_index]
            if (
                gen.bf16_bits(rows) != want["rows_bf16"]
                or gen.bf16_bits(kv) != want["kv_bf16"]
                or gen.f32_bits(o32) != want["highway_out_f32"]
                or gen.bf16_bits(ob) != want["highway_out_bf16"]
            ):
                return False
    return True


# ---------------------------------------------------------------------------
# expected.json helpers.
# ---------------------------------------------------------------------------


def consts_record(consts, full_token_map):
    tm = np.array(consts["token_map"], dtype="<i4")
    r = {
        "pad_token_id": consts["pad_token_id"],
        "pad_id": consts["pad_id"],
        "compressed_vocab_size": consts["compressed_vocab_size"],
        "vocab": len(consts["token_map"]),
        "token_map_sha256_i32le": hashlib.sha256(tm.tobytes()).hexdigest(),
        "multipliers": gen.flat(consts["multipliers"]),
        "primes": gen.flat(consts["primes"]),
        "offsets": gen.flat(consts["offsets"]),
        "rows": consts["rows"],
    }
    if full_token_map:
        r["token_map"] = consts["token_map"]
    else:
        r["token_map_first"] = consts["token_map"][:16]
    return r


def geometry():
    return {"D": D, "hc": HC, "Hd": HD, "H": H, "N": N, "C": C, "layer_ids": LIDS}


def rel(*parts):
    return "/".join(parts)


def main():
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)

    m, golden = golden_model()
    ckpt = checkpoint_model(golden)
    tiny = tiny_constants(m)
    derived = derived_constants(m)
    assert tiny["pad_id"] < tiny["compressed_vocab_size"]
    assert RAW_PAD_ALIAS != gen.PAD_TOKEN_ID and tiny["token_map"][RAW_PAD_ALIAS] == tiny["pad_id"]

    # ---- 1. vcruz305: split into three shards, and the deepseek4. prefix.
    split_base = os.path.join(OUT, "vcruz305_split.gguf")
    kv = [("general.name", "engram tiny golden model", VT.STRING, None)] + vcruz305_kvs("deepseek41", tiny)
    write_gguf(split_base, "deepseek41", kv, vcruz305_tensors(golden), split_max_tensors=4)
    split_files = [f"vcruz305_split-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    for f in split_files:
        assert os.path.isfile(os.path.join(OUT, f)), f
    prefix_file = "vcruz305_deepseek4_prefix.gguf"
    kv = [("general.name", "engram tiny golden model", VT.STRING, None)] + vcruz305_kvs("deepseek4", tiny)
    write_gguf(os.path.join(OUT, prefix_file), "deepseek41", kv, vcruz305_tensors(ckpt, all_bf16=True))

    # ---- 6. the checkpoint first: the tables-elsewhere files point into it.
    table_offsets = write_checkpoint(ckpt, derived)

    # ---- 2-5.
    ds4_model = with_wkv(ckpt, lambda w: w.astype(np.float16).astype(np.float32))
    n_f16_changed = int(sum((a["wkv"] != b["wkv"]).sum() for a, b in zip(ds4_model, ckpt)))
    kvs, tens = ds4_file(ds4_model, tiny)
    write_gguf(os.path.join(OUT, "ds4.gguf"), "deepseek41", kvs, tens, alignment=DS4_ALIGNMENT)
    kvs, tens = tarruda_file(ckpt, tiny)
    write_gguf(os.path.join(OUT, "tarruda.gguf"), "deepseek41", kvs, tens)
    kvs, tens = jigsawpt_file(ckpt, tiny)
    write_gguf(os.path.join(OUT, "jigsawpt.gguf"), "deepseek41", kvs, tens)
    deepstrix_model = with_wkv(ckpt, q8_0_roundtrip)
    kvs, tens = deepstrix_file(ckpt, derived)
    deepstrix_name = "deepstrix-00001-of-00001.gguf"
    write_gguf(os.path.join(OUT, deepstrix_name), "deepseek4", kvs, tens)
    kvs, tens = ds4gw_file(ckpt, tiny, table_offsets)
    write_gguf(os.path.join(OUT, "ds4gw_style.gguf"), "deepseek4", kvs, tens)

    # ---- effective models and their check calls.
    prefill_tokens = [b % gen.VOCAB for b in gen.bits_array("prefill.tokens", CHECK_TOKENS)]
    with open(os.path.join(DATA, "gguf_expected.json"), encoding="utf-8") as f:
        text_tokens = json.load(f)["texts"][0]["tokens"][:CHECK_TOKENS]
    with open(os.path.join(DATA, "tiny.json"), encoding="utf-8") as f:
        tj = json.load(f)
    # Layer 1 of the checkpoint form is the golden's; the f16 wkv of ds4 changes six
    # layer-1 weights by less than f16's subnormal step, and no output bit.
    assert replay_tiny_json(golden, 0, tj) and replay_tiny_json(golden, 1, tj)
    assert replay_tiny_json(ckpt, 0, tj) and not replay_tiny_json(ckpt, 1, tj)
    assert replay_tiny_json(ds4_model, 0, tj)
    effective = {
        "checkpoint_tiny_hash": {
            "weights": ckpt,
            "consts": tiny,
            "tiny_json_layers": [LIDS[0]],
            "note": "Layer 1 is the golden's (tiny.json applies to it in every regime); layer 3 in the checkpoint's formats (fp8 rows, fp8 32x32 wkv, bf16 q/k), so its outputs differ from tiny.json. Tiny hash constants (tiny.json's ids apply to both layers in every regime).",
        },
        "checkpoint_tiny_hash_f16_wkv": {
            "weights": ds4_model,
            "consts": tiny,
            "tiny_json_layers": [LIDS[0]],
            "same_outputs_as": "checkpoint_tiny_hash",
            "note": f"checkpoint_tiny_hash with wkv rounded to f16 (ds4 stores F16): {n_f16_changed} layer-1 weights below f16's subnormal step change, no output bit does (checked over every tiny.json regime and the check call).",
        },
        "checkpoint_derived_hash": {
            "weights": ckpt,
            "consts": derived,
            "note": "checkpoint weights; hash constants derived from config.json + the DeepSeek tokenizer (as gguf_expected.json).",
        },
        "deepstrix": {
            "weights": deepstrix_model,
            "consts": derived,
            "note": "checkpoint tables (read from the checkpoint fixture's shard), wkv as Q8_0 (lossy, both layers), q/k F32; derived hash constants.",
        },
    }
    for name, e in effective.items():
        tokens = prefill_tokens if e["consts"] is tiny else text_tokens
        e["check"] = check_call(e["weights"], e["consts"], tokens)
        e["digest"] = weights_digest(e["weights"])
    # The tiny-hash check call's ids equal tiny.json's prefill ids for the same positions.
    pre = tj["regimes"]["prefill"]["calls"][0]
    assert effective["checkpoint_tiny_hash"]["check"]["ids"] == pre["ids"][: CHECK_TOKENS * L * C]
    assert effective["checkpoint_tiny_hash_f16_wkv"]["check"] == effective["checkpoint_tiny_hash"]["check"]
    del effective["checkpoint_tiny_hash_f16_wkv"]["check"]
    with open(os.path.join(DATA, "gguf_expected.json"), encoding="utf-8") as f:
        ge_ids = json.load(f)["texts"][0]["ids"]
    assert effective["checkpoint_derived_hash"]["check"]["ids"] == ge_ids[: CHECK_TOKENS * L * C]

    # ---- expected.json
    exp = {
        "readme": "See tests/golden/README.md (Dialect fixtures) and tests/golden/DIALECTS.md.",
        "geometry": geometry(),
        "eps_f32": gen.f32_bits([gen.EPS])[0],
        "tokenizer": "../deepseek_v4_tokenizer.json",
        "check_call": {
            "tokens_for_tiny_hash": "the first 4 tokens of tiny.json's prefill call (seq 0, pos 0..3)",
            "tokens_for_derived_hash": "the first 4 tokens of gguf_expected.json texts[0] (seq 0, pos 0..3)",
            "highway": f"value('{CHECK_HIGHWAY}', i, 1.0, 0.0) over [4, hc, D]; each layer applied to its own fresh copy (f32 highway)",
        },
        "constants": {"tiny": consts_record(tiny, True), "derived": consts_record(derived, False)},
        "effective_models": {
            "golden": {"note": "gen.py's tiny model: tiny.json applies to both layers in every regime.", "hash": "tiny", "tiny_json_layers": LIDS},
            **{
                name: {
                    "note": e["note"],
                    "hash": "tiny" if e["consts"] is tiny else "derived",
                    "weights_sha256": e["digest"],
                    **{k: e[k] for k in ("tiny_json_layers", "same_outputs_as", "check") if k in e},
                }
                for name, e in effective.items()
            },
        },
        "fixtures": {},
    }
    F = exp["fixtures"]

    def inv(f):
        return tensor_inventory(os.path.join(OUT, f))

    F["vcruz305_single"] = {
        "dialect": "vcruz305",
        "files": ["../tiny.gguf"],
        "note": "tests/golden/data/tiny.gguf is this dialect already (tensor names without the .weight suffix the converter adds).",
        "hash": "tiny",
        "effective_model": "golden",
        "tables": "in_file",
    }
    F["vcruz305_split"] = {
        "dialect": "vcruz305",
        "files": split_files,
        "open": split_files[0],
        "split": {"count": 3, "tensors_count": 10, "metadata_in": split_files[0]},
        "hash": "tiny",
        "effective_model": "golden",
        "tables": "in_file",
        "tensors": {f: inv(f) for f in split_files},
    }
    F["vcruz305_deepseek4_prefix"] = {
        "dialect": "vcruz305",
        "variant": "deepseek4_key_prefix",
        "files": [prefix_file],
        "note": "general.architecture is deepseek41 but the nine engram keys are spelled deepseek4.engram.* (early converter; its published files had only the four geometry keys so spelled). Weights in the checkpoint form, all bf16.",
        "hash": "tiny",
        "effective_model": "checkpoint_tiny_hash",
        "tables": "in_file",
        "tensors": inv(prefix_file),
    }
    F["ds4"] = {
        "dialect": "ds4",
        "files": ["ds4.gguf"],
        "alignment": DS4_ALIGNMENT,
        "encoding": ds4_encoding(),
        "hash": "tiny",
        "derive": "N = |multipliers|/L; H = |primes|/(L*(N-1)); Hd from the encoding's row bytes B = Hd + Hd/32 (= ne0 of engram_embd); offsets = per-layer prefix sums of primes; pad_id is compressed; token_map 0xFFFFFFFF = dead",
        "effective_model": "checkpoint_tiny_hash_f16_wkv",
        "tables": "in_file",
        "tensors": inv("ds4.gguf"),
    }
    F["tarruda"] = {
        "dialect": "tarruda",
        "files": ["tarruda.gguf"],
        "hash": "tiny",
        "pad": "deepseek41.engram.pad_token_id is the raw token id; pad_id = token_map[pad_token_id]",
        "pad_token_id_in_file": RAW_PAD_ALIAS,
        "pad_id": tiny["pad_id"],
        "effective_model": "checkpoint_tiny_hash",
        "tables": "in_file",
        "tensors": inv("tarruda.gguf"),
    }
    F["jigsawpt"] = {
        "dialect": "jigsawpt",
        "files": ["jigsawpt.gguf"],
        "hash": "tiny",
        "pad": "deepseek41.engram_pad_token_id is the raw token id; pad_id = token_map[pad_token_id]",
        "pad_token_id_in_file": RAW_PAD_ALIAS,
        "pad_id": tiny["pad_id"],
        "effective_model": "checkpoint_tiny_hash",
        "tables": "in_file",
        "tensors": inv("jigsawpt.gguf"),
    }
    F["deepstrix"] = {
        "dialect": "deepstrix",
        "files": [deepstrix_name],
        "companions": {"checkpoint_dir": CKPT_DIR, "tokenizer": "../deepseek_v4_tokenizer.json"},
        "hash": "derived",
        "pad": "deepseek4.engram.pad_id is the raw token id; pad_id = token_map[pad_id]",
        "effective_model": "deepstrix",
        "tables": {
            "elsewhere": True,
            "keys": ["deepseek4.engram.table_shards"],
            "recorded": [RECORDED_MODEL_DIR + "/" + TABLE_SHARD] * L,
            "resolve": f"keep the file name, rebase onto the checkpoint directory ({CKPT_DIR}/); read layers.{{L}}.engram.embed.weight/.scale from that shard's safetensors header",
        },
        "refusal_names": ["deepseek4.engram.table_shards"],
        "no_hash_constants": "the file carries no token map, multipliers, primes or offsets: they come from a tokenizer and the config keys in the file",
        "tensors": inv(deepstrix_name),
    }
    F["ds4gw_style"] = {
        "dialect": "ds4gw",
        "files": ["ds4gw_style.gguf"],
        "companions": {"checkpoint_dir": CKPT_DIR},
        "hash": "tiny",
        "effective_model": "checkpoint_tiny_hash",
        "tables": {
            "elsewhere": True,
            "keys": [f"deepseek4.engram.{i}.{k}" for i in range(L) for k in ("table_path", "weight_offset", "scale_offset")],
            "recorded": {str(lid): {"path": RECORDED_MODEL_DIR + "/" + TABLE_SHARD, "weight_offset": table_offsets[lid][0], "scale_offset": table_offsets[lid][1]} for lid in LIDS},
            "resolve": f"keep the file name, rebase onto the checkpoint directory ({CKPT_DIR}/); row r is Hd bytes at weight_offset + r*Hd and Hd/32 bytes at scale_offset + r*Hd/32",
        },
        "refusal_names": [f"deepseek4.engram.0.{k}" for k in ("table_path", "weight_offset", "scale_offset")],
        "tensors": inv("ds4gw_style.gguf"),
    }
    ck_files = [rel(CKPT_DIR, f) for f in ("config.json", "model.safetensors.index.json", *CKPT_SHARDS)]
    ck_tensors = {}
    for shard in CKPT_SHARDS:
        _, _, hdr = safetensors_header(os.path.join(OUT, CKPT_DIR, shard))
        for k, v in hdr.items():
            if k != "__metadata__":
                ck_tensors[k] = {"shard": shard, "dtype": v["dtype"], "shape": v["shape"]}
    F["checkpoint"] = {
        "dialect": "safetensors_checkpoint",
        "files": ck_files,
        "open": CKPT_DIR,
        "companions": {"tokenizer": "../deepseek_v4_tokenizer.json"},
        "hash": "derived",
        "pad": "text_config.engram_pad_token_id is the raw token id",
        "effective_model": "checkpoint_derived_hash",
        "tables": "in_file",
        "tensors": dict(sorted(ck_tensors.items())),
    }
    for f in F.values():
        f["sha256"] = {p: sha256_file(os.path.join(OUT, p)) for p in f["files"] if not p.startswith("..")}

    exp["mutations"] = mutations(split_files, prefix_file, deepstrix_name)
    verify_fixtures(golden, effective, tiny, derived)

    gen.write(os.path.join(OUT, "expected.json"), gen.dump(exp))
    total = 0
    for root, _, files in os.walk(OUT):
        for f in sorted(files):
            p = os.path.join(root, f)
            total += os.path.getsize(p)
            print(f"{os.path.relpath(p, OUT)}: {os.path.getsize(p)} bytes", file=sys.stderr)
    print(f"total: {total} bytes", file=sys.stderr)


# ---------------------------------------------------------------------------
# Read-back: decode every fixture with gguf-py's reader (or the safetensors
# header) the way its dialect says, and compare with the model it must hold.
# ---------------------------------------------------------------------------


def _reader_fields(r):
    out = {}
    for name, fld in r.fields.items():
        t = fld.types[0] if fld.types else None
        if t == VT.ARRAY:
            et = fld.types[1]
            if et == VT.STRING:
                val = [bytes(fld.parts[i]).decode() for i in fld.data]
            else:
                val = [fld.parts[i][0].item() for i in fld.data]
            out[name] = (t, et, val)
        elif t == VT.STRING:
            out[name] = (t, None, bytes(fld.parts[-1]).decode())
        else:
            out[name] = (t, None, fld.parts[-1][0].item())
    return out


def _tensor_values(t):
    """f32 values of a GGUF tensor in numpy order (rows = ne1...)."""
    shape = tuple(int(x) for x in reversed(list(t.shape)))
    if t.tensor_type in (QT.F32, QT.F16, QT.I8, QT.I32, QT.I64):
        return np.asarray(t.data).reshape(shape)
    if t.tensor_type == QT.BF16:
        return np.asarray(t.data).view(np.uint16).astype(np.uint32).__lshift__(16).view(np.float32).reshape(shape)
    return gguf.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)


def _expect_model(got, want):
    for g, w in zip(got, want):
        for key in ("table", "wkv", "q", "k"):
            assert np.array_equal(np.asarray(g[key], dtype=np.float32), np.asarray(w[key], dtype=np.float32)), (w["lid"], key)


def _fp8_split(codes_i8, scales_i8):
    return dequant_e4m3(np.asarray(codes_i8).view(np.uint8), np.asarray(scales_i8).view(np.uint8), 1, 32)


def verify_fixtures(golden, effective, tiny, derived):
    R = lambda f: gguf.GGUFReader(os.path.join(OUT, f))  # noqa: E731
    ckpt, ds4m, dsx = (effective[k]["weights"] for k in ("checkpoint_tiny_hash", "checkpoint_tiny_hash_f16_wkv", "deepstrix"))

    def tiny_hash_ok(tmap, mult, primes, offs, pad):
        assert list(tmap) == tiny["token_map"] and list(mult) == gen.flat(tiny["multipliers"])
        assert list(primes) == gen.flat(tiny["primes"]) and pad == tiny["pad_id"]
        if offs is not None:
            assert list(offs) == gen.flat(tiny["offsets"])

    # vcruz305 split: the three shards hold the ten tensors; shard 1 all metadata.
    readers = [R(f"vcruz305_split-{i:05d}-of-00003.gguf") for i in (1, 2, 3)]
    f0 = _reader_fields(readers[0])
    for i, r in enumerate(readers):
        fl = _reader_fields(r)
        assert fl["split.no"][2] == i and fl["split.count"][2] == 3 and fl["split.tensors.count"][2] == 10
        assert fl["split.no"][0] == VT.UINT16 and fl["split.tensors.count"][0] == VT.INT32
        assert (i == 0) == ("deepseek41.engram.primes" in fl) and (i == 0) == ("general.architecture" in fl)
    k = "deepseek41.engram."
    tiny_hash_ok(f0[k + "token_map"][2], f0[k + "multipliers"][2], f0[k + "primes"][2], f0[k + "offsets"][2], f0[k + "pad_id"][2])
    tens = {t.name: t for r in readers for t in r.tensors}
    got = []
    for lid in LIDS:
        p = f"blk.{lid}."
        got.append({"lid": lid, "table": _tensor_values(tens[p + "engram_embd.weight"]), "wkv": _tensor_values(tens[p + "engram_wkv.weight"]),
                    "q": _tensor_values(tens[p + "engram_q.weight"]), "k": _tensor_values(tens[p + "engram_k.weight"])})
    _expect_model(got, golden)

    # prefix
    r = R("vcruz305_deepseek4_prefix.gguf")
    fl = _reader_fields(r)
    assert fl["general.architecture"][2] == "deepseek41" and not any(x.startswith("deepseek41.engram") for x in fl)
    k = "deepseek4.engram."
    tiny_hash_ok(fl[k + "token_map"][2], fl[k + "multipliers"][2], fl[k + "primes"][2], fl[k + "offsets"][2], fl[k + "pad_id"][2])
    tens = {t.name: t for t in r.tensors}
    got = [{"lid": lid, **{key: _tensor_values(tens[f"blk.{lid}.engram_{n}.weight"]) for key, n in (("table", "embd"), ("wkv", "wkv"), ("q", "q"), ("k", "k"))}} for lid in LIDS]
    _expect_model(got, ckpt)

    # ds4: derive N, H, Hd, offsets as a ds4 reader must.
    r = R("ds4.gguf")
    fl = _reader_fields(r)
    k = "deepseek41.engram."
    assert fl["general.alignment"][2] == DS4_ALIGNMENT and fl[k + "encoding"][2] == ds4_encoding()
    lids = fl[k + "layer_ids"][2]
    mult, primes = fl[k + "multipliers"][2], fl[k + "primes"][2]
    n_ = len(mult) // len(lids)
    h_ = len(primes) // (len(lids) * (n_ - 1))
    row_b = int(fl[k + "encoding"][2].rsplit("row", 1)[1])
    hd_ = row_b * 32 // 33
    assert (n_, h_, hd_) == (N, H, HD) and lids == LIDS
    offs = []
    for li in range(len(lids)):
        acc = 0
        for pr in primes[li * C : (li + 1) * C]:
            offs.append(acc)
            acc += pr
        assert acc == fl[k + "rows"][2][li]
    tmap = [t - (1 << 32) if t == 0xFFFFFFFF else t for t in fl[k + "token_map"][2]]
    tiny_hash_ok(tmap, mult, primes, offs, fl[k + "pad_id"][2])
    tens = {t.name: t for t in r.tensors}
    got = []
    for lid in LIDS:
        p = f"blk.{lid}."
        raw = np.asarray(tens[p + "engram_embd.weight"].data).view(np.uint8)
        assert raw.shape[1] == row_b
        got.append({"lid": lid, "table": _fp8_split(raw[:, :hd_], raw[:, hd_:]), "wkv": _tensor_values(tens[p + "engram_kv.weight"]),
                    "q": _tensor_values(tens[p + "engram_q_norm.weight"]), "k": _tensor_values(tens[p + "engram_k_norm.weight"])})
    _expect_model(got, ds4m)

    # tarruda: pad is raw.
    r = R("tarruda.gguf")
    fl = _reader_fields(r)
    k = "deepseek41.engram."
    tmap = [t - (1 << 32) if t == 0xFFFFFFFF else t for t in fl[k + "token_map"][2]]
    assert fl[k + "pad_token_id"][2] == RAW_PAD_ALIAS
    tiny_hash_ok(tmap, fl[k + "multipliers"][2], fl[k + "head_bucket_sizes"][2], fl[k + "head_offsets"][2], tmap[fl[k + "pad_token_id"][2]])
    assert (fl[k + "ngram_size"][2], fl[k + "head_count"][2], fl[k + "head_dim"][2]) == (N, H, HD)
    tens = {t.name: t for t in r.tensors}
    got = [{"lid": lid, "table": _fp8_split(tens[f"blk.{lid}.engram_embd.weight"].data, tens[f"blk.{lid}.engram_embd_scale.weight"].data),
            "wkv": _tensor_values(tens[f"blk.{lid}.engram_kv.weight"]), "q": _tensor_values(tens[f"blk.{lid}.engram_q_weight.weight"]),
            "k": _tensor_values(tens[f"blk.{lid}.engram_k_weight.weight"])} for lid in LIDS]
    _expect_model(got, ckpt)

    # JigSawPT: constants are tensors; pad raw.
    r = R("jigsawpt.gguf")
    fl = _reader_fields(r)
    tens = {t.name: t for t in r.tensors}
    tmap = _tensor_values(tens["engram_token_map.weight"]).tolist()
    pr = _tensor_values(tens["engram_primes.weight"])
    assert pr.shape == (L, C) and list(tens["engram_primes.weight"].shape) == [C, L]
    tiny_hash_ok(tmap, _tensor_values(tens["engram_multipliers.weight"]).reshape(-1).tolist(), pr.reshape(-1).tolist(),
                 _tensor_values(tens["engram_offsets.weight"]).reshape(-1).tolist(), tmap[fl["deepseek41.engram_pad_token_id"][2]])
    assert fl["deepseek41.engram.present"][2] is True and fl["deepseek41.engram_pad_token_id"][2] == RAW_PAD_ALIAS
    got = [{"lid": lid, "table": _fp8_split(tens[f"blk.{lid}.engram_embd.weight"].data, tens[f"blk.{lid}.engram_embd_scale.weight"].data),
            "wkv": _tensor_values(tens[f"blk.{lid}.engram_wkv.weight"]), "q": _tensor_values(tens[f"blk.{lid}.engram_q.weight"]),
            "k": _tensor_values(tens[f"blk.{lid}.engram_k.weight"])} for lid in LIDS]
    _expect_model(got, ckpt)

    # The checkpoint: decode every engram tensor from the shard bytes.
    ck = os.path.join(OUT, CKPT_DIR)
    with open(os.path.join(ck, "model.safetensors.index.json"), encoding="utf-8") as f:
        wmap = json.load(f)["weight_map"]

    def st(name):
        b, n, hdr = safetensors_header(os.path.join(ck, wmap[name]))
        e = hdr[name]
        a, z = e["data_offsets"]
        raw = np.frombuffer(b[8 + n + a : 8 + n + z], dtype=np.uint8)
        dt = {"F8_E4M3": np.uint8, "F8_E8M0": np.uint8, "BF16": np.uint16, "F32": np.float32}[e["dtype"]]
        return e["dtype"], raw.view(dt).reshape(e["shape"])

    def bf16v(x):
        return (x.astype(np.uint32) << 16).view(np.float32)

    got = []
    for lid in LIDS:
        p = f"layers.{lid}.engram."
        _, codes = st(p + "embed.weight")
        _, sc = st(p + "embed.scale")
        dt, w = st(p + "wkv.weight")
        if dt == "F8_E4M3":
            _, ws = st(p + "wkv.scale")
            wkv = dequant_e4m3(w, ws, 32, 32)
        else:
            wkv = bf16v(w)
        got.append({"lid": lid, "table": dequant_e4m3(codes, sc, 1, 32), "wkv": wkv, "q": bf16v(st(p + "q_weight")[1]), "k": bf16v(st(p + "k_weight")[1])})
    _expect_model(got, ckpt)
    tables = {g["lid"]: g["table"] for g in got}

    # deepstrix: tables through table_shards (basename rebased onto the checkpoint dir).
    r = R("deepstrix-00001-of-00001.gguf")
    fl = _reader_fields(r)
    e = "deepseek4.engram."
    assert fl["general.architecture"][2] == "deepseek4" and fl["split.tensors.count"][2] == -1
    assert fl[e + "pad_id"][2] == derived["pad_token_id"] and fl[e + "compressed_vocab_size"][2] == derived["compressed_vocab_size"]
    tens = {t.name: t for t in r.tensors}
    got = []
    for li, lid in enumerate(LIDS):
        shard = os.path.basename(fl[e + "table_shards"][2][li])
        assert wmap[f"layers.{lid}.engram.embed.weight"] == shard
        got.append({"lid": lid, "table": tables[lid], "wkv": _tensor_values(tens[f"blk.{lid}.engram_wkv.weight"]),
                    "q": _tensor_values(tens[f"blk.{lid}.engram_q.weight"]), "k": _tensor_values(tens[f"blk.{lid}.engram_k.weight"])})
    _expect_model(got, dsx)

    # ds4gw style: rows straight from (path, weight_offset, scale_offset).
    r = R("ds4gw_style.gguf")
    fl = _reader_fields(r)
    tens = {t.name: t for t in r.tensors}
    tiny_hash_ok(_tensor_values(tens["engram.token_map"]).tolist(), _tensor_values(tens["engram.multipliers"]).tolist(),
                 _tensor_values(tens["engram.primes"]).tolist(), _tensor_values(tens["engram.offsets"]).tolist(), fl[e + "pad_id_compressed"][2])
    got = []
    for i, lid in enumerate(LIDS):
        path = os.path.join(ck, os.path.basename(fl[f"{e}{i}.table_path"][2]))
        with open(path, "rb") as f:
            blob = f.read()
        rows = fl[e + "num_embeddings"][2][i]
        wo, so = fl[f"{e}{i}.weight_offset"][2], fl[f"{e}{i}.scale_offset"][2]
        codes = np.frombuffer(blob[wo : wo + rows * HD], dtype=np.uint8).reshape(rows, HD)
        sc = np.frombuffer(blob[so : so + rows * HD // 32], dtype=np.uint8).reshape(rows, HD // 32)
        got.append({"lid": lid, "table": dequant_e4m3(codes, sc, 1, 32), "wkv": _tensor_values(tens[f"blk.{lid}.engram_wkv.weight"]),
                    "q": _tensor_values(tens[f"blk.{lid}.engram_q.weight"]), "k": _tensor_values(tens[f"blk.{lid}.engram_k.weight"])})
    _expect_model(got, ckpt)


# ---------------------------------------------------------------------------
# Bad inputs: one change each, as byte patches (same length) or file operations.
# ---------------------------------------------------------------------------


def mutations(split_files, prefix_file, deepstrix_name):
    out = {}

    def load(f):
        return walk_gguf(os.path.join(OUT, f))

    # vcruz305 (split set: metadata in shard 1).
    s1 = split_files[0]
    b, kv, tn = load(s1)
    out["vcruz305_split"] = [
        mutation("missing_key", [rename_key(s1, kv, b, "deepseek41.engram.head_count", "deepseek41.engram.head_coun_")], "ErrFormat", ["deepseek41.engram.head_count"]),
        mutation("wrong_type_scalar", [retype_key(s1, kv, b, "deepseek41.engram.head_count", 6)], "ErrFormat", ["deepseek41.engram.head_count"], "u32 -> f32"),
        mutation("wrong_type_array", [retype_array(s1, kv, b, "deepseek41.engram.multipliers", 12)], "ErrFormat", ["deepseek41.engram.multipliers"], "u64[] -> f64[]"),
        mutation("primes_disagree_with_offsets", [set_elem(s1, kv, b, "deepseek41.engram.primes", 0, read_value(b, kv["deepseek41.engram.primes"])[0] + 2)], "ErrFormat", ["deepseek41.engram.primes", "deepseek41.engram.offsets"], "offsets are no longer the prefix sums of primes"),
        mutation("offsets_past_table_rows", [set_elem(s1, kv, b, "deepseek41.engram.offsets", C - 1, 10_000)], "ErrFormat", ["deepseek41.engram.offsets", "blk.1.engram_embd.weight"], "the last bucket of layer 1 ends beyond the table's 420 rows"),
        mutation("missing_shard", [{"op": "delete_file", "file": split_files[1]}], "ErrIo", [split_files[1]]),
        mutation("split_no_mismatch", [set_scalar(split_files[2], load(split_files[2])[1], load(split_files[2])[0], "split.no", 1)], "ErrFormat", ["split.no", split_files[2]]),
        mutation("split_count_mismatch", [set_scalar(s1, kv, b, "split.count", 4)], "ErrFormat", ["split.count"], "shard 1 says 4 shards, its name says 3 (llama.cpp derives the other names from the first one's prefix and split.count)"),
        mutation("split_tensors_count_mismatch", [set_scalar(s1, kv, b, "split.tensors.count", 11)], "ErrFormat", ["split.tensors.count"]),
    ]
    b, kv, tn = load(prefix_file)
    out["vcruz305_deepseek4_prefix"] = [
        mutation("missing_key", [rename_key(prefix_file, kv, b, "deepseek4.engram.multipliers", "deepseek4.engram.multiplier_")], "ErrFormat", ["deepseek4.engram.multipliers"]),
        mutation("wrong_type_scalar", [retype_key(prefix_file, kv, b, "deepseek4.engram.pad_id", 6)], "ErrFormat", ["deepseek4.engram.pad_id"], "u32 -> f32"),
    ]
    f = "ds4.gguf"
    b, kv, tn = load(f)
    out["ds4"] = [
        mutation("missing_key", [rename_key(f, kv, b, "deepseek41.engram.primes", "deepseek41.engram.prime_")], "ErrFormat", ["deepseek41.engram.primes"]),
        mutation("wrong_type_scalar", [retype_key(f, kv, b, "deepseek41.engram.compressed_vocab_size", 6)], "ErrFormat", ["deepseek41.engram.compressed_vocab_size"], "u32 -> f32"),
        mutation("wrong_type_array", [retype_array(f, kv, b, "deepseek41.engram.multipliers", 12)], "ErrFormat", ["deepseek41.engram.multipliers"], "u64[] -> f64[]"),
        mutation("rows_disagree_with_primes", [set_elem(f, kv, b, "deepseek41.engram.rows", 0, 421)], "ErrFormat", ["deepseek41.engram.rows", "deepseek41.engram.primes"], "the sum of layer 1's primes is 420"),
        mutation("encoding_disagrees_with_table", [patch(f, kv["deepseek41.engram.encoding"]["value_offset"] + 8, ds4_encoding().encode(), ds4_encoding().replace("row66", "row65").encode())], "ErrFormat", ["deepseek41.engram.encoding", "blk.1.engram_embd.weight"]),
        mutation("table_row_bytes_wrong", [set_dim(f, tn, b, "blk.3.engram_embd.weight", 0, HD + HD // 32 - 1)], "ErrFormat", ["blk.3.engram_embd.weight"], "ne0 65 instead of 66 (scales cut short)"),
        mutation("pad_out_of_range", [set_scalar(f, kv, b, "deepseek41.engram.pad_id", 40)], "ErrFormat", ["deepseek41.engram.pad_id", "deepseek41.engram.compressed_vocab_size"]),
        mutation("multipliers_count", [{"op": "rewrite_array", "file": f, "key": "deepseek41.engram.multipliers", "drop_last": 1}], "ErrFormat", ["deepseek41.engram.multipliers"], "not a same-length patch: rewrite the header with the array one element shorter; |multipliers| must be a multiple of |layer_ids|"),
    ]
    f = "tarruda.gguf"
    b, kv, tn = load(f)
    out["tarruda"] = [
        mutation("missing_key", [rename_key(f, kv, b, "deepseek41.engram.head_offsets", "deepseek41.engram.head_offset_")], "ErrFormat", ["deepseek41.engram.head_offsets"]),
        mutation("wrong_type_scalar", [retype_key(f, kv, b, "deepseek41.engram.ngram_size", 6)], "ErrFormat", ["deepseek41.engram.ngram_size"], "u32 -> f32"),
        mutation("counts_disagree_with_buckets", [set_elem(f, kv, b, "deepseek41.engram.embedding_counts", 1, 509)], "ErrFormat", ["deepseek41.engram.embedding_counts", "deepseek41.engram.head_bucket_sizes"]),
        mutation("scale_wrong_shape", [set_dim(f, tn, b, "blk.1.engram_embd_scale.weight", 0, 1)], "ErrFormat", ["blk.1.engram_embd_scale.weight"], "ne0 1 instead of Hd/32 = 2"),
        mutation("scale_missing", [rename_tensor(f, tn, b, "blk.3.engram_embd_scale.weight", "blk.3.engram_embd_scalX.weight")], "ErrFormat", ["blk.3.engram_embd_scale.weight"]),
        mutation("pad_token_out_of_vocab", [set_scalar(f, kv, b, "deepseek41.engram.pad_token_id", 48)], "ErrFormat", ["deepseek41.engram.pad_token_id"]),
    ]
    f = "jigsawpt.gguf"
    b, kv, tn = load(f)
    out["jigsawpt"] = [
        mutation("missing_key", [rename_key(f, kv, b, "deepseek41.engram_n_heads", "deepseek41.engram_n_head_")], "ErrFormat", ["deepseek41.engram_n_heads"]),
        mutation("missing_constant_tensor", [rename_tensor(f, tn, b, "engram_primes.weight", "engram_primeX.weight")], "ErrFormat", ["engram_primes"]),
        mutation("wrong_type_scalar", [retype_key(f, kv, b, "deepseek41.engram_head_dim", 6)], "ErrFormat", ["deepseek41.engram_head_dim"], "u32 -> f32"),
        mutation("wrong_type_tensor", [retype_tensor(f, tn, b, "engram_primes.weight", 28)], "ErrFormat", ["engram_primes"], "I64 -> F64"),
        mutation("num_embeddings_disagree", [set_elem(f, kv, b, "deepseek41.engram.num_embeddings", 0, 419)], "ErrFormat", ["deepseek41.engram.num_embeddings", "engram_primes"]),
        mutation("scale_wrong_shape", [set_dim(f, tn, b, "blk.3.engram_embd_scale.weight", 1, 507)], "ErrFormat", ["blk.3.engram_embd_scale.weight"], "ne1 507 instead of the table's 508 rows"),
    ]
    f = deepstrix_name
    b, kv, tn = load(f)
    ts = kv["deepseek4.engram.table_shards"]
    first = ts["elems_offset"] + 8
    shard_path = RECORDED_MODEL_DIR + "/" + TABLE_SHARD
    off = first + shard_path.index("00002-of")
    out["deepstrix"] = [
        mutation("missing_key", [rename_key(f, kv, b, "deepseek4.engram.head_dim", "deepseek4.engram.head_di_")], "ErrFormat", ["deepseek4.engram.head_dim"]),
        mutation("table_shard_missing", [patch(f, off, b"00002-of", b"00009-of")], "ErrIo", ["deepseek4.engram.table_shards", "model-00009-of-00002.safetensors"]),
        mutation("wrong_type_scalar", [retype_key(f, kv, b, "deepseek4.engram.head_count", 6)], "ErrFormat", ["deepseek4.engram.head_count"], "u32 -> f32"),
    ]
    f = "ds4gw_style.gguf"
    b, kv, tn = load(f)
    out["ds4gw_style"] = [
        mutation("missing_key", [rename_key(f, kv, b, "deepseek4.engram.1.scale_offset", "deepseek4.engram.1.scale_offse_")], "ErrFormat", ["deepseek4.engram.1.scale_offset"]),
        mutation("offset_past_shard", [set_scalar(f, kv, b, "deepseek4.engram.0.weight_offset", 1 << 40)], "ErrFormat", ["deepseek4.engram.0.weight_offset"]),
        mutation("wrong_type_array", [retype_array(f, kv, b, "deepseek4.engram.num_embeddings", 12)], "ErrFormat", ["deepseek4.engram.num_embeddings"], "u64[] -> f64[]"),
        mutation("wrong_type_tensor", [retype_tensor(f, tn, b, "engram.primes", 28)], "ErrFormat", ["engram.primes"], "I64 -> F64"),
    ]
    ck = CKPT_DIR
    out["checkpoint"] = [
        mutation("missing_config_key", [replace_text(rel(ck, "config.json"), '"engram_n_heads"', '"engram_n_headz"')], "ErrInvalidConfig", ["engram_n_heads"]),
        mutation("config_rows_disagree", [replace_text(rel(ck, "config.json"), "      420,", "      421,")], "ErrFormat", ["engram_num_embeddings", "layers.1.engram.embed.weight"]),
        mutation("scale_wrong_shape", [replace_text(rel(ck, TABLE_SHARD), '"shape":[420,2]', '"shape":[420,1]')], "ErrFormat", ["layers.1.engram.embed.scale"], "same-length edit of the shard's JSON header"),
        mutation("wkv_scale_wrong_shape", [replace_text(rel(ck, CKPT_SHARDS[0]), '"shape":[10,8]', '"shape":[10,7]')], "ErrFormat", ["layers.3.engram.wkv.scale"]),
        mutation("scale_wrong_dtype", [replace_text(rel(ck, TABLE_SHARD), '"F8_E8M0","shape":[508,2]', '"F8_E4M3","shape":[508,2]')], "ErrFormat", ["layers.3.engram.embed.scale"]),
        mutation("missing_shard", [{"op": "delete_file", "file": rel(ck, CKPT_SHARDS[0])}], "ErrIo", [CKPT_SHARDS[0]]),
        mutation("index_names_wrong_shard", [replace_text(rel(ck, "model.safetensors.index.json"), '"layers.1.engram.embed.weight": "model-00002-of-00002.safetensors"', '"layers.1.engram.embed.weight": "model-00001-of-00002.safetensors"')], "ErrFormat", ["layers.1.engram.embed.weight", CKPT_SHARDS[0]]),
    ]
    # Every text replacement must hit exactly once.
    for fx, muts in out.items():
        for mu in muts:
            for op in mu["ops"]:
                if op["op"] == "replace_text":
                    with open(os.path.join(OUT, op["file"]), "rb") as fh:
                        data = fh.read()
                    assert data.count(op["old"].encode()) == 1, (fx, mu["name"], op["old"])
                    assert len(op["old"]) == len(op["new"]), (fx, mu["name"])
                if op["op"] == "patch":
                    with open(os.path.join(OUT, op["file"]), "rb") as fh:
                        data = fh.read()
                    o = op["offset"]
                    assert data[o : o + len(op["old_hex"]) // 2].hex() == op["old_hex"], (fx, mu["name"])
    return out


if __name__ == "__main__":
    main()
