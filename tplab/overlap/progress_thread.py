"""The progress thread: one per communicator, running its nonblocking collectives in the order started.

Why a thread, and the rules that make it correct, are in nonblocking.py. Here: the thread itself, its
duplicate communicator, the MPI_THREAD_MULTIPLE check, and what a thread needs from the rest of the
process (scratch buffers of its own, a core it does not steal when asked to yield, a clean end before
MPI_Finalize).
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time
import weakref

from tplab.collectives import scratch as _scratch
from tplab.overlap import trace
from tplab.overlap.handles import Handle


def require_thread_multiple() -> None:
    """A clear error unless MPI lets several threads call it at once (MPI_THREAD_MULTIPLE)."""
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled", MPI.THREAD_SERIALIZED: "serialized"}
        raise RuntimeError(
            f"nonblocking collectives run in a progress thread, which needs MPI_THREAD_MULTIPLE, but MPI was "
            f"initialised with MPI_THREAD_{names.get(MPI.Query_thread(), '?').upper()}: leave mpi4py's default "
            "(mpi4py.rc.thread_level = 'multiple', set before `from mpi4py import MPI`)")


NO_DEADLINE = 10.0 * 365 * 24 * 3600  # a "timeout" that never expires: polite waiting, no deadline


def oversubscribed(comm) -> bool:
    """Fewer cores on this machine than two per rank (the computing thread and the progress thread).
    Collective the first time (finds the nodes)."""
    nodes = comm.node_ids()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return 2 * nodes.count(nodes[comm.rank]) > (cores or 1)


POLL_PAUSE = 5e-5  # longest sleep between two polls of a yielding progress thread (seconds)


def _duplicate(comm, yield_cpu):
    """A communicator with the same ranks and its own message context (collective). With ``yield_cpu``
    its waits poll and sleep (at most POLL_PAUSE) instead of spinning inside MPI: every blocking call
    becomes a nonblocking one, waited politely (tplab.comm.mpi does that when it has a timeout)."""
    timeout = comm.timeout if comm.timeout is not None or not yield_cpu else NO_DEADLINE
    twin = comm.with_timeout(timeout, POLL_PAUSE if yield_cpu else None)
    twin._counts_for = (comm, list(range(comm.size)))  # what the thread sends counts on comm too
    return twin


class ProgressEngine:
    """The thread that runs ``comm``'s nonblocking collectives, one after another, in the order started.

    ``yield_cpu``: a rank waiting inside MPI spins on its core (MPICH, Open MPI: lowest latency). When the
    ranks outnumber the cores (a laptop), a spinning thread may take the core from the computation it is
    meant to overlap; with ``yield_cpu`` it polls and sleeps between polls instead (a little latency: the
    sleep grows from 1 µs to at most POLL_PAUSE while nothing arrives). None: yield when there are fewer
    than two cores per rank. (The module's ``yield_cpu`` is what engine_for passes.)"""

    def __init__(self, comm, yield_cpu: bool | None = None):
        require_thread_multiple()
        if not comm.point_to_point:  # whole collectives only (torch.distributed): no message space to duplicate
            self.comm, self.yield_cpu = comm, False
        else:
            self.yield_cpu = oversubscribed(comm) if yield_cpu is None else yield_cpu
            self.comm = _duplicate(comm, self.yield_cpu)  # collective: every rank makes its engine at one point
        self.rank = comm.rank
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._broken: BaseException | None = None
        self.started = 0
        self.thread = threading.Thread(target=self._run, name=f"tplab-progress-rank{comm.rank}", daemon=True)
        self.thread.start()

    def submit(self, what: str, work) -> Handle:
        """Queue ``work(comm)`` (a blocking collective on the engine's communicator) and return its handle."""
        if not self.thread.is_alive():
            raise RuntimeError("this progress engine was shut down")
        self.started += 1
        handle = Handle(what)
        self._queue.put((handle, work, trace.current()))
        return handle

    def _run(self):
        while True:
            item = self._queue.get()
            if item is None:
                break
            handle, work, tracer = item
            if self._broken is not None:
                handle._finish(error=RuntimeError(f"{handle.what} not run: an earlier nonblocking collective on "
                                                  f"this communicator failed ({self._broken!r})"))
                continue
            start = time.perf_counter()
            try:
                result = work(self.comm)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                self._broken = e
                handle._finish(error=e)
            else:
                if tracer is not None:
                    tracer.record(handle.what, "comm", start, time.perf_counter(), lane="progress thread")
                handle._finish(result)
        _scratch.forget_thread(threading.get_ident())

    def close(self, timeout: float = 5.0) -> bool:
        """Stop the thread after the collectives already queued; True if it ended within ``timeout``."""
        if self.thread.is_alive():
            self._queue.put(None)
            self.thread.join(timeout)
        return not self.thread.is_alive()


_engines: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


# Progress threads wait by polling and sleeping (True) instead of spinning inside MPI (False), or only on
# machines with fewer than two cores per rank (None). Spinning is the default: on the 2-core development
# machine, 4 ranks, an otherwise idle machine, the overlapped block was faster with spinning threads.
yield_cpu = False


def engine_for(comm) -> ProgressEngine:
    """The progress engine of ``comm``, made on first use (collective then: all ranks start their first
    nonblocking collective on ``comm`` together, which they must anyway)."""
    with _lock:
        engine = _engines.get(comm)
        if engine is None or not engine.thread.is_alive():
            engine = _engines[comm] = ProgressEngine(comm, yield_cpu)
            weakref.finalize(comm, engine._queue.put, None)  # comm gone: let the thread end
        return engine


def running_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tplab-progress")]


def shutdown(timeout: float = 5.0) -> int:
    """Stop every progress thread after the collectives already queued; returns how many are still inside
    a collective after ``timeout`` seconds (0: all ended). Later nonblocking collectives start new ones."""
    with _lock:
        engines = list(_engines.values())
        _engines.clear()
    stuck = [e for e in engines if not e.close(timeout)]
    if stuck:
        print(f"tplab.overlap: {len(stuck)} progress thread(s) still inside a collective after {timeout:g} s "
              "(a peer never joined it?)", file=sys.stderr)
    return len(stuck)


@atexit.register
def _at_exit() -> None:
    """At exit, before mpi4py's MPI_Finalize (atexit runs in reverse order of registration, and mpi4py
    finalises after all of them): stop the threads. One stuck in a collective would make MPI_Finalize wait
    for ever, so then the job is aborted instead (the collective could not have completed anyway)."""
    if shutdown() == 0:
        return
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        print("tplab.overlap: aborting the MPI job rather than hang in MPI_Finalize", file=sys.stderr)
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
