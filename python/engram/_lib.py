"""The shared library and the C functions' prototypes (ctypes).

The structs come from ``_structs`` (generated from include/engram.h when the
package is built); only the functions' signatures are listed here, each as
the header declares it.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import POINTER, c_char_p, c_float, c_int32, c_int64, c_size_t, c_uint16, c_uint32, c_uint64, c_void_p
from typing import Any, Dict, List, Tuple

from . import _structs as S

_HERE = os.path.dirname(os.path.abspath(__file__))

CTX = c_void_p  # struct engram_context *
P_I32 = POINTER(c_int32)
P_I64 = POINTER(c_int64)
P_U16 = POINTER(c_uint16)


def _prototypes() -> Dict[str, Tuple[Any, List[Any]]]:
    st = ctypes.c_int  # enum engram_status
    ptr = ctypes.POINTER
    return {
        "engram_version": (c_char_p, []),
        "engram_status_str": (c_char_p, [c_int32]),
        "engram_last_error": (c_char_p, []),
        "engram_config_init_sized": (None, [ptr(S.engram_config), c_size_t]),
        "engram_create": (st, [ptr(S.engram_config), ptr(CTX)]),
        "engram_layer_weights_init_sized": (None, [ptr(S.engram_layer_weights), c_size_t]),
        "engram_set_layer": (st, [CTX, ptr(S.engram_layer_weights)]),
        "engram_gguf_options_init_sized": (None, [ptr(S.engram_gguf_options), c_size_t]),
        "engram_create_from_gguf": (st, [c_char_p, ptr(S.engram_gguf_options), ptr(CTX)]),
        "engram_safetensors_options_init_sized": (None, [ptr(S.engram_safetensors_options), c_size_t]),
        "engram_create_from_safetensors": (st, [c_char_p, ptr(S.engram_safetensors_options), ptr(CTX)]),
        "engram_tables_from_files": (st, [c_char_p, c_char_p, ptr(c_void_p)]),
        "engram_tables_fill_config": (st, [c_void_p, ptr(S.engram_config)]),
        "engram_tables_free": (None, [c_void_p]),
        "engram_row_ids_per_token": (c_size_t, [CTX]),
        "engram_hash": (st, [CTX, P_I32, P_I32, P_I32, c_uint32, P_I64, c_size_t]),
        "engram_apply_args_init_sized": (None, [ptr(S.engram_apply_args), c_size_t]),
        "engram_apply_checked": (st, [CTX, ptr(S.engram_apply_args)]),
        "engram_apply_device_ids_checked": (st, [CTX, ptr(S.engram_apply_args)]),
        # Device pointers as addresses (c_void_p): they are never host memory.
        "engram_hash_device_checked": (st, [CTX, c_void_p, c_void_p, c_void_p, c_uint32, c_void_p, c_size_t,
                                            c_void_p]),
        "engram_stage": (st, [CTX, c_uint32, P_I64, c_uint32, c_void_p]),
        "engram_prefetch": (st, [CTX, c_uint32, P_I64, c_uint32]),
        "engram_read_back_args_init_sized": (None, [ptr(S.engram_read_back_args), c_size_t]),
        "engram_read_back_checked": (st, [CTX, ptr(S.engram_read_back_args)]),
        "engram_check": (st, [CTX, c_void_p]),
        "engram_seq_rm": (st, [CTX, c_int32, c_int32, c_int32]),
        "engram_seq_cp": (st, [CTX, c_int32, c_int32, c_int32, c_int32]),
        "engram_seq_keep": (st, [CTX, c_int32]),
        "engram_seq_add": (st, [CTX, c_int32, c_int32, c_int32, c_int32]),
        "engram_seq_div": (st, [CTX, c_int32, c_int32, c_int32, c_int32]),
        "engram_seq_state_size": (st, [CTX, c_int32, ptr(c_size_t)]),
        "engram_seq_state_write": (st, [CTX, c_int32, c_void_p, c_size_t, ptr(c_size_t)]),
        "engram_seq_state_read": (st, [CTX, c_int32, c_void_p, c_size_t]),
        "engram_info_init_sized": (None, [ptr(S.engram_info), c_size_t]),
        "engram_context_info": (st, [CTX, ptr(S.engram_info)]),
        "engram_layer_gate_weights": (st, [CTX, c_uint32, ptr(c_float), c_size_t]),
        "engram_set_threads": (st, [CTX, c_uint32]),
        "engram_free": (None, [CTX]),
        "engram_context_set_shard": (st, [CTX, c_uint32, c_uint32, c_uint32, c_uint32]),
        "engram_shard_held": (st, [CTX, c_uint32, ptr(c_uint64), ptr(c_uint64), ptr(c_uint64), ptr(c_uint64)]),
        "engram_shard_bytes": (st, [CTX, c_uint32, ptr(c_uint64), ptr(c_uint64)]),
        "engram_context_memory": (st, [CTX, ptr(c_uint64), ptr(c_uint64)]),
        "engram_gather_rows": (st, [CTX, c_uint32, c_uint32, c_void_p, c_size_t, c_uint64, c_uint64, c_uint32,
                                    c_uint32, c_void_p, c_size_t, c_uint32, c_void_p]),
        "engram_kv_columns": (st, [CTX, c_uint32, c_uint32, c_void_p, c_size_t, c_uint32, c_uint64, c_uint64,
                                   c_void_p, c_size_t, c_uint32, c_void_p]),
        "engram_gate_from_kv": (st, [CTX, c_uint32, c_uint32, c_void_p, c_size_t, c_void_p, c_size_t, c_uint32,
                                     c_void_p, c_size_t, c_uint32, c_void_p]),
        "engram_apply_rows": (st, [CTX, c_uint32, c_uint32, c_void_p, c_size_t, c_void_p, c_size_t, c_uint32,
                                   c_void_p, c_size_t, c_uint32, c_void_p]),
    }


def _load() -> ctypes.CDLL:
    path = os.environ.get("ENGRAM_LIBRARY") or os.path.join(_HERE, "libengram.so")
    lib = ctypes.CDLL(path)
    for name, (res, args) in _prototypes().items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    version = lib.engram_version().decode()
    if version != S.HEADER_VERSION:
        raise ImportError(
            f"engram: {path} is version {version}, the package was built for {S.HEADER_VERSION}"
        )
    return lib


lib = _load()

# Unused imports kept for the prototypes' readers.
__all__ = ["lib", "S", "CTX", "P_I32", "P_I64", "P_U16", "c_uint64"]
