"""engram: DeepSeek-V4.1's engram layer (libengram) from Python.

    import engram
    with engram.Context.from_gguf("model.gguf", n_threads=4) as ctx:
        ids = ctx.hash(tokens, seq_ids, pos)
        ctx.apply(layer_id, ids, highway)   # highway updated in place

See docs/python.md.
"""

from ._context import (
    ROW_ID_DEAD,
    TOKEN_DEAD,
    Backend,
    Context,
    EngramError,
    Info,
    LayerInfo,
    Status,
    Type,
)
from ._lib import lib as _lib

__version__: str = _lib.engram_version().decode()

__all__ = [
    "Backend",
    "Context",
    "EngramError",
    "Info",
    "LayerInfo",
    "ROW_ID_DEAD",
    "Status",
    "TOKEN_DEAD",
    "Type",
    "__version__",
]
