"""Shared fixtures: the golden's data and its deterministic filler in numpy.

The filler (tests/golden/README.md, "The filler") rebuilds the highway
inputs and the tiny model's `wkv` from their names, as the Rust and C golden
tests do; it is checked against tiny.json's own `filler_check`.
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest

import engram

ROOT = Path(os.environ.get("ENGRAM_SOURCE_DIR") or Path(__file__).resolve().parents[2])
DATA = ROOT / "tests" / "golden" / "data"
TINY_GGUF = DATA / "tiny.gguf"
EPS = float(np.uint32(897988541).view(np.float32))  # f32(1e-6), the golden's eps

M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def fnv1a64(data: bytes) -> np.uint64:
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return np.uint64(h)


def mix64(z: np.ndarray) -> np.ndarray:
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def bits(name: str, n: int) -> np.ndarray:
    i = np.arange(n, dtype=np.uint64)
    return mix64(np.full(n, fnv1a64(("engram-golden-v1:" + name).encode()), dtype=np.uint64) ^ mix64(i))


def values(name: str, n: int, scale: float, offset: float) -> np.ndarray:
    """value(name, i, scale, offset) for i in [0, n), float32."""
    unit = ((bits(name, n) >> np.uint64(40)).astype(np.int64) - (1 << 23)).astype(np.float32) / np.float32(1 << 23)
    return np.float32(offset) + np.float32(scale) * unit


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)).astype(np.uint16)


def bf16_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


@pytest.fixture(scope="session")
def golden():
    with open(DATA / "tiny.json", encoding="utf-8") as f:
        g = json.load(f)
    fc = g["filler_check"]
    n = len(fc["bits"])
    assert [int(b) for b in bits(fc["name"], n)] == fc["bits"], "filler bits differ from the generator's"
    got = values(fc["name"], n, fc["value_scale"], fc["value_offset"]).view(np.uint32)
    assert got.tolist() == fc["value_f32"], "filler values differ from the generator's"
    return g


@pytest.fixture
def tiny():
    with engram.Context.from_gguf(TINY_GGUF, eps=EPS, n_threads=2) as ctx:
        yield ctx
