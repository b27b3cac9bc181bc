"""tplab.collectives — the collectives, written by hand. The public functions live here:

    allreduce(x, comm, op="sum", algorithm="auto")       -> same shape and dtype as x, on every rank
    reduce_scatter(x, comm, op="sum", algorithm="auto")  -> this rank's block of the reduced flat vector
                                                            (blocks cut like numpy.array_split(flat, p))
    allgather(x, comm, algorithm="auto")                 -> 1-D concatenation of every rank's flat x
                                                            (ranks may contribute different lengths)
    broadcast(x, comm, root=0, algorithm="auto")         -> root's array on every rank
    reduce(x, comm, root=0, op="sum", algorithm="auto")  -> the reduction on root, None elsewhere
    alltoall(x, comm, algorithm="pairwise")              -> (p, ...): out[j] is rank j's x[my rank]
                                                            ("bruck": ⌈lg p⌉ messages, for small blocks)
    alltoallv(x, send_counts, comm, recv_counts=None)    -> the rows every rank sent me, in rank order
                                                            (variable counts: mixture-of-experts dispatch)

Each takes numpy arrays (any shape, contiguous or not), CuPy arrays or torch tensors (CPU, or CUDA with
bfloat16 too), leaves ``x`` unchanged and returns a new array of the same kind. GPU data stay on the GPU
(``tplab.toolkit.arrays``) and need a transport that moves GPU memory (``tplab.comm.nccl_world()``,
``tplab.comm.StagedComm``, ``tplab.gpu_collectives.PeerMemoryComm``). ``check=False`` skips the cross-rank
argument agreement (for benchmarks).

``algorithm`` names a hand-written algorithm (ring.py, recursive.py, binomial.py, naive.py,
hierarchical.py), "builtin" (the transport's own collective: MPI's, NCCL's, tplab's GPU kernels) or "auto"
(the transport's own where it prefers it, else the tuning table or MPICH's rules; where the transport's
own refuses the arguments, a hand-written algorithm). Everything goes through the one Communicator
contract (tplab.comm.base): this module never looks inside a transport.

Plans: ``allreduce``, ``reduce_scatter`` and ``allgather`` keep, per communicator, a plan per kind of input
(shape, dtype, device, stream for GPU arrays). A transport with a persistent fast path (``comm.plan``)
then costs per call about what its kernel costs; the others do every step per call.
"""

from __future__ import annotations

import contextlib

import numpy as np

from tplab.collectives import auto, snapshots
from tplab.collectives.alltoall import alltoall  # pairwise or Bruck (sequence parallelism: Ulysses; MoE)
from tplab.collectives.alltoallv import alltoallv  # variable counts per destination (MoE dispatch, combine)
from tplab.collectives.binomial import binomial_broadcast, binomial_reduce, tree_allreduce
from tplab.collectives.checks import agree_on_arguments
from tplab.comm.base import CollectiveArgumentError, Unsupported
from tplab.collectives.hierarchical import hierarchical_allreduce
from tplab.collectives.naive import naive_allreduce
from tplab.collectives.recursive import (
    rabenseifner_allreduce,
    recursive_doubling_allgather,
    recursive_doubling_allreduce,
    recursive_halving_reduce_scatter,
)
from tplab.collectives.ring import ring_allgather, ring_allreduce, ring_reduce_scatter
from tplab.toolkit.arrays import array_module, as_array, gpu_scope, is_gpu_array, is_torch, torch_stream_pointer
from tplab.toolkit.bfloat16 import bfloat16_op
from tplab.toolkit.blocks import block_bounds, offsets
from tplab.toolkit.ops import OPS, get_op

ALGORITHMS = {
    "allreduce": ("naive", "ring", "recursive_doubling", "rabenseifner", "tree", "hierarchical", "builtin", "auto"),
    "reduce_scatter": ("ring", "recursive_halving", "builtin", "auto"),
    "allgather": ("ring", "recursive_doubling", "builtin", "auto"),
    "broadcast": ("binomial", "builtin", "auto"),
    "reduce": ("binomial", "builtin", "auto"),
}
# What "auto" falls back to where a transport's own collective refuses the arguments (a dtype NCCL cannot
# reduce, a message larger than peer memory): a hand-written algorithm, which handles every dtype.
FALLBACK = {"allreduce": "ring", "reduce_scatter": "ring", "allgather": "ring", "broadcast": "binomial",
            "reduce": "binomial"}
MAX_PLANS = 256  # per communicator: a program that cycles through more shapes starts over


# ---- numpy or CuPy in, the caller's type out (tplab.toolkit.arrays) -----------------------------------------
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


def _resolve(collective, algorithm, nbytes, count, comm):
    """The algorithm to run. "auto": the transport's own collective where it prefers it (or has nothing
    else), else the tuning table or MPICH's rules (auto.py; a table may name anything, so check it). A
    transport without point-to-point runs its own collective whatever the name."""
    if not comm.point_to_point or (algorithm == "auto" and comm.prefers_builtin):
        return "builtin"
    if algorithm != "auto":
        return algorithm
    chosen = auto.choose(collective, nbytes, count, comm.size)
    if chosen not in ALGORITHMS[collective] or chosen == "auto":
        raise CollectiveArgumentError(
            f"{collective}: the tuning table in use chose {chosen!r}, which is not one of "
            f"{list(ALGORITHMS[collective])}: fix the table or tuning.use_table(None)")
    return chosen


def _builtin_or_fallback(collective, comm, algorithm, run_builtin, run_algorithm):
    """The transport's own collective; where it refuses these arguments (alike on every rank), the
    hand-written FALLBACK for "auto", a clear error for an explicit "builtin"."""
    try:
        return run_builtin()
    except Unsupported as refusal:
        if algorithm != "auto" or not comm.point_to_point:
            raise CollectiveArgumentError(f"{collective}: {refusal}") from None
    return run_algorithm(FALLBACK[collective])


def _convert(x, comm, collective, algorithm, check):
    """(array, back, bfloat16, scope): x as a numpy or CuPy array (tplab.toolkit.arrays) and where its GPU
    work runs (its device, and torch's current stream for a torch tensor). An input that cannot be
    converted (a bfloat16 CPU tensor, a tensor on another device type) still joins the agreement, as a
    problem, so that the other ranks raise too instead of waiting for this one."""
    try:
        arr, back, bf16 = as_array(x)
    except TypeError as e:
        if check:
            agree_on_arguments(comm, collective, np.zeros(0, np.uint8), algorithm=algorithm,
                               algorithms=(algorithm,), check=True, problems=[str(e)])
        raise CollectiveArgumentError(f"{collective} on rank {comm.rank}: {e}") from None
    return arr, back, bf16, (_NO_SCOPE if type(arr) is np.ndarray else gpu_scope(x, arr))


_NO_SCOPE = contextlib.nullcontext()


def _plan_key(collective, x, op, algorithm, check):
    """The key of a call's plan: the collective, its arguments, and what a plan depends on -- for GPU arrays
    the shape, dtype, layout, device and current stream (a persistent kernel launch is tied to them); host
    arrays take the general path, whatever their shape."""
    kind = type(x)
    if kind is np.ndarray:
        return collective, (kind,), op, algorithm, check
    if is_torch(x):
        if not x.is_cuda:
            return collective, (kind, "cpu"), op, algorithm, check
        device = x.get_device()
        return (collective, (kind, x.shape, x.dtype, device, x.is_contiguous(), torch_stream_pointer(device)), op,
                algorithm, check)
    if is_gpu_array(x):
        import cupy

        return (collective, (kind, x.shape, x.dtype.str, x.device.id, x.flags.c_contiguous,
                             cupy.cuda.get_current_stream().ptr), op, algorithm, check)
    return collective, (kind,), op, algorithm, check


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


def allreduce(x, comm=None, op="sum", algorithm="auto", *, check=True):
    if comm is not None:  # (a plan made before: called at once -- each call layer costs a small GPU call time)
        plan = comm.plans.get(_plan_key("allreduce", x, op, algorithm, check))
        if plan is not None:
            return plan(x, comm)
    return _planned("allreduce", x, _world_if_none(comm), op, algorithm, check, _allreduce_each_call)


def _planned(collective, x, comm, op, algorithm, check, each_call):
    """A plan per kind of input: the transport's persistent fast path where it has one for the builtin
    route (e.g. peer-memory kernels on GPUs: no per-call conversion, host round trip or argument all-gather),
    else ``each_call``: convert x, agree on the arguments on every rank, run the algorithm."""
    key = _plan_key(collective, x, op, algorithm, check)
    plan = comm.plans.get(key)
    if plan is None:
        if len(comm.plans) >= MAX_PLANS:
            comm.plans.clear()
        builtin_route = algorithm == "builtin" or not comm.point_to_point or (algorithm == "auto" and comm.prefers_builtin)
        fast = comm.plan(collective, x, op, algorithm) if builtin_route and (op is None or op in OPS) else None
        plan = comm.plans[key] = fast or (lambda x, comm: each_call(x, comm, op, algorithm, check))
    return plan(x, comm)  # (a plan never holds its communicator: a cycle would leave a sub-communicator, and its
    #                       NCCL communicator, to be destroyed by the garbage collector at a different moment on
    #                       every rank -- a hang)


def _allreduce_each_call(x, comm, op, algorithm, check):
    arr, back, bf16, scope = _convert(x, comm, "allreduce", algorithm, check)
    with scope:
        agree_on_arguments(comm, "allreduce", arr, algorithm=algorithm, algorithms=ALGORITHMS["allreduce"], op=op,
                           check=check, bfloat16=bf16)
        chosen = _resolve("allreduce", algorithm, arr.nbytes, arr.size, comm)
        reduce_op, builtin_op = _ops(op, bf16)
        if chosen != "builtin":
            return _allreduce(arr, back, comm, reduce_op, chosen)
        return _builtin_or_fallback(
            "allreduce", comm, algorithm,
            lambda: back(comm.builtin_allreduce(arr, builtin_op).reshape(arr.shape)),
            lambda name: _allreduce(arr, back, comm, reduce_op, name))


def _allreduce(arr, back, comm, reduce_op, algorithm):
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
    return _planned("reduce_scatter", x, _world_if_none(comm), op, algorithm, check, _reduce_scatter_each_call)


def _reduce_scatter_each_call(x, comm, op, algorithm, check):
    arr, back, bf16, scope = _convert(x, comm, "reduce_scatter", algorithm, check)
    with scope:
        agree_on_arguments(comm, "reduce_scatter", arr, algorithm=algorithm,
                           algorithms=ALGORITHMS["reduce_scatter"], op=op, check=check, bfloat16=bf16)
        chosen = _resolve("reduce_scatter", algorithm, arr.nbytes, arr.size, comm)
        reduce_op, builtin_op = _ops(op, bf16)
        if chosen != "builtin":
            return _reduce_scatter(arr, back, comm, reduce_op, chosen)
        return _builtin_or_fallback("reduce_scatter", comm, algorithm,
                                    lambda: back(comm.builtin_reduce_scatter(arr, builtin_op)),
                                    lambda name: _reduce_scatter(arr, back, comm, reduce_op, name))


def _reduce_scatter(arr, back, comm, reduce_op, algorithm):
    buf = _working_copy(arr)
    bounds = block_bounds(buf.size, comm.size)
    if algorithm == "ring":
        return back(ring_reduce_scatter(buf, comm, reduce_op, bounds))
    return back(recursive_halving_reduce_scatter(buf, comm, reduce_op, bounds))


def allgather(x, comm=None, algorithm="auto", *, check=True):
    return _planned("allgather", x, _world_if_none(comm), None, algorithm, check,
                    lambda x, comm, op, algorithm, check: _allgather_each_call(x, comm, algorithm, check))


def _allgather_each_call(x, comm, algorithm, check):
    arr, back, bf16, scope = _convert(x, comm, "allgather", algorithm, check)  # (bf16 bits are only moved)
    with scope:
        agree_on_arguments(comm, "allgather", arr, algorithm=algorithm, algorithms=ALGORITHMS["allgather"],
                           same_shape=False, check=check, bfloat16=bf16)
        if not comm.point_to_point or (algorithm == "auto" and comm.prefers_builtin) or algorithm == "builtin":
            return _builtin_or_fallback("allgather", comm, algorithm, lambda: back(comm.builtin_allgather(arr)),
                                        lambda name: _allgather(arr, back, comm, name))
        return _allgather(arr, back, comm, algorithm)


def _allgather(arr, back, comm, algorithm):
    mine = _working_copy(arr)
    # every rank must know every contribution's length to place it (allgatherv): metadata, not counted
    bounds = offsets(comm.allgather_object(mine.size))
    algorithm = _resolve("allgather", algorithm, bounds[-1] * mine.itemsize, bounds[-1], comm)
    if algorithm == "builtin":
        return back(comm.builtin_allgather(arr))
    if algorithm == "ring":
        return back(ring_allgather(mine, comm, bounds))
    return back(recursive_doubling_allgather(mine, comm, bounds))


def broadcast(x, comm=None, root=0, algorithm="auto", *, check=True):
    comm = _world_if_none(comm)
    arr, back, bf16, scope = _convert(x, comm, "broadcast", algorithm, check)
    with scope:
        agree_on_arguments(comm, "broadcast", arr, algorithm=algorithm, algorithms=ALGORITHMS["broadcast"],
                           root=root, check=check, bfloat16=bf16)
        chosen = _resolve("broadcast", algorithm, arr.nbytes, arr.size, comm)
        if chosen != "builtin":
            return _broadcast(arr, back, comm, root)
        return _builtin_or_fallback("broadcast", comm, algorithm,
                                    lambda: back(comm.builtin_broadcast(arr, root).reshape(arr.shape)),
                                    lambda name: _broadcast(arr, back, comm, root))


def _broadcast(arr, back, comm, root):
    buf = _working_copy(arr)
    if buf.size:
        binomial_broadcast(buf, comm, root)
    return back(buf.reshape(arr.shape))


def reduce(x, comm=None, root=0, op="sum", algorithm="auto", *, check=True):
    comm = _world_if_none(comm)
    arr, back, bf16, scope = _convert(x, comm, "reduce", algorithm, check)
    with scope:
        agree_on_arguments(comm, "reduce", arr, algorithm=algorithm, algorithms=ALGORITHMS["reduce"],
                           op=op, root=root, check=check, bfloat16=bf16)
        chosen = _resolve("reduce", algorithm, arr.nbytes, arr.size, comm)
        reduce_op, builtin_op = _ops(op, bf16)
        if chosen != "builtin":
            return _reduce(arr, back, comm, reduce_op, root)

        def builtin():
            out = comm.builtin_reduce(arr, builtin_op, root)
            return back(out.reshape(arr.shape)) if comm.rank == root else None
        return _builtin_or_fallback("reduce", comm, algorithm, builtin,
                                    lambda name: _reduce(arr, back, comm, reduce_op, root))


def _reduce(arr, back, comm, reduce_op, root):
    buf = _working_copy(arr)
    if buf.size:
        binomial_reduce(buf, comm, reduce_op, root)
    return back(buf.reshape(arr.shape)) if comm.rank == root else None


__all__ = [
    "ALGORITHMS",
    "CollectiveArgumentError",
    "allgather",
    "alltoall",
    "alltoallv",
    "allreduce",
    "broadcast",
    "reduce",
    "reduce_scatter",
]
