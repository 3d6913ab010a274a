"""torch ops over engram contexts (``pip install ./python[torch]``).

Importing this module registers custom ops in the ``engram`` namespace with
``torch.library`` (so ``torch.compile`` keeps them as opaque calls, traced
through their fake implementations), each over CPU tensors read and written
in place through their ``data_ptr`` (no copies):

- ``torch.ops.engram.hash(ctx, tokens, seq_ids, pos) -> row_ids``
  (``int32`` inputs, ``int64 [n, n_layers, C]`` out);
- ``torch.ops.engram.apply_(ctx, layer_id, row_ids, highway)``: the
  highway (``float32`` or ``bfloat16``, ``[n, hc, D]``) updated in place;
- the split points (docs/sharding.md): ``gather_rows(ctx, layer_id, row_ids,
  row_begin, row_end, head_begin, head_end) -> float32 [n, N-1, heads, Hd]``,
  ``kv_columns(ctx, layer_id, rows, out_begin, out_end) -> float32 [n, outs]``,
  ``gate_from_kv_(ctx, layer_id, row_ids, kv, highway)`` and
  ``apply_rows_(ctx, layer_id, row_ids, rows, highway)``.

``ctx`` is the integer :func:`register` returns for an
:class:`engram.Context` (a custom op takes tensors and numbers, not Python
objects). CUDA tensors are refused with ``ValueError``: the split calls run
on the CPU backend, and this package does not take device highways yet.
"""

from __future__ import annotations

import ctypes
from typing import Dict, Tuple

import torch

from ._context import Context, Type
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


def _cpu(t: torch.Tensor, what: str) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"{what}: a {t.device.type} tensor; the engram torch ops take CPU tensors")
    if not t.is_contiguous():
        raise ValueError(f"{what}: the tensor is not contiguous (it would be copied, not used in place)")


def _values(t: torch.Tensor, what: str) -> Tuple[int, int, int]:
    """``(address, elements, engram type)`` of a float32 or bfloat16 CPU tensor."""
    _cpu(t, what)
    if t.dtype == torch.float32:
        ty = int(Type.F32)
    elif t.dtype == torch.bfloat16:
        ty = int(Type.BF16)
    else:
        raise TypeError(f"{what}: dtype {t.dtype}, expected torch.float32 or torch.bfloat16")
    return t.data_ptr(), t.numel(), ty


def _ids(ctx: Context, t: torch.Tensor) -> Tuple[Tuple[int, int], int]:
    _cpu(t, "row_ids")
    if t.dtype != torch.int64:
        raise TypeError(f"row_ids: dtype {t.dtype}, expected torch.int64")
    per = ctx.row_ids_per_token
    if t.numel() % per:
        raise ValueError(f"row_ids: {t.numel()} elements, not a multiple of {per} per token")
    return (t.data_ptr(), t.numel()), t.numel() // per


def _highway(ctx: Context, t: torch.Tensor, n: int) -> Tuple[int, int, int]:
    addr, count, ty = _values(t, "highway")
    d, hc = ctx._geom[0], ctx._geom[1]
    if count != n * hc * d:
        raise ValueError(f"highway: {count} elements, expected {n * hc * d} ({n} tokens x [hc {hc}, D {d}])")
    return addr, count * t.element_size(), ty


@torch.library.custom_op("engram::hash", mutates_args=())
def hash(ctx: int, tokens: torch.Tensor, seq_ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``engram_hash``: row ids ``int64 [n, n_layers, C]``; records the
    positions in the context's history."""
    c = _get(ctx)
    for t, w in ((tokens, "tokens"), (seq_ids, "seq_ids"), (pos, "pos")):
        _cpu(t, w)
        if t.dtype != torch.int32:
            raise TypeError(f"{w}: dtype {t.dtype}, expected torch.int32")
    n = tokens.numel()
    if seq_ids.numel() != n or pos.numel() != n:
        raise ValueError(f"tokens, seq_ids, pos: {n}, {seq_ids.numel()}, {pos.numel()} elements (must be equal)")
    _, _, _, cols, n_layers = c._geom
    out = torch.empty((n, n_layers, cols), dtype=torch.int64)
    p = lambda t, ty: ctypes.cast(t.data_ptr(), ty)  # noqa: E731
    _check(lib.engram_hash(c._ctx(), p(tokens, P_I32), p(seq_ids, P_I32), p(pos, P_I32), n, p(out, P_I64),
                           out.numel()), "engram_hash")
    return out


@hash.register_fake
def _(ctx: int, tokens: torch.Tensor, seq_ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    _, _, _, cols, n_layers = _get(ctx)._geom
    return tokens.new_empty((tokens.shape[0], n_layers, cols), dtype=torch.int64)


@torch.library.custom_op("engram::apply_", mutates_args=("highway",))
def apply_(ctx: int, layer_id: int, row_ids: torch.Tensor, highway: torch.Tensor) -> None:
    """``engram_apply_checked``: layer ``layer_id`` applied to ``highway`` in place."""
    c = _get(ctx)
    ids, n = _ids(c, row_ids)
    c._apply_raw(layer_id, ids, n, _highway(c, highway, n), None)


@apply_.register_fake
def _(ctx: int, layer_id: int, row_ids: torch.Tensor, highway: torch.Tensor) -> None:
    return None


@torch.library.custom_op("engram::gather_rows", mutates_args=())
def gather_rows(ctx: int, layer_id: int, row_ids: torch.Tensor, row_begin: int, row_end: int,
                head_begin: int, head_end: int) -> torch.Tensor:
    """``engram_gather_rows``: ``float32 [n, N-1, head_end-head_begin, Hd]``,
    ``-0.0`` outside ``[row_begin, row_end)`` (sum it over ranks with ``all_reduce``)."""
    c = _get(ctx)
    ids, n = _ids(c, row_ids)
    out = _gather_out(c, n, head_begin, head_end, row_ids)
    c._gather_rows_raw(layer_id, ids, n, (row_begin, row_end), (head_begin, head_end),
                       (out.data_ptr(), out.numel(), int(Type.F32)))
    return out


def _gather_out(c: Context, n: int, h0: int, h1: int, like: torch.Tensor) -> torch.Tensor:
    _, n1 = c._heads
    return like.new_empty((n, n1, max(h1 - h0, 0), c._geom[2]), dtype=torch.float32)


@gather_rows.register_fake
def _(ctx: int, layer_id: int, row_ids: torch.Tensor, row_begin: int, row_end: int, head_begin: int,
      head_end: int) -> torch.Tensor:
    c = _get(ctx)
    return _gather_out(c, row_ids.numel() // c.row_ids_per_token, head_begin, head_end, row_ids)


@torch.library.custom_op("engram::kv_columns", mutates_args=())
def kv_columns(ctx: int, layer_id: int, rows: torch.Tensor, out_begin: int, out_end: int) -> torch.Tensor:
    """``engram_kv_columns``: ``float32 [n, out_end-out_begin]`` (bf16 values)
    for assembled rows ``[n, C*Hd]`` (gather it over ranks with ``all_gather``)."""
    c = _get(ctx)
    r = _values(rows, "rows")
    n = r[1] // (c._geom[2] * c._geom[3])
    out = rows.new_empty((n, max(out_end - out_begin, 0)), dtype=torch.float32)
    c._kv_columns_raw(layer_id, n, r, (out_begin, out_end), (out.data_ptr(), out.numel(), int(Type.F32)))
    return out


@kv_columns.register_fake
def _(ctx: int, layer_id: int, rows: torch.Tensor, out_begin: int, out_end: int) -> torch.Tensor:
    c = _get(ctx)
    n = rows.numel() // (c._geom[2] * c._geom[3])
    return rows.new_empty((n, max(out_end - out_begin, 0)), dtype=torch.float32)


@torch.library.custom_op("engram::gate_from_kv_", mutates_args=("highway",))
def gate_from_kv_(ctx: int, layer_id: int, row_ids: torch.Tensor, kv: torch.Tensor, highway: torch.Tensor) -> None:
    """``engram_gate_from_kv``: the gate and the in-place highway update from an assembled ``kv``."""
    c = _get(ctx)
    ids, n = _ids(c, row_ids)
    c._gate_from_kv_raw(layer_id, ids, n, _values(kv, "kv"), _highway(c, highway, n))


@gate_from_kv_.register_fake
def _(ctx: int, layer_id: int, row_ids: torch.Tensor, kv: torch.Tensor, highway: torch.Tensor) -> None:
    return None


@torch.library.custom_op("engram::apply_rows_", mutates_args=("highway",))
def apply_rows_(ctx: int, layer_id: int, row_ids: torch.Tensor, rows: torch.Tensor, highway: torch.Tensor) -> None:
    """``engram_apply_rows``: projection, gate and in-place highway update from assembled rows."""
    c = _get(ctx)
    ids, n = _ids(c, row_ids)
    c._apply_rows_raw(layer_id, ids, n, _values(rows, "rows"), _highway(c, highway, n))


@apply_rows_.register_fake
def _(ctx: int, layer_id: int, row_ids: torch.Tensor, rows: torch.Tensor, highway: torch.Tensor) -> None:
    return None
