"""Snapshots of an algorithm's working buffer after each step, for drawing "which chunk sits where".

The algorithms call ``snapshot(label, buf, at_round=k)`` at the end of every step; it does nothing
unless a ``recording()`` block is active on this rank, so the hooks cost one global lookup in normal
runs. ``at_round`` is the algorithm's own step count (the "round" of the lecture's pseudo-code), which
lines the ranks up in a picture: wall-clock order would not, when ranks outnumber cores.

    with recording() as steps:
        tplab.allreduce(x, comm, algorithm="ring")
    steps   # [("start", array, 0), ("reduce-scatter step 1", array, 1), ...]

Run it with x = 2**rank (integers, op "sum"): every element of a snapshot is then a bit mask of the
ranks whose contributions it already holds. ``tplab.lab.step_pictures.draw_allreduce_steps`` turns that into
the picture.
"""

from __future__ import annotations

import contextlib

_active: list | None = None


def is_recording() -> bool:
    return _active is not None


def snapshot(label: str, buf, at_round: float) -> None:
    if _active is not None:
        _active.append((label, buf.copy(), at_round))


@contextlib.contextmanager
def recording():
    global _active
    previous, _active = _active, []
    try:
        yield _active
    finally:
        _active = previous


def trace_allreduce(algorithm: str, count: int | None = None, comm=None, ranks: int | None = None,
                    device: str = "cpu"):
    """Run one allreduce with x = 2**rank (op sum) on this rank while recording; return this rank's
    steps as ``{"rank": r, "size": p, "steps": [(label, [mask, ...], round), ...]}``. Call it on every
    rank. ``ranks=k`` runs it on the first k ranks only (a sub-communicator; the others return None),
    which is how a notebook shows p = 3 on a cluster of 4. ``device="gpu"``: on each rank's GPU over
    NCCL (tplab.comm.communicator), the snapshots copied back to the host.

    Each number is a bit mask: bit j set <=> rank j's contribution is included in that element."""
    import numpy as np

    import tplab
    from tplab.comm import communicator
    from tplab.comm.devices import to_device, to_host

    comm = comm or communicator(device)
    if ranks is not None:
        sub = comm.split(color=0 if comm.rank < ranks else 1)
        if comm.rank >= ranks:
            return None
        comm = sub
    count = comm.size if count is None else count
    x = np.full(count, 1 << comm.rank, dtype=np.int64)
    x = to_device(x, "gpu") if comm.moves_gpu_memory else x
    with recording() as steps:
        tplab.allreduce(x, comm, algorithm=algorithm)
    return {"rank": comm.rank, "size": comm.size,
            "steps": [(label, to_host(buf).tolist(), k) for label, buf, k in steps]}
