#!/usr/bin/env python3
"""Reference data for the Rust derivation of the hash tables (src/tables/).

Writes, under data/ next to this file:
  v41_config.json          the engram block of a DeepSeek-V4.1-Flash config.json
                           (nested in text_config, as released), for the Rust tests;
  demo_config.json         an Engram-demo style config (its EngramConfig names,
                           engram_vocab_size as a list, a nonzero seed);
  tables_expected.json     what numpy and the reference derivation give for them:
                           numpy_integers captures beyond gen.py's (the 32-bit
                           Lemire path, ranges at the 2^32 boundary, several calls
                           on one generator, large seeds) and the demo config's
                           multipliers, primes, offsets and rows with the DeepSeek
                           tokenizer's map.

It reuses gen.py's derivation (token map, primes) so that both follow one
reading of the reference. Deterministic: two runs write the same bytes.
"""

import hashlib
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data")
sys.path.insert(0, HERE)

import gen  # noqa: E402  (the golden generator: token map, primes, dump)

V41_CONFIG = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "text_config": {
        "model_type": "deepseek_v41_text",
        "vocab_size": 129280,
        "hidden_size": 5120,
        "hc_mult": 4,
        "engram_layer_ids": [1, 14],
        "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4,
        "engram_vocab_size": 16000000,
        "engram_n_heads": 8,
        "engram_head_dim": 256,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 99092,
    },
}

DEMO_CONFIG = {
    "tokenizer_name_or_path": "deepseek-ai/DeepSeek-V3",
    "engram_vocab_size": [129280 * 5, 129280 * 3],
    "max_ngram_size": 3,
    "n_embed_per_ngram": 512,
    "n_head_per_ngram": 8,
    "layer_ids": [1, 15],
    "pad_id": 2,
    "seed": 7,
    "kernel_size": 4,
}


def numpy_captures():
    out = []
    # (seed, [(low, high, size), ...]) drawn in order from one generator.
    cases = [
        (0, [(0, 1000, 7)]),
        (1, [(0, 2**32, 5)]),
        (2, [(0, 2**32 - 1, 5)]),
        (3, [(0, 2**32 + 1, 5)]),
        (4, [(-5, 2**32 - 10, 6)]),
        (5, [(0, 3, 9), (0, 2**40, 3), (10, 11, 2), (0, 17, 5)]),
        (6, [(-(2**63), 2**63 - 1, 4)]),
        (12345, [(0, 2**62, 4)]),
        (2**32 + 5, [(0, 46_543_671_186_838, 4)]),
        (2**70 + 3, [(0, 1 << 20, 6)]),
        (10007 * 1000, [(0, 7, 4)]),
    ]
    for seed, calls in cases:
        g = np.random.default_rng(seed)
        rec = {"seed": str(seed), "calls": []}  # a string: seeds pass 2^64
        for low, high, size in calls:
            vals = g.integers(low, high, size=size, dtype=np.int64)
            rec["calls"].append({"low": low, "high": high, "size": size, "values": [int(v) for v in vals]})
        out.append(rec)
    return out


def demo_expected(tok_map, count):
    c = DEMO_CONFIG
    n = c["max_ngram_size"]
    half = max(1, (2**63 - 1) // count // 2)
    mult = []
    for lid in c["layer_ids"]:
        r = np.random.default_rng(c["seed"] + 10007 * lid).integers(0, half, size=n, dtype=np.int64)
        mult += [int(v) * 2 + 1 for v in r]
    # gen.engram_primes takes one size for every n-gram; the demo has one per n-gram.
    taken, primes = set(), []
    for _ in c["layer_ids"]:
        for size in c["engram_vocab_size"]:
            cur = size - 1
            for _h in range(c["n_head_per_ngram"]):
                p = cur + 1
                while not (gen.is_prime(p) and p not in taken):
                    p += 1
                taken.add(p)
                primes.append(p)
                cur = p
    cols = (n - 1) * c["n_head_per_ngram"]
    offsets, rows = [], []
    for l in range(len(c["layer_ids"])):
        acc = 0
        for p in primes[l * cols : (l + 1) * cols]:
            offsets.append(acc)
            acc += p
        rows.append(acc)
    return {
        "compressed_count": count,
        "pad_id": tok_map[c["pad_id"]],
        "multiplier_half": half,
        "multipliers": mult,
        "primes": primes,
        "offsets": offsets,
        "rows": rows,
        "head_dim": c["n_embed_per_ngram"] // c["n_head_per_ngram"],
    }


def main():
    from tokenizers import Tokenizer

    src = gen.tokenizer_json_path()
    committed = os.path.join(DATA, "deepseek_v4_tokenizer.json")
    with open(src, "rb") as f:
        a = hashlib.sha256(f.read()).hexdigest()
    with open(committed, "rb") as f:
        b = hashlib.sha256(f.read()).hexdigest()
    assert a == b, "data/deepseek_v4_tokenizer.json differs from the installed package's tokenizer.json"
    tok = Tokenizer.from_file(committed)
    tmap, count, _stats = gen.v41_token_map(tok)
    assert count == gen.V41_COMPRESSED

    gen.write(os.path.join(DATA, "v41_config.json"), json.dumps(V41_CONFIG, indent=2))
    gen.write(os.path.join(DATA, "demo_config.json"), json.dumps(DEMO_CONFIG, indent=2))
    out = {"numpy_integers": numpy_captures(), "demo": demo_expected(tmap, count)}
    gen.write(os.path.join(DATA, "tables_expected.json"), gen.dump(out))
    for name in ("v41_config.json", "demo_config.json", "tables_expected.json"):
        print(f"{name}: {os.path.getsize(os.path.join(DATA, name))} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
