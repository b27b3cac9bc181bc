"""Scratch buffers kept between calls: the space for what arrives from a peer.

A first version allocates that space afresh on every call. At a megabyte and up that is expensive: the
operating system hands out fresh pages that are filled with zeros on first touch (page faults), which
can cost more than the transfer itself. MPI libraries and NCCL allocate their staging buffers once;
so does tplab: one grow-only buffer per purpose, of which each call takes a view. These views are never
returned to the caller (results always go to fresh arrays), and each purpose has its own name so that
one algorithm calling another never shares a buffer with it. Each thread has its own buffers: a
progress thread (tplab.overlap) running a ring while the main thread runs another must not share
"ring incoming".

GPU arrays get GPU scratch (``like=``: allocated by the input's array module), one per device and
stream. Reuse is safe there too: every kernel and message of an algorithm is queued on the caller's
current stream, in order, so one call's last use of a buffer precedes the next call's first.
"""

from __future__ import annotations

import threading

import numpy as np

from tplab.toolkit.arrays import array_module

_buffers: dict[tuple, np.ndarray] = {}


def scratch(purpose: str, count: int, dtype, like=None) -> np.ndarray:
    """A reusable 1-D buffer of ``count`` elements of ``dtype`` (contents undefined), in host memory or,
    when ``like`` is a GPU array, on its device."""
    thread = threading.get_ident()
    if like is None or type(like) is np.ndarray:
        key, xp = (thread, purpose, np.dtype(dtype).str), np
    else:
        xp = array_module(like)
        key = (thread, purpose, np.dtype(dtype).str, xp.__name__, like.device.id, xp.cuda.get_current_stream().ptr)
    buf = _buffers.get(key)
    if buf is None or buf.size < count:
        buf = _buffers[key] = xp.empty(max(count, 1), dtype=dtype)
    return buf[:count]


def forget_thread(ident: int) -> None:
    """Free the buffers of a thread that has finished (``threading.get_ident()`` of it)."""
    for key in [k for k in _buffers if k[0] == ident]:
        del _buffers[key]
