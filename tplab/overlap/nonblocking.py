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
The threads are daemons, closed at exit (``shutdown()`` closes them earlier). GPU tensors go another way:
a side CUDA stream instead of a thread (``streams.py``).
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import time
import weakref

from tplab.collectives import ALGORITHMS, allgather, allreduce, reduce_scatter
from tplab.collectives import scratch as _scratch
from tplab.collectives.checks import agree_on_arguments
from tplab.arrays import as_array, is_torch
from tplab.comm.base import Communicator
from tplab.overlap import trace


class Handle:
    """A collective in flight. ``wait()`` blocks until it is done and returns its result (or raises its
    error); ``test()`` says whether it is done, without blocking."""

    def __init__(self, what: str):
        self.what = what
        self._done = threading.Event()
        self._result = self._error = None

    def _finish(self, result=None, error=None):
        self._result, self._error = result, error
        self._done.set()

    def test(self) -> bool:
        return self._done.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None):
        if not self._done.is_set():
            with trace.span(f"wait {self.what}", kind="wait"):  # the time the caller stood still: exposed
                if not self._done.wait(timeout):
                    raise TimeoutError(f"{self.what} did not complete within {timeout:g} s")
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self):
        return f"<Handle {self.what}: {'done' if self.done else 'in flight'}>"


class Completed(Handle):
    """A handle that is done from the start (a no-op collective, or one rank: nothing to send)."""

    def __init__(self, result, what="nothing to do"):
        super().__init__(what)
        self._finish(result)


def waitall(handles) -> list:
    return [h.wait() for h in handles]


# ---- the progress engine: one thread per communicator ----------------------------------------------------------
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


class _PerThreadScratch(dict):
    """tplab.collectives.scratch keeps one grow-only buffer per purpose for the whole process. A
    progress thread running a ring while the main thread runs another would share "ring incoming":
    wrong results. Keyed by thread as well, every thread gets its own buffers. (Shim: belongs in
    scratch.py's key; this only adds the thread to it.)"""

    def get(self, key, default=None):
        return super().get((threading.get_ident(), key), default)

    def __setitem__(self, key, value):
        super().__setitem__((threading.get_ident(), key), value)

    def forget_thread(self, ident) -> None:
        for key in [k for k in self if k[0] == ident]:
            del self[key]


if not isinstance(_scratch._buffers, _PerThreadScratch):
    _scratch._buffers = _PerThreadScratch()


NO_DEADLINE = 10.0 * 365 * 24 * 3600  # a "timeout" that never expires: polite waiting, no deadline


def oversubscribed(comm) -> bool:
    """Fewer cores on this machine than two per rank (the computing thread and the progress thread).
    Collective the first time (finds the nodes)."""
    import os

    nodes = comm.node_ids()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return 2 * nodes.count(nodes[comm.rank]) > (cores or 1)


def _duplicate(comm, yield_cpu):
    """A communicator with the same ranks and its own message context (collective). With ``yield_cpu``
    its waits poll and sleep instead of spinning inside MPI (tplab.comm.mpi's waits with a timeout)."""
    timeout = comm.timeout if comm.timeout is not None or not yield_cpu else NO_DEADLINE
    twin = comm.with_timeout(timeout) if hasattr(comm, "with_timeout") else comm.split(0)
    twin._counts_for = (comm, list(range(comm.size)))  # what the thread sends counts on comm too
    return twin


class ProgressEngine:
    """The thread that runs ``comm``'s nonblocking collectives, one after another, in the order started.

    ``yield_cpu``: a rank waiting inside MPI spins on its core (MPICH, Open MPI: lowest latency). When the
    ranks outnumber the cores (a laptop), the spinning thread takes the core from the computation it is
    meant to overlap, so by default (None) the thread then polls and sleeps between polls instead
    (a little latency: the sleep grows from 1 µs to at most 1 ms while nothing arrives)."""

    def __init__(self, comm, yield_cpu: bool | None = None):
        require_thread_multiple()
        if not isinstance(comm, Communicator):  # an adapter with its own collectives (torch.distributed): as is
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
        _scratch._buffers.forget_thread(threading.get_ident())

    def close(self, timeout: float = 5.0) -> bool:
        """Stop the thread after the collectives already queued; True if it ended within ``timeout``."""
        if self.thread.is_alive():
            self._queue.put(None)
            self.thread.join(timeout)
        return not self.thread.is_alive()


_engines: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


yield_cpu = None  # progress threads poll and sleep instead of spinning: True, False, None = when oversubscribed


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


@atexit.register
def shutdown(timeout: float = 5.0) -> None:
    """Stop every progress thread (after their queued collectives). Registered at exit, and it runs
    before mpi4py's MPI_Finalize (atexit runs in reverse order of registration), so no thread is
    inside MPI when MPI ends."""
    with _lock:
        engines = list(_engines.values())
        _engines.clear()
    stuck = [e for e in engines if not e.close(timeout)]
    if stuck:
        print(f"tplab.overlap: {len(stuck)} progress thread(s) still inside a collective after {timeout:g} s "
              "(a peer never joined it?)", file=sys.stderr)


# ---- the collectives ---------------------------------------------------------------------------------------------
def _describe(name, x, algorithm) -> str:
    arr = as_array(x)[0]
    return f"{name} {algorithm} {arr.nbytes} B"


def _start(name, x, comm, algorithm, check, run, **check_args):
    if comm is None:
        from tplab.comm import world

        comm = world()
    if getattr(comm, "is_null", False):  # NullComm: communication switched off (metrics.py)
        return Completed(getattr(comm, f"tensor_{name}")(x), f"{name} (no-op)")
    if is_torch(x) and x.device.type == "cuda":
        from tplab.overlap.streams import start_on_side_stream

        return start_on_side_stream(name, x, comm, algorithm, check)
    if hasattr(comm, f"tensor_{name}"):  # a communicator with its own tensor collectives: run that one
        return engine_for(comm).submit(f"{name} {x.numel() * x.element_size()} B",
                                       lambda c: getattr(c, f"tensor_{name}")(x))
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
