"""engram.Context: one libengram context, numpy arrays in and out."""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from ._lib import CTX, P_I32, P_I64, S, lib

PathLike = Union[str, "os.PathLike[str]"]
ArrayLike = Union[np.ndarray, Sequence[int]]

Status = S.Status
Type = S.Type
Backend = S.Backend

TOKEN_DEAD: int = S.ENGRAM_TOKEN_DEAD
ROW_ID_DEAD: int = S.ENGRAM_ROW_ID_DEAD


class EngramError(Exception):
    """A libengram call returned a status other than OK.

    ``status`` is the :class:`Status`, ``message`` the library's own message
    (``engram_last_error``), ``function`` the C function that failed.
    """

    def __init__(self, status: int, message: str, function: str = "") -> None:
        try:
            self.status: Union[Status, int] = Status(status)
        except ValueError:
            self.status = status
        self.message = message
        self.function = function
        name = self.status.name if isinstance(self.status, Status) else str(status)
        super().__init__(f"{function}: {name} ({int(status)}): {message}")


def _check(status: int, function: str) -> None:
    if status != 0:
        raw = lib.engram_last_error()
        raise EngramError(status, raw.decode("utf-8", "replace") if raw else "", function)


def _init(struct_type: Any, init_name: str) -> Any:
    """A struct filled by the library's ``*_init_sized`` (its defaults)."""
    s = struct_type()
    size = ctypes.sizeof(struct_type)
    getattr(lib, init_name)(ctypes.byref(s), size)
    if s.struct_size != size:
        raise RuntimeError(f"{init_name} set struct_size {s.struct_size}, expected {size}")
    return s


def _path(p: Optional[PathLike]) -> Optional[bytes]:
    return None if p is None else os.fsencode(os.fspath(p))


def _backend(b: Union[str, int, None]) -> Optional[int]:
    if b is None or isinstance(b, int):
        return b
    return int(S.Backend[b.upper()])


def _int_input(a: ArrayLike, dtype: Any, what: str) -> np.ndarray:
    """A read-only integer input: an ndarray must already be C-contiguous of
    ``dtype`` (no silent copy); a Python sequence is converted."""
    if isinstance(a, np.ndarray):
        if a.dtype != dtype:
            raise TypeError(f"{what}: dtype {a.dtype}, expected {np.dtype(dtype)}")
        if not a.flags.c_contiguous:
            raise ValueError(f"{what}: the array is not C-contiguous")
        return a
    return np.ascontiguousarray(np.asarray(a, dtype=dtype))


def _out_array(a: np.ndarray, dtype: Any, size: int, what: str) -> np.ndarray:
    """An output written in place: C-contiguous, writable, of ``dtype`` and ``size`` elements."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{what}: expected a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise TypeError(f"{what}: dtype {a.dtype}, expected {np.dtype(dtype)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what}: the array is not C-contiguous (it would be copied, not updated)")
    if not a.flags.writeable:
        raise ValueError(f"{what}: the array is read-only")
    if a.size != size:
        raise ValueError(f"{what}: {a.size} elements, expected {size}")
    return a


def _ptr(a: Optional[np.ndarray], ctype: Any = ctypes.c_void_p) -> Any:
    if a is None:
        return None
    return ctypes.cast(a.ctypes.data, ctype) if ctype is not ctypes.c_void_p else a.ctypes.data


def _value_type(a: np.ndarray, what: str) -> int:
    """``Type.F32`` for float32, ``Type.BF16`` for bf16 bits; else TypeError."""
    if a.dtype == np.float32:
        return int(Type.F32)
    if _bf16_like(a):
        return int(Type.BF16)
    raise TypeError(f"{what}: dtype {a.dtype}, expected float32 or bf16 (uint16 bits)")


def _in_array(a: np.ndarray, what: str) -> np.ndarray:
    """A read-only value input: a C-contiguous float32 or bf16 ndarray (no silent copy)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{what}: expected a numpy array, got {type(a).__name__}")
    _value_type(a, what)
    if not a.flags.c_contiguous:
        raise ValueError(f"{what}: the array is not C-contiguous")
    return a


def _bf16_like(a: np.ndarray) -> bool:
    """uint16 bit patterns, or an ml_dtypes/torch-style ``bfloat16`` dtype."""
    return a.dtype == np.uint16 or (a.dtype.itemsize == 2 and a.dtype.name == "bfloat16")


@dataclass(frozen=True)
class LayerInfo:
    """One engram layer as ``engram_context_info`` reports it (types are
    ``None`` while the layer's weights were never set)."""

    layer_id: int
    table_type: Optional[Type]
    table_rows: int
    rows_needed: int
    wkv_type: Optional[Type]
    qk_type: Optional[Type]


@dataclass(frozen=True)
class Info:
    """What a context says about itself (``engram_context_info``)."""

    backend: Backend
    hidden_size: int
    hc: int
    head_dim: int
    n_heads: int
    max_ngram: int
    cols: int
    n_layers: int
    eps: float
    max_tokens: int
    max_seqs: int
    max_positions: int
    n_threads: int
    token_map_len: int
    pad_id: int
    row_ids_per_token: int
    table_fingerprint: int
    layers: List[LayerInfo] = field(default_factory=list)


def _opt_type(v: int) -> Optional[Type]:
    return None if v == S.ENGRAM_INFO_NO_TYPE else Type(v)


class Context:
    """A libengram context: hash tables, per-sequence history and a backend.

    Create one with :meth:`from_gguf`, :meth:`from_safetensors`,
    :meth:`from_tables` (config.json + tokenizer.json, then :meth:`set_layer`)
    or :meth:`create` (the hash constants given directly). Free it with
    :meth:`close` or a ``with`` block (``engram_free``).

    Arrays: inputs are numpy arrays (token ids, sequences and positions may
    also be Python sequences); row ids are ``int64``; the highway is
    ``float32`` or bf16 as ``uint16`` bit patterns, ``[n_tokens, hc, D]``,
    updated in place. Every array is checked (dtype, C-contiguity, size)
    before the call, which raises instead of copying.
    """

    _handle: Optional[int]

    def __init__(self, handle: int, _keep: Any = None, device: int = 0) -> None:
        """Not for direct use: use a ``from_*`` or ``create`` constructor."""
        self._handle = handle
        self._device = int(device)
        self._layers: Dict[int, Tuple[np.ndarray, ...]] = {}
        self._keep = _keep
        self._per_token = int(lib.engram_row_ids_per_token(handle))
        inf = self.info(layers=False)
        self._geom = (inf.hidden_size, inf.hc, inf.head_dim, inf.cols, inf.n_layers)
        self._heads = (inf.n_heads, inf.max_ngram - 1)
        self._backend = inf.backend

    # ---- creation ------------------------------------------------------

    @classmethod
    def _adopt(cls, out: Any, opts: Any) -> "Context":
        if not out.value:
            raise RuntimeError("engram: a create call returned OK without a context")
        # engram_context_info does not report the ordinal: keep the one asked for.
        return cls(out.value, device=opts.device)

    @staticmethod
    def _fill(opts: Any, kw: Dict[str, Any], keep: List[Any]) -> None:
        for k, v in kw.items():
            if v is None:
                continue  # the library's default
            if k == "backend":
                v = _backend(v)
            elif isinstance(v, bool):
                v = int(v)
            elif k in ("config_json", "tokenizer_json", "tables_dir"):
                v = _path(v)
                keep.append(v)
            elif k in ("shard_table", "shard_wkv"):
                rank, world = v
                setattr(opts, f"{k}_rank", rank)
                setattr(opts, f"{k}_world", world)
                continue
            setattr(opts, k, v)

    @classmethod
    def from_gguf(
        cls,
        path: PathLike,
        *,
        backend: Union[str, int, None] = None,
        device: Optional[int] = None,
        eps: Optional[float] = None,
        max_tokens: Optional[int] = None,
        max_seqs: Optional[int] = None,
        max_positions: Optional[int] = None,
        n_threads: Optional[int] = None,
        config_json: Optional[PathLike] = None,
        tokenizer_json: Optional[PathLike] = None,
        mmap_tables: Optional[bool] = None,
        tables_dir: Optional[PathLike] = None,
        shard_table: Optional[Tuple[int, int]] = None,
        shard_wkv: Optional[Tuple[int, int]] = None,
        exact_quant_wkv: Optional[bool] = None,
    ) -> "Context":
        """A context from a GGUF file (``engram_create_from_gguf``).

        The keyword arguments are ``engram_gguf_options``' fields; one left
        ``None`` keeps the library's default (CPU, the file's eps, 4096
        tokens, 64 sequences, 131072 positions, one thread, pread tables,
        integer dot products for a ``Q4_K`` ``wkv``: ``exact_quant_wkv=True``
        keeps the bits of its f32 twin, docs/numerics.md).
        ``backend`` is ``"cpu"``, ``"cuda"`` or a :class:`Backend`.
        ``shard_table=(rank, world)`` and ``shard_wkv=(rank, world)`` make a
        shard context that loads only its part of ``wkv`` (the
        ``shard_*`` fields; docs/sharding.md "Shard contexts").
        """
        opts = _init(S.engram_gguf_options, "engram_gguf_options_init_sized")
        keep: List[Any] = []
        cls._fill(opts, dict(backend=backend, device=device, eps=eps, max_tokens=max_tokens,
                             max_seqs=max_seqs, max_positions=max_positions, n_threads=n_threads,
                             config_json=config_json, tokenizer_json=tokenizer_json,
                             mmap_tables=mmap_tables, tables_dir=tables_dir, shard_table=shard_table,
                             shard_wkv=shard_wkv, exact_quant_wkv=exact_quant_wkv), keep)
        out = CTX()
        _check(lib.engram_create_from_gguf(_path(path), ctypes.byref(opts), ctypes.byref(out)),
               "engram_create_from_gguf")
        return cls._adopt(out, opts)

    @classmethod
    def from_safetensors(
        cls,
        model_dir: PathLike,
        *,
        backend: Union[str, int, None] = None,
        device: Optional[int] = None,
        eps: Optional[float] = None,
        max_tokens: Optional[int] = None,
        max_seqs: Optional[int] = None,
        max_positions: Optional[int] = None,
        n_threads: Optional[int] = None,
        tokenizer_json: Optional[PathLike] = None,
        mmap_tables: Optional[bool] = None,
        shard_table: Optional[Tuple[int, int]] = None,
        shard_wkv: Optional[Tuple[int, int]] = None,
    ) -> "Context":
        """A context from the released checkpoint's directory
        (``engram_create_from_safetensors``); keywords as ``engram_safetensors_options``
        (``shard_table``, ``shard_wkv`` as in :meth:`from_gguf`)."""
        opts = _init(S.engram_safetensors_options, "engram_safetensors_options_init_sized")
        keep: List[Any] = []
        cls._fill(opts, dict(backend=backend, device=device, eps=eps, max_tokens=max_tokens,
                             max_seqs=max_seqs, max_positions=max_positions, n_threads=n_threads,
                             tokenizer_json=tokenizer_json, mmap_tables=mmap_tables, shard_table=shard_table,
                             shard_wkv=shard_wkv), keep)
        out = CTX()
        _check(lib.engram_create_from_safetensors(_path(model_dir), ctypes.byref(opts), ctypes.byref(out)),
               "engram_create_from_safetensors")
        return cls._adopt(out, opts)

    _CONFIG_KEYS = ("backend", "device", "hidden_size", "hc", "head_dim", "eps", "max_tokens",
                    "max_seqs", "max_positions", "n_threads", "device_history", "exact_quant_wkv")

    @classmethod
    def from_tables(cls, config_json: PathLike, tokenizer_json: PathLike, **config: Any) -> "Context":
        """A context whose hash tables are derived from a model's
        ``config.json`` and ``tokenizer.json`` (``engram_tables_from_files``,
        ``engram_tables_fill_config``, ``engram_create``). ``config`` sets
        the other ``engram_config`` fields (``hidden_size``, ``hc``,
        ``head_dim`` where config.json lacks them; ``max_tokens``,
        ``max_seqs``, ``max_positions``, ``n_threads``, ``eps``, ``backend``,
        ``device``). Give each layer's weights with :meth:`set_layer`."""
        tables = ctypes.c_void_p()
        _check(lib.engram_tables_from_files(_path(config_json), _path(tokenizer_json), ctypes.byref(tables)),
               "engram_tables_from_files")
        try:
            cfg = _init(S.engram_config, "engram_config_init_sized")
            _check(lib.engram_tables_fill_config(tables, ctypes.byref(cfg)), "engram_tables_fill_config")
            return cls._create(cfg, config, [])
        finally:
            lib.engram_tables_free(tables)

    @classmethod
    def create(
        cls,
        *,
        hidden_size: int,
        hc: int,
        head_dim: int,
        n_heads: int,
        max_ngram: int,
        layer_ids: ArrayLike,
        token_map: ArrayLike,
        pad_id: int,
        multipliers: ArrayLike,
        primes: ArrayLike,
        offsets: ArrayLike,
        **config: Any,
    ) -> "Context":
        """A context from the hash constants themselves (``engram_create``);
        the arrays are copied by the library. ``multipliers``, ``primes`` and
        ``offsets`` are unsigned 64-bit (i64 multipliers as their u64 bits).
        Other ``engram_config`` fields as keywords (see :meth:`from_tables`)."""
        cfg = _init(S.engram_config, "engram_config_init_sized")
        arrays: Dict[str, np.ndarray] = {
            "layer_ids": np.ascontiguousarray(layer_ids, dtype=np.uint32),
            "token_map": np.ascontiguousarray(token_map, dtype=np.int32),
            "multipliers": np.ascontiguousarray(np.asarray(multipliers).astype(np.uint64)),
            "primes": np.ascontiguousarray(primes, dtype=np.uint64),
            "offsets": np.ascontiguousarray(offsets, dtype=np.uint64),
        }
        cfg.hidden_size, cfg.hc, cfg.head_dim = hidden_size, hc, head_dim
        cfg.n_heads, cfg.max_ngram, cfg.pad_id = n_heads, max_ngram, pad_id
        cfg.layer_ids, cfg.n_layers = arrays["layer_ids"].ctypes.data, arrays["layer_ids"].size
        cfg.token_map, cfg.token_map_len = arrays["token_map"].ctypes.data, arrays["token_map"].size
        cfg.multipliers, cfg.n_multipliers = arrays["multipliers"].ctypes.data, arrays["multipliers"].size
        cfg.primes, cfg.n_primes = arrays["primes"].ctypes.data, arrays["primes"].size
        cfg.offsets, cfg.n_offsets = arrays["offsets"].ctypes.data, arrays["offsets"].size
        return cls._create(cfg, config, list(arrays.values()))

    @classmethod
    def _create(cls, cfg: Any, config: Dict[str, Any], keep: List[Any]) -> "Context":
        unknown = set(config) - set(cls._CONFIG_KEYS)
        if unknown:
            raise TypeError(f"unknown engram_config fields: {sorted(unknown)}")
        cls._fill(cfg, config, keep)
        out = CTX()
        _check(lib.engram_create(ctypes.byref(cfg), ctypes.byref(out)), "engram_create")
        return cls._adopt(out, cfg)

    def set_layer(
        self,
        layer_id: int,
        *,
        table: np.ndarray,
        table_type: Union[Type, int],
        wkv: np.ndarray,
        wkv_type: Union[Type, int],
        q: np.ndarray,
        k: np.ndarray,
        qk_type: Union[Type, int],
        table_rows: Optional[int] = None,
        table_scales: Optional[np.ndarray] = None,
        wkv_scales: Optional[np.ndarray] = None,
        wkv_block: Tuple[int, int] = (0, 0),
    ) -> None:
        """Register one engram layer's weights (``engram_set_layer``).

        The arrays are borrowed, not copied: the context keeps a reference
        to each until the layer is set again or the context is closed. They
        must be C-contiguous; ``table_rows`` defaults to ``table.shape[0]``.
        """
        arrs = [a for a in (table, wkv, q, k, table_scales, wkv_scales) if a is not None]
        for a in arrs:
            if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
                raise ValueError("set_layer: every weight must be a C-contiguous numpy array")
        w = _init(S.engram_layer_weights, "engram_layer_weights_init_sized")
        w.layer_id = layer_id
        w.table_type = int(table_type)
        w.table = table.ctypes.data
        w.table_rows = table.shape[0] if table_rows is None else table_rows
        w.wkv, w.wkv_type = wkv.ctypes.data, int(wkv_type)
        w.q, w.k, w.qk_type = q.ctypes.data, k.ctypes.data, int(qk_type)
        w.table_scales = _ptr(table_scales)
        w.wkv_scales = _ptr(wkv_scales)
        w.wkv_block_rows, w.wkv_block_cols = wkv_block
        _check(lib.engram_set_layer(self._ctx(), ctypes.byref(w)), "engram_set_layer")
        self._layers[layer_id] = tuple(arrs)

    # ---- lifetime ------------------------------------------------------

    def close(self) -> None:
        """Free the context (``engram_free``); later calls raise ValueError. Idempotent."""
        h, self._handle = self._handle, None
        if h:
            lib.engram_free(h)
        self._layers.clear()

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_handle", None):
            self.close()

    def __repr__(self) -> str:
        if not self._handle:
            return "<engram.Context (closed)>"
        d, hc, hd, cols, n_layers = self._geom
        return (f"<engram.Context {self._backend.name} D={d} hc={hc} Hd={hd} C={cols} "
                f"n_layers={n_layers}>")

    def _ctx(self) -> int:
        if not self._handle:
            raise ValueError("the engram context is closed")
        return self._handle

    # ---- the step ------------------------------------------------------

    @property
    def backend(self) -> Backend:
        """The backend the context runs on (:class:`Backend`)."""
        return self._backend

    @property
    def device(self) -> int:
        """The CUDA device ordinal the context was created for (meaningful on the CUDA backend)."""
        return self._device

    @property
    def row_ids_per_token(self) -> int:
        """``n_layers * C``: the row ids each token produces."""
        return self._per_token

    def _row_ids(self, row_ids: np.ndarray) -> Tuple[np.ndarray, int]:
        if not isinstance(row_ids, np.ndarray):
            raise TypeError("row_ids: expected the int64 numpy array hash() returned")
        ids = _int_input(row_ids, np.int64, "row_ids")
        if ids.size % self._per_token:
            raise ValueError(f"row_ids: {ids.size} elements, not a multiple of {self._per_token} per token")
        return ids, ids.size // self._per_token

    def hash(
        self,
        tokens: ArrayLike,
        seq_ids: ArrayLike,
        pos: ArrayLike,
        out: Optional[np.ndarray] = None,
    ) -> np.ndarray:
        """Hash a batch (``engram_hash``): token ``i`` (a raw id, or
        :data:`TOKEN_DEAD`) at position ``pos[i]`` of sequence ``seq_ids[i]``.
        Returns the row ids, ``int64 [n_tokens, n_layers, C]`` (written into
        ``out`` when given). Records the positions in the history."""
        t = _int_input(tokens, np.int32, "tokens")
        s = _int_input(seq_ids, np.int32, "seq_ids")
        p = _int_input(pos, np.int32, "pos")
        n = t.size
        if s.size != n or p.size != n:
            raise ValueError(f"tokens, seq_ids, pos: {n}, {s.size}, {p.size} elements (must be equal)")
        _, _, _, cols, n_layers = self._geom
        if out is None:
            out = np.empty((n, n_layers, cols), dtype=np.int64)
        _out_array(out, np.int64, n * self._per_token, "out")
        _check(lib.engram_hash(self._ctx(), _ptr(t, P_I32), _ptr(s, P_I32), _ptr(p, P_I32), n,
                               _ptr(out, P_I64), out.size), "engram_hash")
        return out

    def apply(self, layer_id: int, row_ids: np.ndarray, highway: np.ndarray) -> np.ndarray:
        """Apply engram layer ``layer_id`` in place (``engram_apply_checked``):
        ``highway`` is ``[n_tokens, hc, D]`` ``float32``, or bf16 as ``uint16``
        bits (or a ``bfloat16`` dtype), C-contiguous and writable; it is
        updated where it lies and returned. CPU backend only (a CUDA
        context's highway is device memory: ValueError)."""
        ids, n = self._row_ids(row_ids)
        d, hc = self._geom[0], self._geom[1]
        if self._backend != Backend.CPU:
            # The CUDA backend's highway is device memory: a numpy array's
            # host address passed there would be read as a device pointer.
            raise ValueError("apply: a numpy highway is host memory; this context's backend "
                             f"({self._backend.name}) needs a device highway: pass a CUDA tensor to "
                             "torch.ops.engram.apply_ (engram.torch_ops)")
        if not isinstance(highway, np.ndarray):
            raise TypeError(f"highway: expected a numpy array, got {type(highway).__name__}")
        if highway.dtype == np.float32:
            ty = Type.F32
        elif _bf16_like(highway):
            ty = Type.BF16
        else:
            raise TypeError(f"highway: dtype {highway.dtype}, expected float32 or bf16 (uint16 bits)")
        _out_array(highway, highway.dtype, n * hc * d, "highway")
        self._apply_raw(layer_id, (ids.ctypes.data, ids.size), n,
                        (highway.ctypes.data, highway.nbytes, int(ty)), None)
        return highway

    def _apply_raw(self, layer_id: int, ids: Tuple[int, int], n: int, hw: Tuple[int, int, int],
                   stream: Optional[int], device_ids: bool = False) -> None:
        """``engram_apply_checked`` on addresses: host row ids ``(addr,
        len)``, the highway ``(addr, bytes, type)`` in the backend's memory;
        with ``device_ids``, ``engram_apply_device_ids_checked`` (the row ids
        in device memory: capturable in a CUDA graph)."""
        d, hc = self._geom[0], self._geom[1]
        a = _init(S.engram_apply_args, "engram_apply_args_init_sized")
        a.layer_id, a.n_tokens = layer_id, n
        a.row_ids, a.row_ids_len = ids[0], ids[1]
        a.highway, a.highway_bytes = hw[0], hw[1]
        a.highway_token_stride = hc * d * (4 if hw[2] == int(Type.F32) else 2)
        a.highway_type = hw[2]
        a.stream = stream
        if device_ids:
            _check(lib.engram_apply_device_ids_checked(self._ctx(), ctypes.byref(a)),
                   "engram_apply_device_ids_checked")
        else:
            _check(lib.engram_apply_checked(self._ctx(), ctypes.byref(a)), "engram_apply_checked")

    def _hash_device_raw(self, tokens: int, seq_ids: int, pos: int, n: int, out: Tuple[int, int],
                         stream: Optional[int]) -> None:
        """``engram_hash_device_checked`` on device addresses; ``out`` is ``(addr, capacity)``."""
        _check(lib.engram_hash_device_checked(self._ctx(), tokens, seq_ids, pos, n, out[0], out[1], stream),
               "engram_hash_device_checked")

    def _stage_raw(self, layer_id: int, ids: Tuple[int, int], n: int, stream: Optional[int]) -> None:
        """``engram_stage`` of host row ids ``(addr, len)`` on ``stream``."""
        _check(lib.engram_stage(self._ctx(), layer_id, ctypes.cast(ids[0], P_I64), n, stream), "engram_stage")

    def prefetch(self, layer_id: int, row_ids: np.ndarray) -> None:
        """Start gathering layer ``layer_id``'s rows for ``row_ids`` on the
        worker threads (``engram_prefetch``); the next :meth:`apply` with the
        same ids waits only for it. ``row_ids`` must stay alive and unchanged
        until that apply."""
        ids, n = self._row_ids(row_ids)
        _check(lib.engram_prefetch(self._ctx(), layer_id, _ptr(ids, P_I64), n), "engram_prefetch")

    def read_back(
        self,
        layer_id: int,
        row_ids: np.ndarray,
        rows: Optional[np.ndarray] = None,
        kv: Optional[np.ndarray] = None,
    ) -> Tuple[np.ndarray, np.ndarray]:
        """What :meth:`apply` computes, for validating an integration
        (``engram_read_back_checked``): the gathered rows
        ``[n_tokens, C*Hd]`` and the projection ``kv`` ``[n_tokens, D*(hc+1)]``,
        both bf16 as ``uint16`` bits (zero for a dead token). Slow."""
        ids, n = self._row_ids(row_ids)
        d, hc, hd, cols, _ = self._geom
        if rows is None:
            rows = np.empty((n, cols * hd), dtype=np.uint16)
        if kv is None:
            kv = np.empty((n, d * (hc + 1)), dtype=np.uint16)
        _out_array(rows, np.uint16, n * cols * hd, "rows")
        _out_array(kv, np.uint16, n * d * (hc + 1), "kv")
        a = _init(S.engram_read_back_args, "engram_read_back_args_init_sized")
        a.layer_id, a.n_tokens = layer_id, n
        a.row_ids, a.row_ids_len = ids.ctypes.data, ids.size
        a.rows, a.rows_len = rows.ctypes.data, rows.size
        a.kv, a.kv_len = kv.ctypes.data, kv.size
        _check(lib.engram_read_back_checked(self._ctx(), ctypes.byref(a)), "engram_read_back_checked")
        return rows, kv

    def check(self) -> None:
        """Raise what went wrong in queued device work (``engram_check``; always fine on the CPU)."""
        _check(lib.engram_check(self._ctx(), None), "engram_check")

    # ---- shards and split points (docs/sharding.md) ---------------------

    def set_shard(self, table: Tuple[int, int] = (0, 1), wkv: Tuple[int, int] = (0, 1)) -> None:
        """Hold part ``rank`` of ``world`` of every layer's table rows
        (``table=(rank, world)``) and of ``wkv``'s outputs (``wkv=(rank,
        world)``) from now on (``engram_context_set_shard``).
        ``(0, 1)`` is the whole. The parts of ranks ``0..world`` tile the
        layer for any world size."""
        _check(lib.engram_context_set_shard(self._ctx(), table[0], table[1], wkv[0], wkv[1]),
               "engram_context_set_shard")

    def shard_held(self, layer_id: int) -> Tuple[Tuple[int, int], Tuple[int, int]]:
        """``((row_begin, row_end), (out_begin, out_end))``: the table rows and
        ``wkv`` outputs this context holds of layer ``layer_id`` (``engram_shard_held``)."""
        v = [ctypes.c_uint64() for _ in range(4)]
        _check(lib.engram_shard_held(self._ctx(), layer_id, *[ctypes.byref(x) for x in v]), "engram_shard_held")
        return (v[0].value, v[1].value), (v[2].value, v[3].value)

    def shard_bytes(self, layer_id: int) -> Tuple[int, int]:
        """``(table_bytes, wkv_bytes)``: the bytes of layer ``layer_id``'s
        table rows and ``wkv`` outputs this context holds (``engram_shard_bytes``)."""
        v = [ctypes.c_uint64() for _ in range(2)]
        _check(lib.engram_shard_bytes(self._ctx(), layer_id, *[ctypes.byref(x) for x in v]), "engram_shard_bytes")
        return v[0].value, v[1].value

    def memory(self) -> Tuple[int, int]:
        """``(loaded_bytes, context_bytes)``: host memory the loader read or
        converted for this context, and the context's own structures
        (``engram_context_memory``)."""
        v = [ctypes.c_uint64() for _ in range(2)]
        _check(lib.engram_context_memory(self._ctx(), *[ctypes.byref(x) for x in v]), "engram_context_memory")
        return v[0].value, v[1].value

    def heads(self) -> Tuple[int, int]:
        """``(H, N-1)``: hash heads per n-gram size and n-gram sizes (the
        shape of :meth:`gather_rows`' middle axes)."""
        return self._heads

    def _gather_rows_raw(self, layer_id: int, ids: Tuple[int, int], n: int, rows: Tuple[int, int],
                         heads: Tuple[int, int], out: Tuple[int, int, int], stream: Optional[int] = None) -> None:
        _check(lib.engram_gather_rows(self._ctx(), layer_id, n, ids[0], ids[1], rows[0], rows[1], heads[0],
                                      heads[1], out[0], out[1], out[2], stream), "engram_gather_rows")

    def _kv_columns_raw(self, layer_id: int, n: int, rows: Tuple[int, int, int], outs: Tuple[int, int],
                        kv: Tuple[int, int, int], stream: Optional[int] = None) -> None:
        _check(lib.engram_kv_columns(self._ctx(), layer_id, n, rows[0], rows[1], rows[2], outs[0], outs[1],
                                     kv[0], kv[1], kv[2], stream), "engram_kv_columns")

    def _gate_from_kv_raw(self, layer_id: int, ids: Tuple[int, int], n: int, kv: Tuple[int, int, int],
                          hw: Tuple[int, int, int], stream: Optional[int] = None) -> None:
        _check(lib.engram_gate_from_kv(self._ctx(), layer_id, n, ids[0], ids[1], kv[0], kv[1], kv[2], hw[0],
                                       hw[1], hw[2], stream), "engram_gate_from_kv")

    def _apply_rows_raw(self, layer_id: int, ids: Tuple[int, int], n: int, rows: Tuple[int, int, int],
                        hw: Tuple[int, int, int], stream: Optional[int] = None) -> None:
        _check(lib.engram_apply_rows(self._ctx(), layer_id, n, ids[0], ids[1], rows[0], rows[1], rows[2], hw[0],
                                     hw[1], hw[2], stream), "engram_apply_rows")

    def gather_rows(self, layer_id: int, row_ids: np.ndarray, rows: Optional[Tuple[int, int]] = None,
                    heads: Optional[Tuple[int, int]] = None, out: Optional[np.ndarray] = None,
                    dtype: Any = np.float32) -> np.ndarray:
        """The rows this shard owns (``engram_gather_rows``): for table rows
        ``[rows[0], rows[1])`` (default: all this context holds) and heads
        ``[heads[0], heads[1])`` (default: all), ``[n_tokens, N-1, heads, Hd]``
        of ``float32`` or bf16 bits (``uint16``); every other value is
        ``-0.0``, so the sum over ranks that tile the table is the whole
        rows, bit for bit, in any order."""
        ids, n = self._row_ids(row_ids)
        if rows is None:
            rows = self.shard_held(layer_id)[0]
        nh, n1 = self._heads
        h0, h1 = heads if heads is not None else (0, nh)
        hd = self._geom[2]
        if out is None:
            out = np.empty((n, n1, max(h1 - h0, 0), hd), dtype=dtype)
        ty = _value_type(out, "out")
        _out_array(out, out.dtype, n * n1 * max(h1 - h0, 0) * hd, "out")
        self._gather_rows_raw(layer_id, (ids.ctypes.data, ids.size), n, rows, (h0, h1),
                              (out.ctypes.data, out.size, ty))
        return out

    def kv_columns(self, layer_id: int, rows: np.ndarray, outs: Optional[Tuple[int, int]] = None,
                   out: Optional[np.ndarray] = None, dtype: Any = np.float32) -> np.ndarray:
        """``kv`` outputs ``[outs[0], outs[1])`` (default: those this context
        holds) for assembled rows ``[n_tokens, C*Hd]`` (``engram_kv_columns``):
        ``[n_tokens, outs[1]-outs[0]]``, bf16 values as ``float32`` or ``uint16``."""
        r = _in_array(rows, "rows")
        kin = self._geom[2] * self._geom[3]
        if r.size % kin:
            raise ValueError(f"rows: {r.size} values, not a multiple of C*Hd = {kin}")
        n = r.size // kin
        if outs is None:
            outs = self.shard_held(layer_id)[1]
        if out is None:
            out = np.empty((n, max(outs[1] - outs[0], 0)), dtype=dtype)
        ty = _value_type(out, "out")
        _out_array(out, out.dtype, n * max(outs[1] - outs[0], 0), "out")
        self._kv_columns_raw(layer_id, n, (r.ctypes.data, r.size, _value_type(r, "rows")), outs,
                             (out.ctypes.data, out.size, ty))
        return out

    def gate_from_kv(self, layer_id: int, row_ids: np.ndarray, kv: np.ndarray, highway: np.ndarray) -> np.ndarray:
        """The gate and the in-place highway update from an assembled ``kv``
        ``[n_tokens, D*(hc+1)]`` (``engram_gate_from_kv``); returns ``highway``."""
        ids, n = self._row_ids(row_ids)
        k = _in_array(kv, "kv")
        hw, hty = self._host_highway(highway, n)
        self._gate_from_kv_raw(layer_id, (ids.ctypes.data, ids.size), n, (k.ctypes.data, k.size,
                               _value_type(k, "kv")), (hw.ctypes.data, hw.nbytes, hty))
        return highway

    def apply_rows(self, layer_id: int, row_ids: np.ndarray, rows: np.ndarray, highway: np.ndarray) -> np.ndarray:
        """Projection, gate and in-place highway update from assembled rows
        ``[n_tokens, C*Hd]`` (``engram_apply_rows``); returns ``highway``."""
        ids, n = self._row_ids(row_ids)
        r = _in_array(rows, "rows")
        hw, hty = self._host_highway(highway, n)
        self._apply_rows_raw(layer_id, (ids.ctypes.data, ids.size), n, (r.ctypes.data, r.size,
                             _value_type(r, "rows")), (hw.ctypes.data, hw.nbytes, hty))
        return highway

    def _host_highway(self, highway: np.ndarray, n: int) -> Tuple[np.ndarray, int]:
        if self._backend != Backend.CPU:
            raise ValueError("a numpy highway is host memory; on the CUDA backend pass CUDA tensors "
                             "to the engram.torch_ops ops")
        if not isinstance(highway, np.ndarray):
            raise TypeError(f"highway: expected a numpy array, got {type(highway).__name__}")
        ty = _value_type(highway, "highway")
        d, hc = self._geom[0], self._geom[1]
        _out_array(highway, highway.dtype, n * hc * d, "highway")
        return highway, ty

    # ---- history -------------------------------------------------------

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Forget positions ``[p0, p1)`` of ``seq`` (-1: every sequence; a negative bound: the start/end)."""
        _check(lib.engram_seq_rm(self._ctx(), seq, p0, p1), "engram_seq_rm")

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Copy ``src``'s positions ``[p0, p1)`` over ``dst``'s."""
        _check(lib.engram_seq_cp(self._ctx(), src, dst, p0, p1), "engram_seq_cp")

    def seq_keep(self, seq: int) -> None:
        """Forget every sequence but ``seq``."""
        _check(lib.engram_seq_keep(self._ctx(), seq), "engram_seq_keep")

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Move ``seq``'s positions in ``[p0, p1)`` by ``delta`` (the context shift)."""
        _check(lib.engram_seq_add(self._ctx(), seq, p0, p1, delta), "engram_seq_add")

    def seq_div(self, seq: int, p0: int, p1: int, d: int) -> None:
        """``llama_memory_seq_div``: refused for ``d > 1`` (Status.ERR_UNSUPPORTED), a no-op for 1."""
        _check(lib.engram_seq_div(self._ctx(), seq, p0, p1, d), "engram_seq_div")

    def seq_state(self, seq: int) -> bytes:
        """Save ``seq``'s history (``engram_seq_state_write``), to restore with :meth:`seq_restore`."""
        size = ctypes.c_size_t()
        _check(lib.engram_seq_state_size(self._ctx(), seq, ctypes.byref(size)), "engram_seq_state_size")
        buf = ctypes.create_string_buffer(max(size.value, 1))
        written = ctypes.c_size_t()
        _check(lib.engram_seq_state_write(self._ctx(), seq, buf, size.value, ctypes.byref(written)),
               "engram_seq_state_write")
        return buf.raw[: written.value]

    def seq_restore(self, seq: int, state: Union[bytes, bytearray, memoryview]) -> None:
        """Replace ``seq``'s history with a saved state (``engram_seq_state_read``)."""
        data = bytes(state)
        _check(lib.engram_seq_state_read(self._ctx(), seq, data, len(data)), "engram_seq_state_read")

    # ---- information ---------------------------------------------------

    def info(self, layers: bool = True) -> Info:
        """The context's geometry, limits and (with ``layers``) per-layer weights (``engram_context_info``)."""
        inf = _init(S.engram_info, "engram_info_init_sized")
        _check(lib.engram_context_info(self._ctx(), ctypes.byref(inf)), "engram_context_info")
        per_layer: List[LayerInfo] = []
        if layers and inf.n_layers:
            n = inf.n_layers
            arr = {k: np.zeros(n, dtype=dt) for k, dt in (
                ("layer_ids", np.uint32), ("table_types", np.uint32), ("table_rows", np.uint64),
                ("rows_needed", np.uint64), ("wkv_types", np.uint32), ("qk_types", np.uint32))}
            for k, a in arr.items():
                setattr(inf, k, a.ctypes.data)
            inf.layers_cap = n
            _check(lib.engram_context_info(self._ctx(), ctypes.byref(inf)), "engram_context_info")
            per_layer = [LayerInfo(int(arr["layer_ids"][i]), _opt_type(int(arr["table_types"][i])),
                                   int(arr["table_rows"][i]), int(arr["rows_needed"][i]),
                                   _opt_type(int(arr["wkv_types"][i])), _opt_type(int(arr["qk_types"][i])))
                         for i in range(n)]
        return Info(Backend(inf.backend), inf.hidden_size, inf.hc, inf.head_dim, inf.n_heads, inf.max_ngram,
                    inf.cols, inf.n_layers, inf.eps, inf.max_tokens, inf.max_seqs, inf.max_positions,
                    inf.n_threads, inf.token_map_len, inf.pad_id, inf.row_ids_per_token,
                    inf.table_fingerprint, per_layer)

    def gate_weights(self, layer_id: int) -> np.ndarray:
        """Layer ``layer_id``'s ``q * k``, ``float32 [hc, D]`` (``engram_layer_gate_weights``)."""
        d, hc = self._geom[0], self._geom[1]
        out = np.empty((hc, d), dtype=np.float32)
        _check(lib.engram_layer_gate_weights(self._ctx(), layer_id,
                                             out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), out.size),
               "engram_layer_gate_weights")
        return out

    def set_threads(self, n_threads: int) -> None:
        """Use at most ``n_threads`` threads per call from now on (``engram_set_threads``)."""
        _check(lib.engram_set_threads(self._ctx(), n_threads), "engram_set_threads")
