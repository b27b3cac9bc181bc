"""Why nothing overlaps by default: MPI's nonblocking collectives progress only inside MPI calls.

``MPI_Iallreduce`` returns at once with a request, and ``MPI_Wait`` later returns the result, so it looks
as if the all-reduce ran in between. But a collective is many messages in several rounds (a ring: 2(p-1)
steps), and a round can only start when this rank's MPI library notices that the previous one finished.
Without a helper thread the library only looks when it is called. A rank that computes between
``Iallreduce`` and ``Wait`` does not call it, so the rounds stall, and most of the collective runs inside
``Wait``: nothing was hidden. Calling ``MPI_Test`` now and then during the compute lets the library
advance a round each time; a progress thread (MPICH: ``MPICH_ASYNC_PROGRESS=1``; tplab.overlap: its own)
advances it all the time.

``progress_experiment`` measures the four cases on the ranks of ``comm`` (an MPIComm):

    blocking                       compute, then MPI_Allreduce: nothing overlaps, by construction
    Iallreduce, compute, Wait      started before the compute, finished after it
    ... + MPI_Test between pieces  the compute cut into pieces, MPI_Test after each
    tplab iallreduce (thread)      tplab's progress thread runs the builtin MPI_Allreduce

Columns: total_ms (the whole thing), wait_ms (time in the final wait: the communication still left when
the compute ended), hidden_fraction = 1 - (total - compute) / allreduce. On a machine whose ranks
outnumber its cores the progress thread competes with the compute for a core: expect less.
"""

from __future__ import annotations

import statistics
import time

import numpy as np


def _compute_piece(a, b):
    return a @ b  # BLAS releases the GIL: a progress thread may run meanwhile


def progress_experiment(comm=None, nbytes: int = 8 << 20, piece_size: int = 96, iters: int = 5):
    """The four cases above for an all-reduce of ``nbytes`` per rank and a compute about 1.5 times as long
    as the all-reduce (matrix products of ``piece_size``², about 20 or more of them). Collective; a
    DataFrame (the slowest rank's medians), the same on every rank."""
    import pandas as pd
    from mpi4py import MPI

    from tplab.comm import world
    from tplab.overlap.nonblocking import iallreduce

    comm = comm or world()
    mpi = comm.mpi
    x = np.ones(max(nbytes // 8, 1))
    out = np.empty_like(x)
    a = np.random.default_rng(comm.rank).standard_normal((piece_size, piece_size))

    def slowest_median(f):
        samples = []
        for i in range(iters + 1):  # one warm-up
            mpi.Barrier()
            t = time.perf_counter()
            extra = f()
            samples.append((time.perf_counter() - t, extra or 0.0))
        total = statistics.median(s[0] for s in samples[1:])
        waited = statistics.median(s[1] for s in samples[1:])
        return max(mpi.allgather((total, waited)))

    allreduce_s = slowest_median(lambda: mpi.Allreduce(x, out))[0]
    t = time.perf_counter()
    for _ in range(10):
        _compute_piece(a, a)
    piece_s = mpi.allreduce((time.perf_counter() - t) / 10, op=MPI.MAX)
    pieces = max(20, int(np.ceil(1.5 * allreduce_s / piece_s)))

    def compute(test=None):
        for _ in range(pieces):
            _compute_piece(a, a)
            if test is not None:
                test()

    def blocking():
        compute()
        mpi.Allreduce(x, out)

    def started_then_waited(poll):
        def run():
            request = mpi.Iallreduce(x, out)
            compute(request.Test if poll else None)
            t = time.perf_counter()
            request.Wait()
            return time.perf_counter() - t
        return run

    def progress_thread():
        handle = iallreduce(x, comm, algorithm="builtin", check=False)
        compute()
        t = time.perf_counter()
        handle.wait()
        return time.perf_counter() - t

    compute_s = slowest_median(compute)[0]
    cases = [("blocking: compute, then Allreduce", blocking),
             ("Iallreduce, compute, Wait", started_then_waited(False)),
             ("Iallreduce, compute + Test per piece, Wait", started_then_waited(True)),
             ("tplab iallreduce (progress thread), compute, wait", progress_thread)]
    rows = []
    for name, case in cases:
        total_s, wait_s = slowest_median(case)
        if name.startswith("blocking"):
            wait_s = allreduce_s  # all of it after the compute
        rows.append({"case": name, "ranks": comm.size, "bytes": x.nbytes, "allreduce_ms": allreduce_s * 1e3,
                     "compute_ms": compute_s * 1e3, "total_ms": total_s * 1e3, "wait_ms": wait_s * 1e3,
                     "hidden_fraction": 1 - (total_s - compute_s) / allreduce_s, "pieces": pieces})
    return pd.DataFrame(rows)
