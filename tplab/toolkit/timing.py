"""How tplab times a forward pass (or any call) on every rank: warm-up, then calls started together.

    times = time_calls(fn, iters=10, warmup=2, barrier=comm.barrier, cuda=False)   this rank's seconds per call
    slowest_median(times, comm)     each rank's median, then the slowest rank (nccl-tests' convention)
    median_of_slowest(times, comm)  each call's slowest rank, then the median over calls (and the fastest)
    time_forward(fn, comm)          time_calls + slowest_median: seconds per call of ``fn()``

On a GPU (``cuda=True``) a call is timed with CUDA events on the current stream, which count the time the
GPU waited for the host (kernel launches, staged copies, host MPI) as well as its own; on a CPU with
``time.perf_counter()``. A rank's time alone says little: a tensor-parallel forward pass is done when its
last rank is, so both statistics take the slowest rank (gathered with the communicator's
``allgather_object``). ``comm`` is any object with ``barrier()`` and ``allgather_object()``.
"""

from __future__ import annotations

import statistics
import time


def time_once(fn, *, barrier=None, cuda: bool = False) -> float:
    """Seconds of one call of ``fn()``, started after ``barrier()`` (all ranks together) when given."""
    if cuda:
        import torch  # (only here: the CPU path needs no torch)

        torch.cuda.synchronize()  # the GPU's queued work is done before the ranks line up
    if barrier is not None:
        barrier()
    if not cuda:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3  # ms -> s


def time_calls(fn, *, iters: int, warmup: int, barrier=None, cuda: bool = False) -> list[float]:
    """Seconds of each of ``iters`` calls of ``fn()`` after ``warmup`` untimed ones (time_once each)."""
    for _ in range(warmup):
        fn()
    return [time_once(fn, barrier=barrier, cuda=cuda) for _ in range(iters)]


def slowest_median(times: list[float], comm) -> float:
    """The median over this rank's ``times``, then the largest such median over the ranks of ``comm``:
    robust to one odd call on one rank (a rank descheduled where ranks share cores)."""
    return max(comm.allgather_object(statistics.median(times)))


def median_of_slowest(times: list[float], comm) -> tuple[float, float]:
    """(median over calls of the slowest rank's time, the fastest such call): call i lasted as long as its
    slowest rank. The same on every rank."""
    everyone = comm.allgather_object(list(times))  # (ranks, calls)
    per_call = [max(call) for call in zip(*everyone)]
    return statistics.median(per_call), min(per_call)


def time_forward(fn, comm, *, iters: int = 10, warmup: int = 2, cuda: bool = False) -> float:
    """Seconds per call of ``fn()`` (collective over ``comm``): the slowest rank's median over ``iters``
    calls, after ``warmup``; every timed call starts after a barrier."""
    return slowest_median(time_calls(fn, iters=iters, warmup=warmup, barrier=comm.barrier, cuda=cuda), comm)
