"""The Communicator: the wire every hand-written collective runs on.

A Communicator is a group of ``size`` processes; this process is ``rank``. The algorithms in
``tplab.collectives`` use only what this class offers:

    point-to-point      send, recv, sendrecv, isend, irecv (+ Request.wait), barrier
    bookkeeping         bytes_sent, messages_sent, reset_counters()   (what the algorithm really moved)
    metadata            allgather_object (pickled, uncounted: argument checks, not data)
    the library's own   builtin_allreduce, builtin_reduce_scatter, builtin_allgather,
                        builtin_broadcast, builtin_reduce             (for comparison and "builtin")

A transport (MPI on host memory today; NCCL, CUDA IPC, an emulated slow network later) subclasses
Communicator and fills in the underscored methods. The counters live here, so every transport counts
the same way and the algorithms never change when the wire does.

Buffers are 1-D contiguous arrays. ``recv`` fills the buffer it is given: algorithms own their memory.
"""

from __future__ import annotations

import abc


class CommTimeoutError(RuntimeError):
    """A blocking operation did not complete in time: almost always a deadlock (a peer that never sends)."""


class Request:
    """A nonblocking operation in flight. ``wait()`` blocks until it completes and returns its buffer."""

    def __init__(self, comm: "Communicator", handle, buf, what: str):
        self._comm, self._handle, self.buf, self._what = comm, handle, buf, what
        self.done = False

    def wait(self):
        if not self.done:
            self._comm._wait(self._handle, self._what)
            self.done = True
        return self.buf

    def test(self) -> bool:
        if not self.done:
            self.done = self._comm._test(self._handle)
        return self.done


class Communicator(abc.ABC):
    """Base class of all transports. Subclasses set ``rank`` and ``size`` and implement the hooks."""

    rank: int
    size: int

    def __init__(self):
        self.bytes_sent = 0
        self.messages_sent = 0

    # ---- counters: every message the algorithm sends, whatever the transport --------------------------
    def reset_counters(self) -> None:
        self.bytes_sent = 0
        self.messages_sent = 0

    def _count(self, buf) -> None:
        self.bytes_sent += int(buf.nbytes)
        self.messages_sent += 1

    # ---- point-to-point ------------------------------------------------------------------------------
    def send(self, buf, dest: int, tag: int = 0) -> None:
        self._count(buf)
        self._send(buf, dest, tag)

    def recv(self, buf, source: int, tag: int = 0):
        """Receive into ``buf`` (which must have exactly the incoming size) and return it."""
        self._recv(buf, source, tag)
        return buf

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0):
        """Send ``sendbuf`` to ``dest`` while receiving ``recvbuf`` from ``source``; deadlock-free in pairs
        and rings. Returns ``recvbuf``."""
        self._count(sendbuf)
        self._sendrecv(sendbuf, dest, recvbuf, source, tag)
        return recvbuf

    def isend(self, buf, dest: int, tag: int = 0) -> Request:
        self._count(buf)
        return Request(self, self._isend(buf, dest, tag), buf, f"send to rank {dest} (tag {tag})")

    def irecv(self, buf, source: int, tag: int = 0) -> Request:
        return Request(self, self._irecv(buf, source, tag), buf, f"recv from rank {source} (tag {tag})")

    @staticmethod
    def waitall(requests) -> list:
        return [r.wait() for r in requests]

    # ---- hooks a transport implements ----------------------------------------------------------------
    @abc.abstractmethod
    def _send(self, buf, dest: int, tag: int) -> None: ...

    @abc.abstractmethod
    def _recv(self, buf, source: int, tag: int) -> None: ...

    def _sendrecv(self, sendbuf, dest, recvbuf, source, tag) -> None:
        # Correct for any transport with nonblocking operations; MPI overrides it with MPI_Sendrecv.
        r = self._irecv(recvbuf, source, tag)
        s = self._isend(sendbuf, dest, tag)
        self._wait(r, f"recv from rank {source} (tag {tag})")
        self._wait(s, f"send to rank {dest} (tag {tag})")

    @abc.abstractmethod
    def _isend(self, buf, dest: int, tag: int): ...

    @abc.abstractmethod
    def _irecv(self, buf, source: int, tag: int): ...

    @abc.abstractmethod
    def _wait(self, handle, what: str) -> None: ...

    @abc.abstractmethod
    def _test(self, handle) -> bool: ...

    @abc.abstractmethod
    def barrier(self) -> None: ...

    @abc.abstractmethod
    def allgather_object(self, obj) -> list:
        """Every rank's ``obj``, in rank order (small metadata only; not counted)."""

    # ---- the library's own collectives (same semantics as tplab.allreduce & co.) ----------------------
    @abc.abstractmethod
    def builtin_allreduce(self, x, op: str): ...

    @abc.abstractmethod
    def builtin_reduce_scatter(self, x, op: str): ...

    @abc.abstractmethod
    def builtin_allgather(self, x): ...

    @abc.abstractmethod
    def builtin_broadcast(self, x, root: int): ...

    @abc.abstractmethod
    def builtin_reduce(self, x, op: str, root: int): ...

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank} of {self.size}>"
