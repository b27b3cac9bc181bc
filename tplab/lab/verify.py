"""Correctness and traffic tables, computed on every rank of the current communicator.

    allreduce_table()     every allreduce algorithm vs MPI_Allreduce over sizes, dtypes and ops
    count_traffic()       messages and bytes each rank really sent, per algorithm

Both are collective (call them on every rank, e.g. ``cluster.run(tplab.lab.verify.allreduce_table)``) and
return plain rows (lists of dicts) that are identical on every rank, ready for ``pandas.DataFrame``.
``device="gpu"``: the same on CuPy arrays on each rank's GPU, over NCCL point-to-point, against NCCL's
own allreduce (tplab.comm.communicator); results are compared on the host.
"""

from __future__ import annotations

import hashlib

import numpy as np

import tplab
from tplab.comm import MPIComm
from tplab.cost import allreduce_traffic
from tplab.comm import communicator
from tplab.comm.devices import to_device, to_host

# the single-node algorithms of notebook 01 (hierarchical, for several nodes, is notebook 03's)
HAND_WRITTEN = ["naive", "ring", "recursive_doubling", "rabenseifner", "tree"]


def _inputs(count, dtype, op, rank):
    rng = np.random.default_rng([count, rank])
    if np.dtype(dtype).kind == "i":
        return rng.integers(-9, 10, size=count).astype(dtype)
    if op == "prod":
        return rng.uniform(0.5, 2.0, size=count).astype(dtype)
    return rng.standard_normal(count).astype(dtype)


def allreduce_table(counts=None, dtypes=("int32", "int64", "float32", "float64"), ops=("sum", "max"),
                    algorithms=HAND_WRITTEN, comm=None, device="cpu") -> list[dict]:
    """One row per (algorithm, dtype, op, count): exact match with MPI_Allreduce (NCCL's on GPUs), largest
    relative difference (floats: the reduction order differs, so a few ulps are expected), and whether
    all ranks hold bitwise-identical results."""
    comm = comm or communicator(device)
    gpu = comm.moves_gpu_memory
    p = comm.size
    counts = counts or [0, 1, max(p - 1, 1), 2 * p + 1, 1000, (1 << 16) + 3]
    rows = []
    for count in counts:
        for dtype in dtypes:
            for op in ops:
                x = _inputs(count, dtype, op, comm.rank)
                x = to_device(x, "gpu") if gpu else x
                reference = to_host(comm.builtin_allreduce(x, op))
                for algorithm in algorithms:
                    y = to_host(tplab.allreduce(x, comm, op=op, algorithm=algorithm))
                    scale = np.maximum(np.abs(reference.astype(np.float64)), 1.0)
                    rel = float(np.max(np.abs(y.astype(np.float64) - reference) / scale)) if count else 0.0
                    digest = hashlib.sha256(y.tobytes()).hexdigest()
                    everyone = comm.allgather_object((rel, bool(np.array_equal(y, reference)), digest))
                    worst = max(e[0] for e in everyone)
                    exact = all(e[1] for e in everyone)
                    identical = len({e[2] for e in everyone}) == 1
                    tolerance = 0 if np.dtype(dtype).kind == "i" or op in ("max", "min") \
                        else 8 * p * np.finfo(dtype).eps
                    rows.append({"algorithm": algorithm, "dtype": dtype, "op": op, "count": count,
                                 "exact": exact, "max_rel_diff": worst, "identical_on_all_ranks": identical,
                                 "ok": identical and (exact or worst <= tolerance)})
    return rows


def count_traffic(count=None, algorithms=HAND_WRITTEN, dtype="float64", comm=None, device="cpu") -> list[dict]:
    """Run each algorithm once on ``count`` elements and report what this rank sent, next to the
    formula for the busiest rank (tplab.cost.allreduce_traffic). Rows differ per rank: collect them
    with ``cluster.run_df``, which adds the rank."""
    base = comm or communicator(device)
    p = base.size
    count = count or 64 * p
    rows = []
    for algorithm in algorithms:
        if base.moves_gpu_memory:  # (a second NCCL communicator would cost a setup: reset this one's counters)
            c = base
            c.reset_counters()
            x = to_device(np.ones(count, dtype=dtype), "gpu")
        else:
            c = MPIComm(base.mpi.Dup())  # fresh counters
            x = np.ones(count, dtype=dtype)
        tplab.allreduce(x, c, algorithm=algorithm)
        formula = allreduce_traffic(algorithm, p, x.nbytes)
        rows.append({"algorithm": algorithm, "messages": c.messages_sent,
                     "bytes": c.bytes_sent, "formula_max_messages": formula["max_messages"],
                     "formula_max_bytes": formula["max_bytes"], "vector_bytes": x.nbytes})
        if c is not base:
            c.mpi.Free()
    return rows
