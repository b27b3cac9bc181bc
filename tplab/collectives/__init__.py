"""tplab.collectives — the collectives, written by hand. The public functions live here:

    allreduce(x, comm, op="sum", algorithm="auto")       -> same shape and dtype as x, on every rank
    reduce_scatter(x, comm, op="sum", algorithm="auto")  -> this rank's block of the reduced flat vector
                                                            (blocks cut like numpy.array_split(flat, p))
    allgather(x, comm, algorithm="auto")                 -> 1-D concatenation of every rank's flat x
                                                            (ranks may contribute different lengths)
    broadcast(x, comm, root=0, algorithm="auto")         -> root's array on every rank
    reduce(x, comm, root=0, op="sum", algorithm="auto")  -> the reduction on root, None elsewhere

Each takes numpy arrays (any shape, contiguous or not) or CPU torch tensors, leaves ``x`` unchanged and
returns a new array of the same kind. ``check=False`` skips the cross-rank argument agreement (for
benchmarks). The algorithms themselves are in ring.py, recursive.py, binomial.py, naive.py and
hierarchical.py.
"""

from __future__ import annotations

import numpy as np

from tplab.collectives import auto, snapshots
from tplab.collectives.binomial import binomial_broadcast, binomial_reduce, tree_allreduce
from tplab.collectives.checks import CollectiveArgumentError, agree_on_arguments
from tplab.collectives.hierarchical import hierarchical_allreduce
from tplab.collectives.naive import naive_allreduce
from tplab.collectives.recursive import (
    rabenseifner_allreduce,
    recursive_doubling_allgather,
    recursive_doubling_allreduce,
    recursive_halving_reduce_scatter,
)
from tplab.collectives.ring import ring_allgather, ring_allreduce, ring_reduce_scatter
from tplab.blocks import block_bounds, offsets
from tplab.ops import get_op

ALGORITHMS = {
    "allreduce": ("naive", "ring", "recursive_doubling", "rabenseifner", "tree", "hierarchical", "builtin", "auto"),
    "reduce_scatter": ("ring", "recursive_halving", "builtin", "auto"),
    "allgather": ("ring", "recursive_doubling", "builtin", "auto"),
    "broadcast": ("binomial", "builtin", "auto"),
    "reduce": ("binomial", "builtin", "auto"),
}


# ---- numpy in, the caller's type out -----------------------------------------------------------------------
def _as_numpy(x):
    """Return (numpy view of x, function that converts a numpy result back to x's kind)."""
    if type(x).__module__.split(".")[0] == "torch":
        import torch

        if x.device.type != "cpu":
            raise TypeError(f"tplab's MPI transport works on CPU tensors; got one on {x.device}")
        if x.dtype == torch.bfloat16:
            raise TypeError("bfloat16 has no numpy dtype: convert to float32 for the CPU transport")
        return x.detach().contiguous().numpy(), torch.from_numpy
    return np.asarray(x), (lambda a: a)


def _flat_input(arr):
    """x as a flat, contiguous, native-endian array: a view of x when it already is one (read only)."""
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("=")).reshape(-1)


def _working_copy(arr):
    """A flat, contiguous copy the algorithm may overwrite (so the caller's x stays unchanged)."""
    return np.array(arr, dtype=arr.dtype.newbyteorder("="), copy=True, order="C").reshape(-1)


def _world_if_none(comm):
    if comm is None:
        from tplab.comm import world

        return world()
    return comm


# ---- the collectives -------------------------------------------------------------------------------------------
# The hand-written allreduces, each called as f(buf, comm, op, source) with the result going to buf.
# Ring, recursive doubling and Rabenseifner read this rank's input from ``source`` on first touch, so
# the input is never copied (at 64 KiB - 1 MiB that copy is a noticeable part of the time); the others
# work in place on a copy (source is buf).
ALLREDUCE_BY_NAME = {
    "naive": lambda buf, comm, op, source: naive_allreduce(buf, comm, op),
    "ring": lambda buf, comm, op, source: ring_allreduce(buf, comm, op, block_bounds(buf.size, comm.size), source),
    "recursive_doubling": lambda buf, comm, op, source: recursive_doubling_allreduce(buf, comm, op, source),
    "rabenseifner": lambda buf, comm, op, source: rabenseifner_allreduce(buf, comm, op, source),
    "tree": lambda buf, comm, op, source: tree_allreduce(buf, comm, op),
    "hierarchical": lambda buf, comm, op, source: hierarchical_allreduce(buf, comm, op),
}
READS_SOURCE = {"ring", "recursive_doubling", "rabenseifner"}


def _resolve(collective, algorithm, nbytes, count, p):
    """The algorithm to run: ``auto`` asks auto.py (a tuning table may name anything, so check it)."""
    if algorithm != "auto":
        return algorithm
    chosen = auto.choose(collective, nbytes, count, p)
    if chosen not in ALGORITHMS[collective] or chosen == "auto":
        raise CollectiveArgumentError(
            f"{collective}: the tuning table in use chose {chosen!r}, which is not one of "
            f"{list(ALGORITHMS[collective])}: fix the table or tuning.use_table(None)")
    return chosen


def allreduce(x, comm=None, op="sum", algorithm="auto", *, check=True):
    comm = _world_if_none(comm)
    arr, back = _as_numpy(x)
    agree_on_arguments(comm, "allreduce", arr, algorithm=algorithm, algorithms=ALGORITHMS["allreduce"],
                       op=op, check=check)
    algorithm = _resolve("allreduce", algorithm, arr.nbytes, arr.size, comm.size)
    if algorithm == "builtin":
        return back(comm.builtin_allreduce(arr, op).reshape(arr.shape))
    source = _flat_input(arr)
    if algorithm in READS_SOURCE and comm.size > 1 and not snapshots.is_recording():
        buf = np.empty_like(source)  # every element is written before it is read
    else:
        buf = source.copy()  # (pictures need the start state in buf; one rank has nothing to do)
        source = buf
    if buf.size:
        ALLREDUCE_BY_NAME[algorithm](buf, comm, get_op(op), source)
    return back(buf.reshape(arr.shape))


def reduce_scatter(x, comm=None, op="sum", algorithm="auto", *, check=True):
    comm = _world_if_none(comm)
    arr, back = _as_numpy(x)
    agree_on_arguments(comm, "reduce_scatter", arr, algorithm=algorithm,
                       algorithms=ALGORITHMS["reduce_scatter"], op=op, check=check)
    algorithm = _resolve("reduce_scatter", algorithm, arr.nbytes, arr.size, comm.size)
    if algorithm == "builtin":
        return back(comm.builtin_reduce_scatter(arr, op))
    buf, reduce_op = _working_copy(arr), get_op(op)
    bounds = block_bounds(buf.size, comm.size)
    if algorithm == "ring":
        return back(ring_reduce_scatter(buf, comm, reduce_op, bounds))
    return back(recursive_halving_reduce_scatter(buf, comm, reduce_op, bounds))


def allgather(x, comm=None, algorithm="auto", *, check=True):
    comm = _world_if_none(comm)
    arr, back = _as_numpy(x)
    agree_on_arguments(comm, "allgather", arr, algorithm=algorithm, algorithms=ALGORITHMS["allgather"],
                       same_shape=False, check=check)
    mine = _working_copy(arr)
    # every rank must know every contribution's length to place it (allgatherv): metadata, not counted
    bounds = offsets(comm.allgather_object(mine.size))
    algorithm = _resolve("allgather", algorithm, bounds[-1] * mine.itemsize, bounds[-1], comm.size)
    if algorithm == "builtin":
        return back(comm.builtin_allgather(arr))
    if algorithm == "ring":
        return back(ring_allgather(mine, comm, bounds))
    return back(recursive_doubling_allgather(mine, comm, bounds))


def broadcast(x, comm=None, root=0, algorithm="auto", *, check=True):
    comm = _world_if_none(comm)
    arr, back = _as_numpy(x)
    agree_on_arguments(comm, "broadcast", arr, algorithm=algorithm, algorithms=ALGORITHMS["broadcast"],
                       root=root, check=check)
    if algorithm == "builtin":
        return back(comm.builtin_broadcast(arr, root).reshape(arr.shape))
    buf = _working_copy(arr)
    if buf.size:
        binomial_broadcast(buf, comm, root)
    return back(buf.reshape(arr.shape))


def reduce(x, comm=None, root=0, op="sum", algorithm="auto", *, check=True):
    comm = _world_if_none(comm)
    arr, back = _as_numpy(x)
    agree_on_arguments(comm, "reduce", arr, algorithm=algorithm, algorithms=ALGORITHMS["reduce"],
                       op=op, root=root, check=check)
    if algorithm == "builtin":
        out = comm.builtin_reduce(arr, op, root)
        return back(out.reshape(arr.shape)) if comm.rank == root else None
    buf = _working_copy(arr)
    if buf.size:
        binomial_reduce(buf, comm, get_op(op), root)
    return back(buf.reshape(arr.shape)) if comm.rank == root else None


__all__ = [
    "ALGORITHMS",
    "CollectiveArgumentError",
    "allgather",
    "allreduce",
    "broadcast",
    "reduce",
    "reduce_scatter",
]
