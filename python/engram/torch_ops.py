"""torch ops over engram contexts (``pip install ./python[torch]``).

Importing this module registers custom ops in the ``engram`` namespace with
``torch.library`` (so ``torch.compile`` keeps them as opaque calls, traced
through their fake implementations), each over tensors read and written in
place through their ``data_ptr`` (no copies):

- ``torch.ops.engram.hash(ctx, tokens, seq_ids, pos) -> row_ids``
  (``int32`` inputs, ``int64 [n, n_layers, C]`` out): host tensors hash on
  the host (``engram_hash``, any backend); CUDA tensors hash on the device
  (``engram_hash_device_checked``: a CUDA context with ``device_history``),
  the row ids then stay on the device;
- ``torch.ops.engram.apply_(ctx, layer_id, row_ids, highway)``: the
  highway (``float32`` or ``bfloat16``, ``[n, hc, D]``) updated in place;
  CPU ``row_ids`` go through ``engram_apply_checked``, CUDA ``row_ids``
  through ``engram_apply_device_ids_checked`` (nothing read on the host:
  capturable in a CUDA graph; a host table needs :func:`stage` first);
- the split points (docs/sharding.md): ``gather_rows(ctx, layer_id, row_ids,
  row_begin, row_end, head_begin, head_end) -> float32 [n, N-1, heads, Hd]``,
  ``kv_columns(ctx, layer_id, rows, out_begin, out_end) -> float32 [n, outs]``,
  ``gate_from_kv_(ctx, layer_id, row_ids, kv, highway)`` and
  ``apply_rows_(ctx, layer_id, row_ids, rows, highway)``; their ``row_ids``
  are host memory on every backend (the C ABI reads them on the host).

``ctx`` is the integer :func:`register` returns for an
:class:`engram.Context` (a custom op takes tensors and numbers, not Python
objects). Memory follows the context's backend: on the CPU backend every
tensor is a CPU tensor; on the CUDA backend the highway, ``rows``, ``kv``
and the outputs are CUDA tensors of the context's device (its ordinal), and
the work is queued on torch's current stream of that device. A tensor in
the wrong memory, or on another device, is refused with ``ValueError``
before any call. Not yet run on a GPU (docs/python.md).
"""

from __future__ import annotations

import ctypes
from typing import Dict, Optional, Sequence, Tuple

import torch

from ._context import Backend, Context, Type
from ._lib import P_I32, P_I64, lib
from ._context import _check

_CONTEXTS: Dict[int, Context] = {}


def register(ctx: Context) -> int:
    """The handle the ops take for ``ctx`` (kept alive until :func:`unregister`)."""
    h = int(ctx._ctx())
    _CONTEXTS[h] = ctx
    return h


def unregister(handle: int) -> None:
    """Forget a handle (the context itself is closed by its owner)."""
    _CONTEXTS.pop(handle, None)


def _get(handle: int) -> Context:
    try:
        return _CONTEXTS[handle]
    except KeyError:
        raise ValueError(f"engram: no registered context {handle} (engram.torch_ops.register)") from None


def _cuda(c: Context) -> bool:
    return c.backend == Backend.CUDA


def _contiguous(t: torch.Tensor, what: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{what}: the tensor is not contiguous (it would be copied, not used in place)")


def _host(t: torch.Tensor, what: str) -> None:
    """``t`` must be host memory (the C ABI reads it on the host)."""
    if t.device.type != "cpu":
        raise ValueError(f"{what}: a {t.device} tensor; this call reads it on the host (a CPU tensor)")
    _contiguous(t, what)


def _on_device(c: Context, t: torch.Tensor, what: str) -> None:
    """``t`` must be a CUDA tensor of the context's device (the context is CUDA)."""
    if t.device.type != "cuda":
        raise ValueError(f"{what}: a {t.device} tensor; this context's backend (CUDA, device {c.device}) "
                         "needs a CUDA tensor of that device")
    if t.device.index != c.device:
        raise ValueError(f"{what}: on {t.device}, but the context is on cuda:{c.device}")
    _contiguous(t, what)


def _backend_mem(c: Context, t: torch.Tensor, what: str) -> None:
    """``t`` must be in the backend's memory: host for CPU, the context's device for CUDA."""
    if _cuda(c):
        _on_device(c, t, what)
    elif t.device.type != "cpu":
        raise ValueError(f"{what}: a {t.device} tensor given to a CPU-backend context (create it with "
                         "backend='cuda' to pass device memory)")
    else:
        _contiguous(t, what)


def _device(c: Context) -> torch.device:
    """Where the context's outputs live."""
    return torch.device("cuda", c.device) if _cuda(c) else torch.device("cpu")


def _stream(device: torch.device) -> int:
    """torch's current stream on ``device`` as a ``cudaStream_t`` address."""
    return int(torch.cuda.current_stream(device).cuda_stream)


def _call_stream(c: Context) -> Optional[int]:
    """The stream a call on ``c`` queues on: torch's current one (CUDA), none (CPU)."""
    return _stream(_device(c)) if _cuda(c) else None


def _empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device=device)


def _values(c: Context, t: torch.Tensor, what: str) -> Tuple[int, int, int]:
    """``(address, elements, engram type)`` of a float32 or bfloat16 tensor in the backend's memory."""
    _backend_mem(c, t, what)
    if t.dtype == torch.float32:
        ty = int(Type.F32)
    elif t.dtype == torch.bfloat16:
        ty = int(Type.BF16)
    else:
        raise TypeError(f"{what}: dtype {t.dtype}, expected torch.float32 or torch.bfloat16")
    return t.data_ptr(), t.numel(), ty


def _ids(c: Context, t: torch.Tensor, device_ok: bool = False) -> Tuple[Tuple[int, int], int, bool]:
    """``((address, len), n_tokens, on_device)`` of int64 row ids: host
    memory, or (``device_ok``, CUDA context) the context's device."""
    if device_ok and t.device.type != "cpu":
        if not _cuda(c):
            raise ValueError(f"row_ids: a {t.device} tensor given to a CPU-backend context")
        _on_device(c, t, "row_ids")
    else:
        _host(t, "row_ids")
    if t.dtype != torch.int64:
        raise TypeError(f"row_ids: dtype {t.dtype}, expected torch.int64")
    per = c.row_ids_per_token
    if t.numel() % per:
        raise ValueError(f"row_ids: {t.numel()} elements, not a multiple of {per} per token")
    return (t.data_ptr(), t.numel()), t.numel() // per, t.device.type != "cpu"


def _highway(c: Context, t: torch.Tensor, n: int) -> Tuple[int, int, int]:
    addr, count, ty = _values(c, t, "highway")
    d, hc = c._geom[0], c._geom[1]
    if count != n * hc * d:
        raise ValueError(f"highway: {count} elements, expected {n * hc * d} ({n} tokens x [hc {hc}, D {d}])")
    return addr, count * t.element_size(), ty


def stage(ctx: int, layer_id: int, row_ids: torch.Tensor) -> None:
    """``engram_stage``: before each replay of a CUDA graph that applies
    layer ``layer_id`` with device row ids over a table in host memory or a
    file, stage the rows of the step's host ``row_ids`` on torch's current
    stream (not while capturing; not an op: it cannot be captured)."""
    c = _get(ctx)
    ids, n, _ = _ids(c, row_ids)
    c._stage_raw(layer_id, ids, n, _call_stream(c))


def _hash(ctx: int, tokens: torch.Tensor, seq_ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``engram_hash`` (CPU tensors) or ``engram_hash_device_checked`` (CUDA
    tensors of a CUDA context's device): row ids ``int64 [n, n_layers, C]``
    where the inputs are; records the positions in the context's history."""
    c = _get(ctx)
    on_device = tokens.device.type != "cpu"
    for t, w in ((tokens, "tokens"), (seq_ids, "seq_ids"), (pos, "pos")):
        if on_device:
            if not _cuda(c):
                raise ValueError(f"{w}: a {t.device} tensor given to a CPU-backend context")
            _on_device(c, t, w)
        else:
            _host(t, w)
        if t.dtype != torch.int32:
            raise TypeError(f"{w}: dtype {t.dtype}, expected torch.int32")
    n = tokens.numel()
    if seq_ids.numel() != n or pos.numel() != n:
        raise ValueError(f"tokens, seq_ids, pos: {n}, {seq_ids.numel()}, {pos.numel()} elements (must be equal)")
    _, _, _, cols, n_layers = c._geom
    out = _empty((n, n_layers, cols), torch.int64, tokens.device)
    if on_device:
        c._hash_device_raw(tokens.data_ptr(), seq_ids.data_ptr(), pos.data_ptr(), n,
                           (out.data_ptr(), out.numel()), _stream(tokens.device))
        return out
    p = lambda t, ty: ctypes.cast(t.data_ptr(), ty)  # noqa: E731
    _check(lib.engram_hash(c._ctx(), p(tokens, P_I32), p(seq_ids, P_I32), p(pos, P_I32), n, p(out, P_I64),
                           out.numel()), "engram_hash")
    return out


hash = torch.library.custom_op("engram::hash", mutates_args=())(_hash)


@hash.register_fake
def _(ctx: int, tokens: torch.Tensor, seq_ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    _, _, _, cols, n_layers = _get(ctx)._geom
    return tokens.new_empty((tokens.shape[0], n_layers, cols), dtype=torch.int64)


def _apply(ctx: int, layer_id: int, row_ids: torch.Tensor, highway: torch.Tensor) -> None:
    """Layer ``layer_id`` applied to ``highway`` in place: host ``row_ids``
    through ``engram_apply_checked``, device ones (CUDA context) through
    ``engram_apply_device_ids_checked``; on CUDA, on torch's current stream."""
    c = _get(ctx)
    ids, n, on_device = _ids(c, row_ids, device_ok=True)
    c._apply_raw(layer_id, ids, n, _highway(c, highway, n), _call_stream(c), device_ids=on_device)


apply_ = torch.library.custom_op("engram::apply_", mutates_args=("highway",))(_apply)


@apply_.register_fake
def _(ctx: int, layer_id: int, row_ids: torch.Tensor, highway: torch.Tensor) -> None:
    return None


def _gather_rows(ctx: int, layer_id: int, row_ids: torch.Tensor, row_begin: int, row_end: int,
                 head_begin: int, head_end: int) -> torch.Tensor:
    """``engram_gather_rows``: ``float32 [n, N-1, head_end-head_begin, Hd]``
    in the backend's memory, ``-0.0`` outside ``[row_begin, row_end)`` (sum
    it over ranks with ``all_reduce``); ``row_ids`` on the host."""
    c = _get(ctx)
    ids, n, _ = _ids(c, row_ids)
    out = _gather_out(c, n, head_begin, head_end)
    c._gather_rows_raw(layer_id, ids, n, (row_begin, row_end), (head_begin, head_end),
                       (out.data_ptr(), out.numel(), int(Type.F32)), _call_stream(c))
    return out


gather_rows = torch.library.custom_op("engram::gather_rows", mutates_args=())(_gather_rows)


def _gather_out(c: Context, n: int, h0: int, h1: int) -> torch.Tensor:
    _, n1 = c._heads
    return _empty((n, n1, max(h1 - h0, 0), c._geom[2]), torch.float32, _device(c))


@gather_rows.register_fake
def _(ctx: int, layer_id: int, row_ids: torch.Tensor, row_begin: int, row_end: int, head_begin: int,
      head_end: int) -> torch.Tensor:
    c = _get(ctx)
    return _gather_out(c, row_ids.numel() // c.row_ids_per_token, head_begin, head_end)


def _kv_columns(ctx: int, layer_id: int, rows: torch.Tensor, out_begin: int, out_end: int) -> torch.Tensor:
    """``engram_kv_columns``: ``float32 [n, out_end-out_begin]`` (bf16 values)
    for assembled rows ``[n, C*Hd]`` (gather it over ranks with ``all_gather``)."""
    c = _get(ctx)
    r = _values(c, rows, "rows")
    n = r[1] // (c._geom[2] * c._geom[3])
    out = _empty((n, max(out_end - out_begin, 0)), torch.float32, _device(c))
    c._kv_columns_raw(layer_id, n, r, (out_begin, out_end), (out.data_ptr(), out.numel(), int(Type.F32)),
                      _call_stream(c))
    return out


kv_columns = torch.library.custom_op("engram::kv_columns", mutates_args=())(_kv_columns)


@kv_columns.register_fake
def _(ctx: int, layer_id: int, rows: torch.Tensor, out_begin: int, out_end: int) -> torch.Tensor:
    c = _get(ctx)
    n = rows.numel() // (c._geom[2] * c._geom[3])
    return _empty((n, max(out_end - out_begin, 0)), torch.float32, _device(c))


def _gate_from_kv(ctx: int, layer_id: int, row_ids: torch.Tensor, kv: torch.Tensor, highway: torch.Tensor) -> None:
    """``engram_gate_from_kv``: the gate and the in-place highway update from an assembled ``kv``."""
    c = _get(ctx)
    ids, n, _ = _ids(c, row_ids)
    c._gate_from_kv_raw(layer_id, ids, n, _values(c, kv, "kv"), _highway(c, highway, n), _call_stream(c))


gate_from_kv_ = torch.library.custom_op("engram::gate_from_kv_", mutates_args=("highway",))(_gate_from_kv)


@gate_from_kv_.register_fake
def _(ctx: int, layer_id: int, row_ids: torch.Tensor, kv: torch.Tensor, highway: torch.Tensor) -> None:
    return None


def _apply_rows(ctx: int, layer_id: int, row_ids: torch.Tensor, rows: torch.Tensor, highway: torch.Tensor) -> None:
    """``engram_apply_rows``: projection, gate and in-place highway update from assembled rows."""
    c = _get(ctx)
    ids, n, _ = _ids(c, row_ids)
    c._apply_rows_raw(layer_id, ids, n, _values(c, rows, "rows"), _highway(c, highway, n), _call_stream(c))


apply_rows_ = torch.library.custom_op("engram::apply_rows_", mutates_args=("highway",))(_apply_rows)


@apply_rows_.register_fake
def _(ctx: int, layer_id: int, row_ids: torch.Tensor, rows: torch.Tensor, highway: torch.Tensor) -> None:
    return None
