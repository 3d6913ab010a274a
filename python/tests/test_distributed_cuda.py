"""The distributed test of test_distributed.py on the CUDA backend, run on
its SIMT emulation (the CUDA backend's own code, its kernels compiled as host
C++: src/cuda/emu.rs): torch.distributed (gloo, this machine), worlds 1..5,
each rank a CUDA shard context of the tiny model with its tables, ``wkv``,
q, k, highway and split-call buffers in (emulated) device memory, the rows
or ``kv`` copied to the host for gloo's collectives and back (as an engine
without NCCL would):

- row ranges: ``engram_gather_rows`` of the rows it holds, ``all_reduce``
  (sum), ``engram_apply_rows``;
- heads: ``engram_gather_rows`` of its heads, ``all_gather`` (padded),
  joined in head order, ``engram_apply_rows``;
- wkv outputs: ``engram_kv_columns`` of the outputs it holds,
  ``all_gather`` (padded), joined, ``engram_gate_from_kv``;

and on every rank, for both layers:

- each layout's highway equals the unsharded CUDA ``apply`` of the same step
  bit for bit;
- what the collective assembled equals the CPU backend's bits: the rows
  (row ranges, heads) its ``gather_rows``, the joined ``kv`` (wkv outputs)
  the CUDA ``read_back``'s, whose rows and ``kv`` equal the CPU backend's;
- the unsharded CUDA highway is within the golden tests' bound of the CPU
  backend's, not its bits: the CUDA gate kernel sums its f32 dot products in
  another order than the CPU's (docs/testing.md, "Tolerances"; here 366 and
  239 of the 2048 values differ, by at most 4.8e-7).

The model is the golden's tiny model with both layers' ``wkv`` in bf16 (an
fp8 and a bf16 table): the split calls on CUDA refuse an f32 ``wkv``
(docs/sharding.md).

The emulation is reached through ``libengram_emu.so`` (tools/engram-emu: the
C ABI plus ``engram_emu_*`` calls; libengram.so has no door to it), which
python/test.sh names in ``ENGRAM_LIBRARY`` for this file only; it builds
the SIMT library into ``ENGRAM_SIMT_DIR`` (default: ``tmp/`` beside the
library's ``debug/``, where the Rust tests build the same one) or finds it
there, once, in this process, which never launches a kernel itself: each
forked rank starts the emulation's worker threads (threads do not survive a
fork). Skipped, with
the reason, when torch is missing, when ``ENGRAM_LIBRARY`` is not that
library, or where there is no g++ to build the emulation; the last two fail
instead under ``ENGRAM_REQUIRE_EMULATION=1`` (scripts/test.sh).
"""

import ctypes
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
mp = pytest.importorskip("torch.multiprocessing")

import engram  # noqa: E402
from engram._context import _check, _init  # noqa: E402
from engram._lib import S, lib  # noqa: E402

from conftest import EPS, bf16, values  # noqa: E402
from test_distributed import LAYOUTS, POS, SEQS, TOKENS, Traffic, free_port, gather_padded, part  # noqa: E402
from test_golden import tiny_weights  # noqa: E402

REQUIRED = os.environ.get("ENGRAM_REQUIRE_EMULATION") == "1"
F32 = int(engram.Type.F32)
# Kernels each layout's calls must have launched on the emulation (the CUDA
# backend's own, not a host fallback).
KERNELS = ("engram_gather_shard", "engram_convert_values", "engram_decode_bf16", "engram_gemv_bf16_8",
           "engram_gate_f32_bf16")


class Emu:
    """The ``engram_emu_*`` calls of libengram_emu.so: emulated device memory."""

    def __init__(self):
        c = ctypes
        for name, res, args in (
            ("engram_emu_load", c.c_int, [c.c_char_p]),
            ("engram_emu_last_error", c.c_char_p, []),
            ("engram_emu_alloc", c.c_int, [c.c_size_t, c.POINTER(c.c_uint64)]),
            ("engram_emu_free", c.c_int, [c.c_uint64]),
            ("engram_emu_upload", c.c_int, [c.c_uint64, c.c_void_p, c.c_size_t]),
            ("engram_emu_download", c.c_int, [c.c_void_p, c.c_uint64, c.c_size_t]),
            ("engram_emu_launches", c.c_uint64, [c.c_char_p]),
        ):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        self.held = []

    def check(self, status, what):
        if status != 0:
            raise engram.EngramError(status, lib.engram_emu_last_error().decode(), what)

    def alloc(self, nbytes):
        p = ctypes.c_uint64()
        self.check(lib.engram_emu_alloc(nbytes, ctypes.byref(p)), "engram_emu_alloc")
        self.held.append(p.value)
        return p.value

    def upload(self, a):
        a = np.ascontiguousarray(a)
        p = self.alloc(a.nbytes)
        self.check(lib.engram_emu_upload(p, a.ctypes.data, a.nbytes), "engram_emu_upload")
        return p

    def download(self, p, shape, dtype):
        out = np.empty(shape, dtype=dtype)
        self.check(lib.engram_emu_download(out.ctypes.data, p, out.nbytes), "engram_emu_download")
        return out

    def free_all(self):
        for p in self.held:
            self.check(lib.engram_emu_free(p), "engram_emu_free")
        self.held = []

    def launches(self, kernel):
        return int(lib.engram_emu_launches(kernel.encode()))


def model(golden):
    """The tiny model's constants and its layers' weights, both ``wkv`` in bf16."""
    m = golden["model"]
    weights = tiny_weights(m)
    for w in weights.values():
        if w["wkv_type"] == engram.Type.F32:
            w["wkv"], w["wkv_type"] = bf16(w["wkv"]).reshape(w["wkv"].shape), engram.Type.BF16
    return m, weights


def create(m, backend):
    return engram.Context.create(
        hidden_size=m["D"], hc=m["hc"], head_dim=m["Hd"], n_heads=m["H"], max_ngram=m["N"],
        layer_ids=m["layer_ids"], token_map=m["token_map"], pad_id=m["pad_id"],
        multipliers=np.array(m["multipliers"], dtype=np.uint64), primes=m["primes"], offsets=m["offsets"],
        eps=EPS, backend=backend, max_tokens=16, max_seqs=2, max_positions=64,
    )


def cuda_context(emu, m, weights):
    """A CUDA context (on the emulation) with every layer's weights in device memory."""
    ctx = create(m, "cuda")
    for lid, w in weights.items():
        lw = _init(S.engram_layer_weights, "engram_layer_weights_init_sized")
        lw.layer_id, lw.table_rows = lid, w["table"].shape[0]
        lw.table, lw.table_type = emu.upload(w["table"]), int(w["table_type"])
        lw.wkv, lw.wkv_type = emu.upload(w["wkv"]), int(w["wkv_type"])
        lw.q, lw.k, lw.qk_type = emu.upload(w["q"]), emu.upload(w["k"]), int(w["qk_type"])
        _check(lib.engram_set_layer(ctx._ctx(), ctypes.byref(lw)), "engram_set_layer")
    return ctx


def run_layout(emu, ref, m, weights, ids, rank, world, layout):
    """One layout on this rank: ``({layer_id: highway}, {layer_id: what the
    collective assembled})`` (host copies; the rows ``[n, C*Hd]``, or for
    ``wkv`` the ``kv`` ``[n, D*(hc+1)]``, as f32)."""
    ctx = cuda_context(emu, m, weights)
    table = (rank, world) if layout in ("rows", "both") else (0, 1)
    ctx.set_shard(table=table, wkv=(rank, world) if layout in ("wkv", "both") else (0, 1))
    n, (d, hc, hd, cols) = len(TOKENS), (m["D"], m["hc"], m["Hd"], m["C"])
    nh, n1, k_in, k_out = m["H"], m["N"] - 1, cols * m["Hd"], d * (hc + 1)
    idp = (ids.ctypes.data, ids.size)
    traffic = Traffic()
    out, joined = {}, {}
    for li, lid in enumerate(m["layer_ids"]):
        hw = emu.upload(ref["x"])
        hw_arg = (hw, ref["x"].nbytes, F32)
        if layout in ("rows", "both"):
            (r0, r1), _ = ctx.shard_held(lid)
            dev = emu.alloc(n * k_in * 4)
            ctx._gather_rows_raw(lid, idp, n, (r0, r1), (0, nh), (dev, n * k_in, F32))
            rows = torch.from_numpy(emu.download(dev, (n, k_in), np.float32))
            traffic.all_reduce(rows)
        elif layout == "heads":
            h0, h1 = part(nh, rank, world)
            mine = torch.zeros((n, n1, h1 - h0, hd))
            if h0 < h1:
                dev = emu.alloc(mine.numel() * 4)
                ctx._gather_rows_raw(lid, idp, n, (0, m["rows"][li]), (h0, h1), (dev, mine.numel(), F32))
                mine = torch.from_numpy(emu.download(dev, tuple(mine.shape), np.float32))
            parts = gather_padded(mine.permute(2, 0, 1, 3).contiguous(), world, -(-nh // world), traffic)
            heads = [parts[r][: part(nh, r, world)[1] - part(nh, r, world)[0]] for r in range(world)]
            rows = torch.cat(heads, dim=0).permute(1, 2, 0, 3).contiguous().reshape(n, -1)
        if layout in ("rows", "heads"):
            ctx._apply_rows_raw(lid, idp, n, (emu.upload(rows.numpy()), n * k_in, F32), hw_arg)
            joined[lid] = rows.numpy()
        else:
            src = emu.upload(rows.numpy()) if layout == "both" else emu.upload(ref[f"rows{lid}"])
            _, (o0, o1) = ctx.shard_held(lid)
            dev = emu.alloc(n * (o1 - o0) * 4)
            ctx._kv_columns_raw(lid, n, (src, n * k_in, F32), (o0, o1), (dev, n * (o1 - o0), F32))
            kv = torch.from_numpy(emu.download(dev, (n, o1 - o0), np.float32))
            parts = gather_padded(kv.t().contiguous(), world, k_out, traffic)
            sizes = [torch.empty(1, dtype=torch.int64) for _ in range(world)]
            traffic.all_gather(sizes, torch.tensor([o1 - o0], dtype=torch.int64))
            kv_all = torch.cat([parts[r][: int(sizes[r])] for r in range(world)], dim=0).t().contiguous()
            ctx._gate_from_kv_raw(lid, idp, n, (emu.upload(kv_all.numpy()), n * k_out, F32), hw_arg)
            joined[lid] = kv_all.numpy()
        ctx.check()
        out[lid] = emu.download(hw, ref["x"].shape, np.float32)
    ctx.close()
    return out, joined


def whole_cuda_apply(emu, ref, m, weights):
    """The unsharded CUDA context's step: ``(row ids, {layer_id: highway},
    {layer_id: read_back's (rows, kv)})``."""
    ctx = cuda_context(emu, m, weights)
    ids = ctx.hash(TOKENS, SEQS, POS)
    out, back = {}, {}
    for lid in m["layer_ids"]:
        hw = emu.upload(ref["x"])
        ctx._apply_raw(lid, (ids.ctypes.data, ids.size), len(TOKENS), (hw, ref["x"].nbytes, F32), None)
        ctx.check()
        out[lid] = emu.download(hw, ref["x"].shape, np.float32)
        back[lid] = ctx.read_back(lid, ids)
    ctx.close()
    return ids, out, back


def same(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def near_cpu(got, ref, lid):
    """The CUDA highway against the CPU backend's: dead tokens untouched,
    live ones within the golden tests' f32 bound, 2^-6 (1 + |ref|)
    (python/tests/test_golden.py, c_tests/test_golden.c). Not bits: the two
    backends sum the gate's f32 dot products in different orders."""
    want = ref[f"hw{lid}"]
    dead = np.array(TOKENS) == engram.TOKEN_DEAD
    err = np.abs(got.astype(np.float64) - want)
    return same(got[dead], ref["x"][dead]) and bool((err[~dead] <= 2.0**-6 * (1 + np.abs(want[~dead]))).all())


def check_rank(emu, ref, m, weights, rank, world):
    """Every check of one rank: ``{check: [layer ids that fail it]}``."""
    ids, whole, back = whole_cuda_apply(emu, ref, m, weights)
    live = np.array(TOKENS) != engram.TOKEN_DEAD
    lids = m["layer_ids"]
    bad = {
        "cuda read_back rows and kv == the cpu's": [
            lid for lid in lids
            if not all(np.array_equal(a, ref[f"back{i}_{lid}"]) for i, a in enumerate(back[lid]))],
        "cuda highway near the cpu's": [lid for lid in lids if not near_cpu(whole[lid], ref, lid)],
    }
    for layout in LAYOUTS:
        got, joined = run_layout(emu, ref, m, weights, ids, rank, world, layout)
        bad[f"{layout}: highway == the whole cuda apply's"] = [lid for lid in lids if not same(got[lid], whole[lid])]
        if layout in ("wkv", "both"):
            # bf16 values as f32: the high halves are read_back's kv (live tokens).
            bad[f"{layout}: joined kv == cuda read_back's"] = [
                lid for lid in lids
                if (joined[lid].view(np.uint32) & 0xFFFF).any()
                or not np.array_equal((joined[lid].view(np.uint32) >> 16)[live], back[lid][1][live])]
        else:
            bad[f"{layout}: joined rows == the cpu's"] = [
                lid for lid in lids if not same(joined[lid], ref[f"rows{lid}"])]
    return bad


def run_rank(rank, world, port, ref_path, golden, result_path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        emu = Emu()
        m, weights = model(golden)
        bad = check_rank(emu, np.load(ref_path), m, weights, rank, world)
        emu.free_all()
        launches = {k: emu.launches(k) for k in KERNELS}
        with open(f"{result_path}.{rank}", "w") as f:
            f.write(repr((bad, launches)))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def emulation():
    """The emulation loaded in this process (built if needed; its kernels
    never launched here, so the forked ranks start its threads themselves)."""
    if not hasattr(lib, "engram_emu_load"):
        why = (f"ENGRAM_LIBRARY={os.environ.get('ENGRAM_LIBRARY', '(unset)')} is not libengram_emu.so "
               "(tools/engram-emu); python/test.sh runs this file with it")
        if REQUIRED:
            pytest.fail(f"ENGRAM_REQUIRE_EMULATION=1 but {why}")
        pytest.skip(why)
    emu = Emu()
    simt_dir = os.environ.get("ENGRAM_SIMT_DIR") or os.path.join(os.path.dirname(os.environ["ENGRAM_LIBRARY"]),
                                                                 "..", "tmp")
    status = lib.engram_emu_load(os.fsencode(simt_dir))
    if status == int(engram.Status.ERR_UNSUPPORTED):
        why = lib.engram_emu_last_error().decode()
        if REQUIRED:
            pytest.fail(f"ENGRAM_REQUIRE_EMULATION=1 but {why}")
        pytest.skip(why)
    emu.check(status, "engram_emu_load")
    return emu


@pytest.fixture(scope="module")
def reference(golden, tmp_path_factory):
    """The CPU backend's whole-layer apply of the step, and its gathered rows."""
    path = tmp_path_factory.mktemp("dist_cuda") / "ref.npz"
    m, weights = model(golden)
    with create(m, "cpu") as ctx:
        for lid, w in weights.items():
            ctx.set_layer(lid, **w)
        n = len(TOKENS)
        ids = ctx.hash(TOKENS, SEQS, POS)
        x = values("dist.highway", n * m["hc"] * m["D"], 1.0, 0.0).reshape(n, m["hc"], m["D"])
        arrays = {"x": x}
        for lid in m["layer_ids"]:
            arrays[f"hw{lid}"] = ctx.apply(lid, ids, x.copy())
            arrays[f"rows{lid}"] = ctx.gather_rows(lid, ids).reshape(n, -1)
            arrays[f"back0_{lid}"], arrays[f"back1_{lid}"] = ctx.read_back(lid, ids)
    np.savez(path, **arrays)
    return str(path)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_sharded_on_the_cuda_emulation_equals_the_whole_layer(emulation, reference, golden, tmp_path, world):
    result = str(tmp_path / "result")
    mp.start_processes(run_rank, args=(world, free_port(), reference, golden, result), nprocs=world, join=True,
                       start_method="fork")
    for r in range(world):
        with open(f"{result}.{r}") as f:
            bad, launches = eval(f.read())
        assert len(bad) == 2 + 2 * len(LAYOUTS) and not any(bad.values()), \
            f"world {world}, rank {r}: the layers that fail each check: {bad}"
        assert all(launches.values()), f"world {world}, rank {r}: kernels not launched on the emulation: {launches}"
