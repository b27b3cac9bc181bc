"""A transport over another: point-to-point, barrier, metadata and nodes go to ``inner``, unchanged.

A subclass changes only what it adds: EmulatedNetwork charges a network's time before each send,
PeerMemoryComm (tplab.gpu_collectives) runs its own all-reduce kernels. What it sends is counted on the
wrapper (the base class counts before calling these hooks), not twice.
"""

from __future__ import annotations

from tplab.comm.base import Communicator


class Wrapped(Communicator):
    def __init__(self, inner: Communicator):
        super().__init__()
        self.inner = inner
        self.rank, self.size = inner.rank, inner.size

    def _send(self, buf, dest, tag):
        self.inner._send(buf, dest, tag)

    def _recv(self, buf, source, tag):
        self.inner._recv(buf, source, tag)

    def _sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        self.inner._sendrecv(sendbuf, dest, recvbuf, source, tag)

    def _isend(self, buf, dest, tag):
        return self.inner._isend(buf, dest, tag)

    def _irecv(self, buf, source, tag):
        return self.inner._irecv(buf, source, tag)

    def _wait(self, handle, what):
        self.inner._wait(handle, what)

    def _test(self, handle):
        return self.inner._test(handle)

    def barrier(self):
        self.inner.barrier()

    def allgather_object(self, obj) -> list:
        return self.inner.allgather_object(obj)

    def _detect_node_ids(self):
        return self.inner._detect_node_ids()

    @property
    def timeout(self):
        return self.inner.timeout
