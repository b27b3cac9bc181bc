"""Scratch buffers kept between calls: the space for what arrives from a peer.

A first version allocates that space afresh on every call. At a megabyte and up that is expensive: the
operating system hands out fresh pages that are filled with zeros on first touch (page faults), which
can cost more than the transfer itself. MPI libraries and NCCL allocate their staging buffers once;
so does tplab: one grow-only buffer per purpose, of which each call takes a view. These views are never
returned to the caller (results always go to fresh arrays), and each purpose has its own name so that
one algorithm calling another never shares a buffer with it.
"""

from __future__ import annotations

import numpy as np

_buffers: dict[tuple, np.ndarray] = {}


def scratch(purpose: str, count: int, dtype) -> np.ndarray:
    """A reusable 1-D buffer of ``count`` elements of ``dtype`` (contents undefined)."""
    key = (purpose, np.dtype(dtype).str)
    buf = _buffers.get(key)
    if buf is None or buf.size < count:
        buf = _buffers[key] = np.empty(max(count, 1), dtype=dtype)
    return buf[:count]


def release_all() -> None:
    """Forget every scratch buffer (frees the memory)."""
    _buffers.clear()
