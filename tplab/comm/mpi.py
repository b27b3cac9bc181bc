"""MPIComm: the Communicator over an mpi4py communicator, for arrays in host memory.

Messages go through mpi4py's buffer interface (``Send``/``Recv`` with capital letters), which hands the
numpy array's memory straight to MPI: no pickling, no copies.

``timeout``: with ``None`` (the default) blocking calls are MPI's own. With a number of seconds, every
blocking call becomes a nonblocking one polled until a deadline, and raises ``CommTimeoutError`` naming
the operation that never completed. That turns a deadlock into an error message, which is what the
exercise checker and the tests want; it costs a little latency, so benchmarks leave it off.

``ranks_per_node``: ``None`` finds the real nodes (``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``: the
ranks that can share memory); a number q pretends that every q consecutive ranks form a node, which is
how one machine tries out a multi-node algorithm.
"""

from __future__ import annotations

import os
import time

import numpy as np

from tplab.toolkit.blocks import block_counts, offsets
from tplab.comm.base import Communicator, CommTimeoutError, checked_ranks_per_node
from tplab.toolkit.ops import get_op


class MPIComm(Communicator):
    def __init__(self, mpi_comm=None, timeout: float | None = None, ranks_per_node: int | None = None):
        super().__init__()
        from mpi4py import MPI

        self._MPI = MPI
        self.mpi = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.rank = self.mpi.Get_rank()
        self.size = self.mpi.Get_size()
        self.timeout = timeout
        self.ranks_per_node = checked_ranks_per_node(ranks_per_node)

    poll_pause = 1e-3  # longest sleep between two polls of a blocking call with a timeout (0: sched_yield)

    def with_timeout(self, timeout: float | None, poll_pause: float | None = None) -> "MPIComm":
        """A Communicator on a duplicate of this one (so stray messages cannot mix), with a deadline."""
        twin = MPIComm(self.mpi.Dup(), timeout=timeout, ranks_per_node=self.ranks_per_node)
        if poll_pause is not None:
            twin.poll_pause = poll_pause
        if self.ranks_per_node is None and self._node_ids is not None:  # known nodes: no need to detect
            self._inherit_nodes(twin, range(self.size))
        return twin

    def split(self, color: int, key: int | None = None) -> "MPIComm":
        sub = MPIComm(self.mpi.Split(color, self.rank if key is None else key), timeout=self.timeout)
        return self._inherit_nodes(sub)

    def _detect_node_ids(self) -> list[int]:
        # The ranks that can share memory are on one node; name each node by its lowest rank.
        same_node = self.mpi.Split_type(self._MPI.COMM_TYPE_SHARED, key=self.rank)
        lowest_rank_on_my_node = same_node.bcast(self.rank, root=0)
        same_node.Free()
        return self.mpi.allgather(lowest_rank_on_my_node)

    # ---- point-to-point --------------------------------------------------------------------------------
    def _send(self, buf, dest, tag):
        if self.timeout is None:
            self.mpi.Send(buf, dest, tag)
        else:
            self._wait(self.mpi.Isend(buf, dest, tag), f"send to rank {dest} (tag {tag}, {buf.nbytes} B)")

    def _recv(self, buf, source, tag):
        if self.timeout is None:
            self.mpi.Recv(buf, source, tag)
        else:
            self._wait(self.mpi.Irecv(buf, source, tag), f"recv from rank {source} (tag {tag}, {buf.nbytes} B)")

    def _sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        if self.timeout is None:
            self.mpi.Sendrecv(sendbuf, dest, tag, recvbuf, source, tag)
        else:
            super()._sendrecv(sendbuf, dest, recvbuf, source, tag)

    def _isend(self, buf, dest, tag):
        return self.mpi.Isend(buf, dest, tag)

    def _irecv(self, buf, source, tag):
        return self.mpi.Irecv(buf, source, tag)

    def _test(self, handle) -> bool:
        return handle.Test()

    def _wait(self, handle, what):
        if self.timeout is None:
            handle.Wait()
            return
        deadline = time.monotonic() + self.timeout
        pause = 0.0
        while not handle.Test():
            if time.monotonic() > deadline:
                try:  # withdraw the operation so it cannot match a later message
                    handle.Cancel()
                except Exception:  # noqa: BLE001 - best effort; the error below is what matters
                    pass
                raise CommTimeoutError(
                    f"rank {self.rank}: {what} did not complete within {self.timeout:g} s "
                    "(a deadlock? the peer never posted the matching operation, or it failed)"
                )
            # back off gently: ranks often outnumber cores, and a spinning rank steals its peer's core
            if self.poll_pause > 0:
                time.sleep(pause)
                pause = min(2 * pause + 1e-6, self.poll_pause)
            else:
                os.sched_yield()

    def barrier(self):
        if self.timeout is None:
            self.mpi.Barrier()
        else:
            self._wait(self.mpi.Ibarrier(), "barrier")

    def allgather_object(self, obj) -> list:
        return self.mpi.allgather(obj)

    def free(self) -> None:
        if self.mpi is not self._MPI.COMM_WORLD:
            self.mpi.Free()

    # ---- the MPI library's own collectives ---------------------------------------------------------------
    def builtin_allreduce(self, x, op="sum"):
        x = np.ascontiguousarray(x)
        out = np.empty_like(x)
        self.mpi.Allreduce(x, out, op=get_op(op).mpi_op)
        return out

    def builtin_reduce_scatter(self, x, op="sum"):
        flat = np.ascontiguousarray(x).reshape(-1)
        counts = block_counts(flat.size, self.size)
        out = np.empty(counts[self.rank], dtype=flat.dtype)
        self.mpi.Reduce_scatter(flat, out, counts, op=get_op(op).mpi_op)
        return out

    def builtin_allgather(self, x):
        flat = np.ascontiguousarray(x).reshape(-1)
        counts = self.mpi.allgather(flat.size)
        displs = offsets(counts)[:-1]
        out = np.empty(sum(counts), dtype=flat.dtype)
        self.mpi.Allgatherv(flat, [out, (counts, displs)])
        return out

    def builtin_broadcast(self, x, root=0):
        out = np.ascontiguousarray(x).copy()
        self.mpi.Bcast(out, root=root)
        return out

    def builtin_reduce(self, x, op="sum", root=0):
        x = np.ascontiguousarray(x)
        out = np.empty_like(x) if self.rank == root else None
        self.mpi.Reduce(x, out, op=get_op(op).mpi_op, root=root)
        return out
