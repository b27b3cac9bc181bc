"""Timing collectives honestly, on every rank at once.

One measurement = warm-up calls, then ``iters`` timed calls, each started together (barrier) and
timed on every rank; an iteration takes as long as its slowest rank (max over ranks), and the
reported time is the median over iterations (robust to the odd descheduled rank when ranks share
cores). Argument checks are off while timing (``check=False``): they are not part of the algorithm.

    rows = sweep("allreduce", ["ring", "recursive_doubling", "builtin"], sizes=[8, 64, 512, 4096])
    pandas.DataFrame(rows)    # the same rows on every rank

Columns follow nccl-tests where they apply: size (bytes per rank), count (elements), type, redop,
time_us, algbw and busbw in GB/s (algbw = size / time; busbw = algbw x 2(p-1)/p for allreduce).
"""

from __future__ import annotations

import time

import numpy as np

import tplab
from tplab.comm import world

BUS_FACTOR = {  # nccl-tests' bus-bandwidth factors (shared/REFERENCE.md s.3)
    "allreduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "allgather": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
}


def _call(collective, x, comm, algorithm, op):
    fn = getattr(tplab, collective)
    if collective in ("allgather", "broadcast"):
        return fn(x, comm, algorithm=algorithm, check=False)
    return fn(x, comm, op=op, algorithm=algorithm, check=False)


def time_collective(collective, algorithm, size, *, dtype="float32", op="sum", iters=20, warmup=3,
                    comm=None) -> dict:
    """Time one collective on ``size`` bytes per rank (rounded down to whole elements, at least one)."""
    comm = comm or world()
    dt = np.dtype(dtype)
    count = max(size // dt.itemsize, 1)
    x = np.ones(count, dtype=dt)
    for _ in range(warmup):
        _call(collective, x, comm, algorithm, op)
    mine = []
    for _ in range(iters):
        comm.barrier()
        t0 = time.perf_counter()
        _call(collective, x, comm, algorithm, op)
        mine.append(time.perf_counter() - t0)
    per_iteration = np.max(np.array(comm.allgather_object(mine)), axis=0)  # slowest rank, each iteration
    t = float(np.median(per_iteration))
    nbytes = count * dt.itemsize
    algbw = nbytes / t / 1e9 if t > 0 else float("nan")
    return {
        "collective": collective, "algorithm": algorithm, "ranks": comm.size,
        "size": nbytes, "count": count, "type": dt.name, "redop": op,
        "time_us": t * 1e6, "min_us": float(per_iteration.min()) * 1e6, "max_us": float(per_iteration.max()) * 1e6,
        "algbw": algbw, "busbw": algbw * BUS_FACTOR[collective](comm.size),
    }


def sweep(collective, algorithms, sizes, *, dtype="float32", op="sum", iters=20, warmup=3, comm=None,
          progress=False) -> list:
    """``time_collective`` for every algorithm and size; returns the rows (identical on every rank).
    ``progress=True`` shows a tqdm bar on rank 0 (for terminals; engines' output is captured)."""
    from tqdm.auto import tqdm

    comm = comm or world()
    points = [(s, a) for s in sizes for a in algorithms]
    bar = tqdm(points, desc=f"{collective} p={comm.size}", disable=not progress or comm.rank != 0, leave=False)
    return [time_collective(collective, a, s, dtype=dtype, op=op, iters=iters, warmup=warmup, comm=comm)
            for s, a in bar]
