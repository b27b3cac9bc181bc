"""NcclComm: the Communicator over NCCL, for arrays in GPU memory (CuPy arrays, CUDA torch tensors).

The same hand-written algorithms run on it unchanged: a ring step is one ``sendrecv``, which becomes an
``ncclSend`` and an ``ncclRecv`` inside one NCCL group (grouped, so that two ranks sending to each other
cannot deadlock); the reduction after it is a CuPy kernel (``tplab.toolkit.ops``). NCCL has no tags: messages
between two ranks match in the order they were posted (tplab's algorithms never rely on tags).

    comm = nccl_world()                       # under mpiexec: one rank per GPU, NCCL id sent over MPI
    y = tplab.allreduce(x_cuda, comm, algorithm="ring")     # torch CUDA tensor or CuPy array in, same out

Setup: each rank binds to a GPU by its rank among the ranks on its node (``MPI_COMM_TYPE_SHARED``), rank 0
makes the NCCL unique id and MPI broadcasts it; metadata (``allgather_object``, argument checks) and the
node layout go over MPI, data over NCCL.

Streams (the choice, kept simple): every operation is enqueued on the *caller's current stream* (CuPy's
current stream, or torch's for a torch tensor), which is also where ``tplab.toolkit.ops`` launches the reductions.
So the steps of an algorithm are ordered by the stream alone, with no events and no host waits, and the
result is ordered before whatever the caller enqueues next, as when one calls NCCL on that stream.
Consequences: ``recv``/``wait`` return once the operation is *enqueued*, not done (later GPU work on the
stream sees the data; host code must synchronise first, as CuPy's ``.get()`` and torch's ``.cpu()`` do);
``isend``/``irecv`` are collected and issued together, as one NCCL group, at the next ``wait``, ``test``
or blocking call (so posting both before waiting cannot deadlock). ``barrier`` waits for this rank's GPU
work and then for all ranks.

``timeout`` (seconds): blocking calls wait for the stream and raise ``CommTimeoutError`` (after aborting
the NCCL communicator) if it has not finished in time. That turns a deadlock on the GPU into an error for
tests; it costs a host synchronisation per call, so benchmarks leave it off. A hang inside NCCL's host-side
connection setup (the first message to a peer) is not covered.
"""

from __future__ import annotations

import os
import time

from tplab.comm import devices
from tplab.toolkit.arrays import as_array, current_stream, device_buffer, gpu_scope, is_gpu_array
from tplab.toolkit.blocks import block_counts
from tplab.comm.base import Communicator, CommTimeoutError, Unsupported, checked_ranks_per_node
from tplab.comm.mpi import MPIComm
from tplab.toolkit.ops import get_op

_world = None


# ---- setup -----------------------------------------------------------------------------------------------------
def import_nccl():
    """CuPy's NCCL module, loading libnccl from the nvidia-nccl wheel (which torch also uses) if CuPy does
    not find one by itself."""
    from cupy.cuda import nccl

    if getattr(nccl, "available", False):
        return nccl
    try:  # make libnccl.so.2 known to the dynamic loader, then try CuPy's binding again
        from cuda.pathfinder import load_nvidia_dynamic_lib

        load_nvidia_dynamic_lib("nccl")
    except Exception:  # noqa: BLE001 - fall back to the wheel's path
        import ctypes
        import importlib.util

        spec = importlib.util.find_spec("nvidia.nccl")
        for folder in (spec.submodule_search_locations if spec else []):
            path = os.path.join(folder, "lib", "libnccl.so.2")
            if os.path.exists(path):
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    import importlib

    return importlib.import_module("cupy_backends.cuda.libs.nccl")


def bind_local_gpu(mpi_comm=None) -> int:
    """Bind this process to GPU ``local rank`` (its rank among the ranks on its node) and return it.
    Collective on ``mpi_comm`` (default COMM_WORLD) the first time; later calls return the same GPU.
    (The binding itself lives in ``tplab.comm.devices``, shared with tplab.cluster's engines.)"""
    info = devices.bind_local_gpu(mpi_comm, import_torch=False)  # torch: only if the caller imported it
    if info["device"] is None:
        raise RuntimeError(f"{info['local_size']} ranks on this node but 0 visible GPU(s): start one rank per GPU "
                           "(NCCL refuses two ranks on one GPU)")
    return info["device"]


def nccl_world(timeout: float | None = None) -> "NcclComm":
    """An NcclComm over all MPI ranks (the same object on every call unless a timeout is asked for, which
    gives a fresh one on a duplicate of COMM_WORLD). Collective."""
    global _world
    if timeout is not None:
        from mpi4py import MPI

        return NcclComm(MPI.COMM_WORLD.Dup(), timeout=timeout)
    if _world is None:
        _world = NcclComm()
    return _world


# ---- the communicator -------------------------------------------------------------------------------------------
class _Op:
    """One send or receive, collected until the group it belongs to is issued."""

    __slots__ = ("kind", "ptr", "nbytes", "peer", "stream")

    def __init__(self, kind, buf, peer):
        self.kind, self.peer = kind, peer
        self.ptr, self.nbytes = device_buffer(buf)
        self.stream = current_stream(buf)


class NcclComm(Communicator):
    moves_gpu_memory = True
    takes_host_memory = False

    def __init__(self, mpi_comm=None, timeout: float | None = None, ranks_per_node: int | None = None):
        super().__init__()
        from mpi4py import MPI

        self.mpi = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.host = MPIComm(self.mpi)  # metadata, node detection
        self.rank, self.size = self.mpi.Get_rank(), self.mpi.Get_size()
        self.timeout = timeout
        self.ranks_per_node = checked_ranks_per_node(ranks_per_node)
        self.device = bind_local_gpu()
        self._nccl = import_nccl()
        uid = self._nccl.get_unique_id() if self.rank == 0 else None
        self.nccl = self._nccl.NcclCommunicator(self.size, self.mpi.bcast(uid, root=0), self.rank)
        self._pending: list[_Op] = []
        self._types = _nccl_types(self._nccl)
        self._ops = {"sum": self._nccl.NCCL_SUM, "prod": self._nccl.NCCL_PROD,
                     "max": self._nccl.NCCL_MAX, "min": self._nccl.NCCL_MIN}

    def with_timeout(self, timeout: float | None, poll_pause: float | None = None) -> "NcclComm":
        twin = NcclComm(self.mpi.Dup(), timeout=timeout, ranks_per_node=self.ranks_per_node)
        if self.ranks_per_node is None and self._node_ids is not None:
            self._inherit_nodes(twin, range(self.size))
        return twin

    def split(self, color: int, key: int | None = None) -> "NcclComm":
        sub = NcclComm(self.mpi.Split(color, self.rank if key is None else key), timeout=self.timeout)
        return self._inherit_nodes(sub)

    def _detect_node_ids(self) -> list[int]:
        return self.host._detect_node_ids()

    # ---- point-to-point: collected, then issued as one NCCL group ----------------------------------------------
    def _issue(self) -> None:
        if not self._pending:
            return
        ops, self._pending = self._pending, []
        nccl, byte = self.nccl, self._types["uint8"]
        self._nccl.groupStart()
        try:
            for op in ops:
                if op.nbytes:  # (both sides skip empty messages: the receiver knows the size too)
                    (nccl.send if op.kind == "send" else nccl.recv)(op.ptr, op.nbytes, byte, op.peer, op.stream.ptr)
        finally:
            self._nccl.groupEnd()
        if self.timeout is not None:
            self._finish(ops[-1].stream, f"{len(ops)} operation(s) with rank(s) {sorted({o.peer for o in ops})}")

    def _finish(self, stream, what: str) -> None:
        """Wait (up to the timeout) for everything enqueued on ``stream`` so far."""
        import cupy

        done = cupy.cuda.Event(block=False, disable_timing=True)
        done.record(stream)
        deadline, pause = time.monotonic() + self.timeout, 0.0
        while not done.done:
            if time.monotonic() > deadline:
                self.nccl.abort()  # the GPU may be stuck in a kernel waiting for a peer: free it
                raise CommTimeoutError(f"rank {self.rank}: {what} did not complete within {self.timeout:g} s "
                                       "(a deadlock? the peer never posted the matching operation); "
                                       "this NCCL communicator is aborted")
            time.sleep(pause)
            pause = min(2 * pause + 1e-6, 1e-3)

    def _send(self, buf, dest, tag):
        self._pending.append(_Op("send", buf, dest))
        self._issue()

    def _recv(self, buf, source, tag):
        self._pending.append(_Op("recv", buf, source))
        self._issue()

    def _sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        self._pending += [_Op("recv", recvbuf, source), _Op("send", sendbuf, dest)]
        self._issue()

    def _isend(self, buf, dest, tag):
        op = _Op("send", buf, dest)
        self._pending.append(op)
        return op

    def _irecv(self, buf, source, tag):
        op = _Op("recv", buf, source)
        self._pending.append(op)
        return op

    def _wait(self, handle, what):
        self._issue()  # (with a timeout, _issue already waited for the stream)

    def _test(self, handle) -> bool:
        import cupy

        self._issue()
        done = cupy.cuda.Event(block=False, disable_timing=True)
        done.record(handle.stream)
        return done.done

    def barrier(self):
        self._issue()
        current_stream(None).synchronize()
        self.host.barrier()

    def allgather_object(self, obj) -> list:
        return self.mpi.allgather(obj)

    # ---- NCCL's own collectives (any CuPy array or CUDA tensor in, the same kind out) ---------------------------
    def _enter(self, x):
        """(array, back, bfloat16, scope): ``x`` as a CuPy array, and where to run (its device and stream)."""
        self._issue()  # point-to-point operations posted earlier go first
        arr, back, bf16 = as_array(x)
        if not is_gpu_array(arr):
            raise TypeError(f"NcclComm moves GPU memory (CuPy arrays, CUDA tensors); got {type(x).__name__}")
        return arr, back, bf16, gpu_scope(x, arr)

    def _typed(self, arr, bf16, op=None):
        """(flat contiguous array, NCCL data type, NCCL op, stream pointer), inside the scope."""
        import cupy

        flat = cupy.ascontiguousarray(arr).reshape(-1)
        reduce_op = None if op is None else get_op(op)
        kind = "bfloat16" if bf16 or getattr(reduce_op, "bfloat16", False) else flat.dtype.name
        if reduce_op is not None and kind not in self._types:
            raise Unsupported(f"NCCL cannot reduce {kind}; it reduces {sorted(self._types)}")
        nccl_op = None if reduce_op is None else self._ops[reduce_op.name]
        return flat, self._types.get(kind), nccl_op, cupy.cuda.get_current_stream().ptr

    def builtin_allreduce(self, x, op="sum"):
        import cupy

        arr, back, bf16, scope = self._enter(x)
        with scope:
            flat, dtype, nccl_op, stream = self._typed(arr, bf16, op)
            out = cupy.empty_like(flat)
            if flat.size:
                self.nccl.allReduce(flat.data.ptr, out.data.ptr, flat.size, dtype, nccl_op, stream)
            return back(out.reshape(arr.shape))

    def builtin_reduce_scatter(self, x, op="sum"):
        import cupy

        arr, back, bf16, scope = self._enter(x)
        with scope:
            flat, dtype, nccl_op, stream = self._typed(arr, bf16, op)
            counts, p = block_counts(flat.size, self.size), self.size
            m = counts[0]  # blocks are cut like numpy.array_split; NCCL wants equal ones: pad each to m
            if flat.size != m * p:
                padded = cupy.zeros(m * p, dtype=flat.dtype)  # (the padding is reduced, then dropped)
                start = 0
                for i, c in enumerate(counts):
                    padded[i * m : i * m + c] = flat[start : start + c]
                    start += c
                flat = padded
            out = cupy.empty(m, dtype=flat.dtype)
            if m:
                self.nccl.reduceScatter(flat.data.ptr, out.data.ptr, m, dtype, nccl_op, stream)
            return back(out[: counts[self.rank]])

    def builtin_allgather(self, x):
        import cupy

        arr, back, _, scope = self._enter(x)
        with scope:
            flat, _, _, stream = self._typed(arr, False)
            counts = self.mpi.allgather(flat.size)
            m, p = max(counts), self.size
            if flat.size != m:  # NCCL gathers equal pieces: pad, then drop the padding
                flat = cupy.concatenate([flat, cupy.zeros(m - flat.size, dtype=flat.dtype)])
            out = cupy.empty(m * p, dtype=flat.dtype)
            if m:  # moved as bytes: any dtype, bfloat16 bits included
                self.nccl.allGather(flat.data.ptr, out.data.ptr, flat.nbytes, self._types["uint8"], stream)
            if len(set(counts)) > 1:
                out = cupy.concatenate([out[i * m : i * m + c] for i, c in enumerate(counts)])
            return back(out)

    def builtin_broadcast(self, x, root=0):
        arr, back, _, scope = self._enter(x)
        with scope:
            flat, _, _, stream = self._typed(arr, False)
            out = flat.copy()
            if out.size:
                self.nccl.broadcast(out.data.ptr, out.data.ptr, out.nbytes, self._types["uint8"], root, stream)
            return back(out.reshape(arr.shape))

    def builtin_reduce(self, x, op="sum", root=0):
        import cupy

        arr, back, bf16, scope = self._enter(x)
        with scope:
            flat, dtype, nccl_op, stream = self._typed(arr, bf16, op)
            out = cupy.empty_like(flat) if self.rank == root else None
            if flat.size:
                self.nccl.reduce(flat.data.ptr, 0 if out is None else out.data.ptr, flat.size, dtype, nccl_op,
                                 root, stream)
            return None if out is None else back(out.reshape(arr.shape))


def _nccl_types(nccl) -> dict:
    names = {"int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32", "uint32": "NCCL_UINT32",
             "int64": "NCCL_INT64", "uint64": "NCCL_UINT64", "float16": "NCCL_FLOAT16",
             "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64"}
    types = {k: getattr(nccl, v) for k, v in names.items()}
    types["bfloat16"] = getattr(nccl, "NCCL_BFLOAT16", 9)  # ncclBfloat16 (NCCL >= 2.10)
    return types
