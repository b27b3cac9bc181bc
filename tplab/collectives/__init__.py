"""tplab.collectives — the collectives, written by hand. The public functions live here:

    allreduce(x, comm, op="sum", algorithm="auto")       -> same shape and dtype as x, on every rank
    reduce_scatter(x, comm, op="sum", algorithm="auto")  -> this rank's block of the reduced flat vector
                                                            (blocks cut like numpy.array_split(flat, p))
    allgather(x, comm, algorithm="auto")                 -> 1-D concatenation of every rank's flat x
                                                            (ranks may contribute different lengths)
    broadcast(x, comm, root=0, algorithm="auto")         -> root's array on every rank
    reduce(x, comm, root=0, op="sum", algorithm="auto")  -> the reduction on root, None elsewhere

Each takes numpy arrays (any shape, contiguous or not), CuPy arrays or torch tensors (CPU, or CUDA with
bfloat16 too), leaves ``x`` unchanged and returns a new array of the same kind. GPU data stay on the GPU
(``tplab.toolkit.arrays``) and need a transport that moves GPU memory (``tplab.comm.nccl_world()``,
``tplab.comm.StagedComm``). ``check=False`` skips the cross-rank argument agreement (for benchmarks).
The algorithms themselves are in ring.py, recursive.py, binomial.py, naive.py and hierarchical.py.
"""

from __future__ import annotations

import numpy as np

from tplab.collectives import auto, snapshots
from tplab.collectives.alltoall import alltoall  # pairwise exchange (sequence parallelism: Ulysses)
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
from tplab.toolkit.arrays import array_module, as_array, gpu_scope
from tplab.toolkit.bfloat16 import bfloat16_op
from tplab.toolkit.blocks import block_bounds, offsets
from tplab.toolkit.ops import get_op

ALGORITHMS = {
    "allreduce": ("naive", "ring", "recursive_doubling", "rabenseifner", "tree", "hierarchical", "builtin", "auto"),
    "reduce_scatter": ("ring", "recursive_halving", "builtin", "auto"),
    "allgather": ("ring", "recursive_doubling", "builtin", "auto"),
    "broadcast": ("binomial", "builtin", "auto"),
    "reduce": ("binomial", "builtin", "auto"),
}
# GPU all-reduces by peer-memory kernels (tplab.gpu_collectives.peer_memory), for a communicator with peer memory
# attached; not algorithms over send/recv, so not in ALGORITHMS (whose entries run on every transport).
PEER_ALLREDUCE = ("peer_one_shot", "peer_two_shot", "peer_ring")


# ---- numpy or CuPy in, the caller's type out (tplab.toolkit.arrays) -------------------------------------------------
def _flat_input(arr):
    """x as a flat, contiguous, native-endian array: a view of x when it already is one (read only)."""
    if type(arr) is not np.ndarray:  # CuPy: always native-endian
        return array_module(arr).ascontiguousarray(arr).reshape(-1)
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("=")).reshape(-1)


def _working_copy(arr):
    """A flat, contiguous copy the algorithm may overwrite (so the caller's x stays unchanged)."""
    if type(arr) is not np.ndarray:
        return array_module(arr).array(arr, copy=True, order="C").reshape(-1)
    return np.array(arr, dtype=arr.dtype.newbyteorder("="), copy=True, order="C").reshape(-1)


def _on_the_gpu(x, arr, comm):
    """Where GPU work for ``x`` runs (its device; torch's current stream for a tensor), after checking that
    the transport moves GPU memory: handing GPU arrays to host MPI would crash or return garbage."""
    if not comm.moves_gpu_memory:
        raise TypeError(f"{type(comm).__name__} moves host memory; for GPU arrays use tplab.comm.nccl_world() "
                        "or tplab.comm.StagedComm")
    return gpu_scope(x, arr)


def _ops(op, bfloat16: bool):
    """(op for the algorithms, op for the built-in): the bfloat16 variant where the array holds bf16 bits
    (tplab.toolkit.bfloat16), which the built-in needs to be told about too."""
    if bfloat16:
        reduce_op = bfloat16_op(op)
        return reduce_op, reduce_op
    return get_op(op), op


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


# Each public function converts x (tplab.toolkit.arrays), checks the arguments on every rank, and runs the body
# directly for host arrays, or inside the GPU's device and stream scope for GPU arrays.
def allreduce(x, comm=None, op="sum", algorithm="auto", *, check=True):
    comm = _world_if_none(comm)
    arr, back, bf16 = as_array(x)
    agree_on_arguments(comm, "allreduce", arr, algorithm=algorithm, algorithms=ALGORITHMS["allreduce"] + PEER_ALLREDUCE,
                       op=op, check=check)
    peers = getattr(comm, "peers", None)  # GPU peer memory (NcclComm.attach_peer_memory): its own kernels
    gpu = type(arr) is not np.ndarray
    if algorithm == "auto" and gpu and peers is not None and op == "sum" and arr.nbytes <= peers.nbytes:
        algorithm = "peer_" + peers.choose(arr.nbytes).removesuffix("_pull")  # by size, from measurements
    if algorithm.startswith("peer_"):
        return _peer_allreduce(x, arr, back, bf16, comm, op, algorithm)
    algorithm = _resolve("allreduce", algorithm, arr.nbytes, arr.size, comm.size)
    if not gpu:
        return _allreduce(arr, back, comm, get_op(op), op, algorithm)
    with _on_the_gpu(x, arr, comm):
        return _allreduce(arr, back, comm, *_ops(op, bf16), algorithm)


def _peer_allreduce(x, arr, back, bf16, comm, op, algorithm):
    """The peer-memory kernels (tplab.gpu_collectives.peer_memory): one kernel per all-reduce, flags in GPU memory."""
    peers = getattr(comm, "peers", None)
    if peers is None or type(arr) is np.ndarray or op != "sum":
        raise CollectiveArgumentError(
            f"allreduce: {algorithm} sums GPU arrays through peer memory: use a GPU communicator with it "
            "attached (comm = tplab.comm.nccl_world(); comm.attach_peer_memory(max_bytes)) and op='sum'")
    with _on_the_gpu(x, arr, comm):
        out = peers.allreduce(arr.reshape(-1), algorithm.removeprefix("peer_"), bf16=bf16, check=False)
    return back(out.reshape(arr.shape))


def _allreduce(arr, back, comm, reduce_op, builtin_op, algorithm):
    if algorithm == "builtin":
        return back(comm.builtin_allreduce(arr, builtin_op).reshape(arr.shape))
    source = _flat_input(arr)
    if algorithm in READS_SOURCE and comm.size > 1 and not snapshots.is_recording():
        buf = array_module(source).empty_like(source)  # every element is written before it is read
    else:
        buf = source.copy()  # (pictures need the start state in buf; one rank has nothing to do)
        source = buf
    if buf.size:
        ALLREDUCE_BY_NAME[algorithm](buf, comm, reduce_op, source)
    return back(buf.reshape(arr.shape))


def reduce_scatter(x, comm=None, op="sum", algorithm="auto", *, check=True):
    comm = _world_if_none(comm)
    arr, back, bf16 = as_array(x)
    agree_on_arguments(comm, "reduce_scatter", arr, algorithm=algorithm,
                       algorithms=ALGORITHMS["reduce_scatter"], op=op, check=check)
    algorithm = _resolve("reduce_scatter", algorithm, arr.nbytes, arr.size, comm.size)
    if type(arr) is np.ndarray:
        return _reduce_scatter(arr, back, comm, get_op(op), op, algorithm)
    with _on_the_gpu(x, arr, comm):
        return _reduce_scatter(arr, back, comm, *_ops(op, bf16), algorithm)


def _reduce_scatter(arr, back, comm, reduce_op, builtin_op, algorithm):
    if algorithm == "builtin":
        return back(comm.builtin_reduce_scatter(arr, builtin_op))
    buf = _working_copy(arr)
    bounds = block_bounds(buf.size, comm.size)
    if algorithm == "ring":
        return back(ring_reduce_scatter(buf, comm, reduce_op, bounds))
    return back(recursive_halving_reduce_scatter(buf, comm, reduce_op, bounds))


def allgather(x, comm=None, algorithm="auto", *, check=True):
    comm = _world_if_none(comm)
    arr, back, _ = as_array(x)  # (bfloat16 bits are only moved, never combined)
    agree_on_arguments(comm, "allgather", arr, algorithm=algorithm, algorithms=ALGORITHMS["allgather"],
                       same_shape=False, check=check)
    if type(arr) is np.ndarray:
        return _allgather(arr, back, comm, algorithm)
    with _on_the_gpu(x, arr, comm):
        return _allgather(arr, back, comm, algorithm)


def _allgather(arr, back, comm, algorithm):
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
    arr, back, _ = as_array(x)
    agree_on_arguments(comm, "broadcast", arr, algorithm=algorithm, algorithms=ALGORITHMS["broadcast"],
                       root=root, check=check)
    if type(arr) is np.ndarray:
        return _broadcast(arr, back, comm, root, algorithm)
    with _on_the_gpu(x, arr, comm):
        return _broadcast(arr, back, comm, root, algorithm)


def _broadcast(arr, back, comm, root, algorithm):
    if algorithm == "builtin":
        return back(comm.builtin_broadcast(arr, root).reshape(arr.shape))
    buf = _working_copy(arr)
    if buf.size:
        binomial_broadcast(buf, comm, root)
    return back(buf.reshape(arr.shape))


def reduce(x, comm=None, root=0, op="sum", algorithm="auto", *, check=True):
    comm = _world_if_none(comm)
    arr, back, bf16 = as_array(x)
    agree_on_arguments(comm, "reduce", arr, algorithm=algorithm, algorithms=ALGORITHMS["reduce"],
                       op=op, root=root, check=check)
    if type(arr) is np.ndarray:
        return _reduce(arr, back, comm, get_op(op), op, root, algorithm)
    with _on_the_gpu(x, arr, comm):
        return _reduce(arr, back, comm, *_ops(op, bf16), root, algorithm)


def _reduce(arr, back, comm, reduce_op, builtin_op, root, algorithm):
    if algorithm == "builtin":
        out = comm.builtin_reduce(arr, builtin_op, root)
        return back(out.reshape(arr.shape)) if comm.rank == root else None
    buf = _working_copy(arr)
    if buf.size:
        binomial_reduce(buf, comm, reduce_op, root)
    return back(buf.reshape(arr.shape)) if comm.rank == root else None


__all__ = [
    "ALGORITHMS",
    "CollectiveArgumentError",
    "allgather",
    "alltoall",
    "allreduce",
    "broadcast",
    "reduce",
    "reduce_scatter",
]
