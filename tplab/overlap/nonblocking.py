"""Nonblocking collectives: start now, wait later, for every hand-written algorithm.

    h = iallreduce(x, comm, algorithm="ring")   # returns at once; the all-reduce runs in the background
    ... compute something that does not need the result ...
    y = h.wait()                                # the result (what tplab.allreduce(x, comm) returns)

Why a thread? MPI's own nonblocking collectives (``MPI_Iallreduce``) look like this too, but they only
make progress *inside MPI calls*: between ``MPI_Iallreduce`` and ``MPI_Wait`` a rank that is busy
computing does not answer its peers, so a ring step that needs its data simply waits, and most of the
work happens in the final ``MPI_Wait`` (``mpi_progress.py`` measures it). Libraries fix that with a
*progress thread* (MPICH: ``MPICH_ASYNC_PROGRESS=1``) or by asking the user to call ``MPI_Test`` now and
then. tplab does the first, by hand: one **progress thread per communicator** runs tplab's ordinary
blocking algorithms (ring, recursive doubling, ...) while the calling thread computes. It overlaps for
real because mpi4py releases Python's GIL inside every MPI call and numpy/torch release it in big kernels.

Rules that make it correct:

- The thread talks on a *duplicate* of the communicator (its own MPI context), so its messages can never
  be mistaken for messages of collectives the caller runs meanwhile on the original.
- It runs the collectives **in the order they were started** (a FIFO queue). Every rank must start the
  same collectives in the same order, as with MPI's nonblocking collectives; then the ranks meet in each
  one, and handles may be *waited* in any order.
- MPI must allow several threads to call it at once (``MPI_THREAD_MULTIPLE``, mpi4py's default); if it
  was initialised with less, starting a nonblocking collective raises a clear error.
- The arguments are checked across ranks before the collective is queued (one small allgather on the
  calling thread; ``check=False`` skips it, for timing), so bad input is the same error on every rank.
- ``x`` must not be modified before ``wait()`` returns (MPI's rule for nonblocking buffers): the thread
  reads it while you compute.

An error in the thread (a timeout on a communicator made with one, a bad algorithm) is raised by
``wait()``; the collectives queued after it fail at once too (the ranks no longer agree where they are).
The threads are daemons, closed at exit (``shutdown()`` closes them earlier; progress_thread.py). GPU
tensors go another way: a side CUDA stream instead of a thread (``streams.py``).
"""

from __future__ import annotations

from tplab.toolkit.arrays import as_array, is_torch
from tplab.collectives import ALGORITHMS, allgather, allreduce, reduce_scatter
from tplab.collectives.checks import agree_on_arguments
from tplab.comm import world
from tplab.comm.null import NullComm
from tplab.overlap.handles import Completed, Handle
from tplab.overlap.progress_thread import engine_for


# ---- the collectives ---------------------------------------------------------------------------------------------
def _describe(name, x, algorithm) -> str:
    arr = as_array(x)[0]
    return f"{name} {algorithm} {arr.nbytes} B"


def _start(name, x, comm, algorithm, check, run, **check_args):
    comm = comm or world()
    if isinstance(comm, NullComm):  # communication switched off (metrics.py): nothing to wait for
        return Completed(run(comm), f"{name} (no-op)")
    if is_torch(x) and x.device.type == "cuda":
        from tplab.overlap.streams import start_on_side_stream

        return start_on_side_stream(name, x, comm, algorithm, check)
    if not comm.point_to_point:  # whole collectives only (torch.distributed on CPU): its own, on the thread
        return engine_for(comm).submit(_describe(name, x, algorithm), run)
    arr = as_array(x)[0]
    agree_on_arguments(comm, name, arr, algorithm=algorithm, algorithms=ALGORITHMS[name], check=check, **check_args)
    return engine_for(comm).submit(_describe(name, x, algorithm), run)


def iallreduce(x, comm=None, op="sum", algorithm="auto", *, check=True) -> Handle:
    """Start ``tplab.allreduce(x, comm, op, algorithm)``; ``wait()`` returns its result."""
    return _start("allreduce", x, comm, algorithm, check,
                  lambda c: allreduce(x, c, op=op, algorithm=algorithm, check=False), op=op)


def ireduce_scatter(x, comm=None, op="sum", algorithm="auto", *, check=True) -> Handle:
    """Start ``tplab.reduce_scatter(x, comm, op, algorithm)`` (this rank's block of the flat sum)."""
    return _start("reduce_scatter", x, comm, algorithm, check,
                  lambda c: reduce_scatter(x, c, op=op, algorithm=algorithm, check=False), op=op)


def iallgather(x, comm=None, algorithm="auto", *, check=True) -> Handle:
    """Start ``tplab.allgather(x, comm, algorithm)`` (every rank's flat x, concatenated)."""
    return _start("allgather", x, comm, algorithm, check,
                  lambda c: allgather(x, c, algorithm=algorithm, check=False), same_shape=False)
