"""Snapshots of an algorithm's working buffer after each step, for drawing "which chunk sits where".

The algorithms call ``snapshot(label, buf)`` at the end of every step; it does nothing unless a
``recording()`` block is active on this rank, so the hooks cost one global lookup in normal runs.

    with recording() as steps:
        tplab.allreduce(x, comm, algorithm="ring")
    steps   # [("start", array), ("reduce-scatter step 1", array), ...]

Run it with x = 2**rank (integers, op "sum"): every element of a snapshot is then a bit mask of the
ranks whose contributions it already holds. ``tplab.plots.draw_steps`` turns that into the picture.
"""

from __future__ import annotations

import contextlib

_active: list | None = None


def snapshot(label: str, buf) -> None:
    if _active is not None:
        _active.append((label, buf.copy()))


@contextlib.contextmanager
def recording():
    global _active
    previous, _active = _active, []
    try:
        yield _active
    finally:
        _active = previous
