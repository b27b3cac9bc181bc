"""StagedComm: MPI for arrays in GPU memory, when the MPI library cannot read GPU memory itself.

Three ways to move a GPU buffer with MPI, chosen by ``mode``:

    naive       copy the whole message GPU -> host, MPI, host -> GPU, one step after the other
                (what the course project did: time = copy + wire + copy, and the copies use pageable memory)
    pipelined   cut the message into chunks of ``chunk_bytes`` staged through pinned (page-locked) host
                buffers: while chunk k crosses MPI, chunk k+1 is being copied off the GPU and chunk k-1 on
                to it, so for large messages the time tends to max(copy, wire) instead of their sum
    direct      hand the GPU buffer to MPI (only for a CUDA-aware MPI: ``cuda_aware_mpi()``)
    auto        direct where the MPI library says it is CUDA-aware, pipelined otherwise

Host (numpy) buffers go to MPI unchanged. The reductions of an algorithm stay on the GPU (CuPy kernels);
only the messages are staged. Copies are enqueued on the caller's current stream, so they are ordered
after the kernel that produced a message and before the one that consumes it; the host waits for a
chunk's copy (an event) before handing it to MPI, since MPI knows nothing of streams.

``builtin_*`` stage the whole vector and call the MPI library's collective on the host copy (direct
mode: on the GPU buffer), which is the "host MPI all-reduce of GPU data" baseline of
scripts/gpu_collectives.py.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from tplab.toolkit.arrays import array_module, as_array, current_stream, gpu_scope, is_gpu_array
from tplab.comm.base import Communicator
from tplab.comm.mpi import MPIComm
from tplab.comm.nccl import bind_local_gpu

MODES = ("naive", "pipelined", "direct", "auto")


def cuda_aware_mpi() -> bool:
    """Does the MPI library under mpi4py accept GPU buffers? Asks ``MPIX_Query_cuda_support()`` (Open MPI,
    MPICH >= 4); TPLAB_CUDA_AWARE_MPI=0/1 overrides. False where the library cannot say."""
    forced = os.environ.get("TPLAB_CUDA_AWARE_MPI")
    if forced is not None:
        return forced.strip() not in ("", "0", "false", "no")
    from mpi4py import MPI

    try:  # the symbol lives in libmpi, a dependency of mpi4py's extension: dlsym through its handle
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False
    query.restype, query.argtypes = ctypes.c_int, []
    return bool(query())


def _gpu_bytes(buf):
    """A GPU message as the bytes it holds (a uint8 CuPy view of the same memory, for CuPy arrays and CUDA
    tensors alike): MPI then moves any dtype, float16 and bfloat16 included, which Open MPI 4 cannot type.
    Host arrays are left as they are."""
    if type(buf) is np.ndarray:
        return buf
    if type(buf).__module__.startswith("torch") and buf.device.type == "cuda":
        buf = as_array(buf)[0]
    if is_gpu_array(buf):
        return buf.reshape(-1).view(np.uint8)
    return buf


class _Staged:
    """A nonblocking staged operation: its MPI request, the host copy, and the GPU buffer to fill."""

    def __init__(self, request, host, gpu=None):
        self.request, self.host, self.gpu = request, host, gpu


class StagedComm(Communicator):
    moves_gpu_memory = True

    def __init__(self, host: MPIComm | None = None, mode: str = "auto", chunk_bytes: int = 1 << 20):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        from tplab.comm import world

        self.host = world() if host is None else host
        self.rank, self.size = self.host.rank, self.host.size
        self.ranks_per_node = self.host.ranks_per_node
        self.device = bind_local_gpu()
        self.cuda_aware = cuda_aware_mpi()
        if mode == "direct" and not self.cuda_aware:
            raise RuntimeError("mode='direct' needs a CUDA-aware MPI, and this one says it is not "
                               "(MPIX_Query_cuda_support() == 0; TPLAB_CUDA_AWARE_MPI=1 to insist)")
        self.mode = ("direct" if self.cuda_aware else "pipelined") if mode == "auto" else mode
        self.chunk_bytes = int(chunk_bytes)
        self._pinned: dict[str, np.ndarray] = {}
        self._copies_from_recv_staging = None  # event: the last host->GPU copies out of the pinned buffer

    def split(self, color: int, key: int | None = None) -> "StagedComm":
        sub = StagedComm(self.host.split(color, key), self.mode, self.chunk_bytes)
        return self._inherit_nodes(sub)

    def _detect_node_ids(self) -> list[int]:
        return self.host.node_ids()

    # ---- staging helpers -----------------------------------------------------------------------------------
    def _pinned_buffer(self, purpose: str, nbytes: int) -> np.ndarray:
        """A grow-only page-locked host buffer (uint8): copies from/to it run asynchronously, at full speed."""
        buf = self._pinned.get(purpose)
        if buf is None or buf.size < nbytes:
            import cupyx

            buf = self._pinned[purpose] = cupyx.empty_pinned(max(nbytes, 1), dtype=np.uint8)
        return buf[:nbytes]

    @staticmethod
    def _copy(dst_ptr, src_ptr, nbytes, kind, stream):
        import cupy

        cupy.cuda.runtime.memcpyAsync(dst_ptr, src_ptr, nbytes, kind, stream.ptr)

    def _exchange(self, sendbuf, dest, recvbuf, source, tag):
        """Pipelined staging: send ``sendbuf`` and/or receive ``recvbuf`` (either may be None) in chunks."""
        import cupy

        rt, mpi, c = cupy.cuda.runtime, self.host.mpi, self.chunk_bytes
        stream = current_stream(sendbuf if sendbuf is not None else recvbuf)
        if self._copies_from_recv_staging is not None:  # the pinned receive buffer is free again
            self._copies_from_recv_staging.synchronize()
            self._copies_from_recv_staging = None
        sends, recvs, copied = [], [], []
        if recvbuf is not None:
            r_host = self._pinned_buffer("recv", recvbuf.nbytes)
            recvs = [mpi.Irecv(r_host[k : k + c], source, tag) for k in range(0, recvbuf.nbytes, c)]
        if sendbuf is not None:
            s_host = self._pinned_buffer("send", sendbuf.nbytes)
            for k in range(0, sendbuf.nbytes, c):  # every chunk's copy off the GPU, each with its event
                n = min(c, sendbuf.nbytes - k)
                self._copy(s_host[k:].ctypes.data, sendbuf.data.ptr + k, n, rt.memcpyDeviceToHost, stream)
                copied.append(cupy.cuda.Event(block=False, disable_timing=True))
                copied[-1].record(stream)
        for i in range(max(len(copied), len(recvs))):
            if i < len(copied):  # chunk i is on the host: off it goes
                copied[i].synchronize()
                k = i * c
                sends.append(mpi.Isend(s_host[k : k + c], dest, tag))
            if i < len(recvs):  # chunk i arrived: on to the GPU, in stream order
                self.host._wait(recvs[i], f"recv chunk {i} from rank {source} (tag {tag})")
                k = i * c
                n = min(c, recvbuf.nbytes - k)
                self._copy(recvbuf.data.ptr + k, r_host[k:].ctypes.data, n, rt.memcpyHostToDevice, stream)
        for i, s in enumerate(sends):
            self.host._wait(s, f"send chunk {i} to rank {dest} (tag {tag})")
        if recvs:
            self._copies_from_recv_staging = cupy.cuda.Event(block=False, disable_timing=True)
            self._copies_from_recv_staging.record(stream)

    # ---- point-to-point (GPU messages travel as bytes: see _gpu_bytes) -------------------------------------------
    def send(self, buf, dest: int, tag: int = 0) -> None:
        super().send(_gpu_bytes(buf), dest, tag)

    def recv(self, buf, source: int, tag: int = 0):
        super().recv(_gpu_bytes(buf), source, tag)
        return buf

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0):
        super().sendrecv(_gpu_bytes(sendbuf), dest, _gpu_bytes(recvbuf), source, tag)
        return recvbuf

    def isend(self, buf, dest: int, tag: int = 0):
        request = super().isend(_gpu_bytes(buf), dest, tag)
        request.buf = buf
        return request

    def irecv(self, buf, source: int, tag: int = 0):
        request = super().irecv(_gpu_bytes(buf), source, tag)
        request.buf = buf
        return request

    def _send(self, buf, dest, tag):
        if not is_gpu_array(buf):
            return self.host._send(buf, dest, tag)
        if self.mode == "naive":
            return self.host._send(buf.get(), dest, tag)  # (.get() waits for the stream, then copies)
        if self.mode == "direct":
            current_stream(buf).synchronize()
            return self.host._send(buf, dest, tag)
        self._exchange(buf, dest, None, None, tag)

    def _recv(self, buf, source, tag):
        if not is_gpu_array(buf):
            return self.host._recv(buf, source, tag)
        if self.mode == "naive":
            host = np.empty(buf.shape, dtype=buf.dtype)
            self.host._recv(host, source, tag)
            return buf.set(host)
        if self.mode == "direct":
            current_stream(buf).synchronize()
            return self.host._recv(buf, source, tag)
        self._exchange(None, None, buf, source, tag)

    def _sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        if not is_gpu_array(sendbuf) and not is_gpu_array(recvbuf):
            return self.host._sendrecv(sendbuf, dest, recvbuf, source, tag)
        if self.mode == "pipelined" and is_gpu_array(sendbuf) and is_gpu_array(recvbuf):
            return self._exchange(sendbuf, dest, recvbuf, source, tag)
        if self.mode == "direct":
            current_stream(sendbuf).synchronize()
            return self.host._sendrecv(sendbuf, dest, recvbuf, source, tag)
        # naive: the whole message to the host, exchanged, back to the GPU
        send_host = sendbuf.get() if is_gpu_array(sendbuf) else sendbuf
        recv_host = np.empty(recvbuf.shape, dtype=recvbuf.dtype) if is_gpu_array(recvbuf) else recvbuf
        self.host._sendrecv(send_host, dest, recv_host, source, tag)
        if recv_host is not recvbuf:
            recvbuf.set(recv_host)

    def _isend(self, buf, dest, tag):
        if not is_gpu_array(buf):
            return _Staged(self.host._isend(buf, dest, tag), buf)
        if self.mode == "direct":
            current_stream(buf).synchronize()
            return _Staged(self.host._isend(buf, dest, tag), None)
        host = buf.get()  # staged whole (its own host copy, alive until the wait)
        return _Staged(self.host._isend(host, dest, tag), host)

    def _irecv(self, buf, source, tag):
        if not is_gpu_array(buf):
            return _Staged(self.host._irecv(buf, source, tag), buf)
        if self.mode == "direct":
            current_stream(buf).synchronize()
            return _Staged(self.host._irecv(buf, source, tag), None)
        host = np.empty(buf.shape, dtype=buf.dtype)
        return _Staged(self.host._irecv(host, source, tag), host, gpu=buf)

    def _wait(self, handle, what):
        self.host._wait(handle.request, what)
        self._land(handle)

    def _test(self, handle) -> bool:
        if not self.host._test(handle.request):
            return False
        self._land(handle)
        return True

    @staticmethod
    def _land(handle):
        if handle.gpu is not None:  # a staged receive: its data onto the GPU
            handle.gpu.set(handle.host)
            handle.gpu = None

    def barrier(self):
        import cupy

        cupy.cuda.get_current_stream().synchronize()
        self.host.barrier()

    def allgather_object(self, obj) -> list:
        return self.host.allgather_object(obj)

    # ---- the MPI library's collectives on a host copy (or the GPU buffer itself, when CUDA-aware) ----------------
    def _builtin(self, name, x, *args):
        arr, back, bf16 = as_array(x)
        if not is_gpu_array(arr):
            return getattr(self.host, name)(arr, *args)
        if bf16 or getattr(args[0] if args else None, "bfloat16", False) or arr.dtype == np.float16:
            return self._builtin_widened(name, x, arr, back, bf16 or arr.dtype != np.float16, *args)
        with gpu_scope(x, arr):
            if self.mode == "direct" and name == "builtin_allreduce":  # MPI reads and writes GPU memory
                from tplab.toolkit.ops import get_op

                flat = array_module(arr).ascontiguousarray(arr)
                out = array_module(arr).empty_like(flat)
                current_stream(arr).synchronize()
                self.host.mpi.Allreduce(flat, out, op=get_op(args[0]).mpi_op)
                return back(out)
            out = getattr(self.host, name)(arr.get(), *args)  # the whole vector through host memory
            return None if out is None else back(array_module(arr).asarray(out))

    def _builtin_widened(self, name, x, arr, back, bfloat16, *args):
        """MPI has no bfloat16, and Open MPI 4 no float16: widen to float32 on the GPU, reduce on the host,
        round once at the end (more accurate than rounding at every step; twice the bytes on the wire)."""
        from tplab.toolkit.bfloat16 import narrow, widen

        args = tuple(getattr(a, "name", a) for a in args)  # (the op by name: the float32 one)
        with gpu_scope(x, arr):
            wide = widen(arr) if bfloat16 else arr.astype(np.float32)
            out = getattr(self.host, name)(wide.get(), *args)
            if out is None:
                return None
            out = array_module(arr).asarray(out)
            return back(narrow(out) if bfloat16 else out.astype(np.float16))

    def builtin_allreduce(self, x, op="sum"):
        return self._builtin("builtin_allreduce", x, op)

    def builtin_reduce_scatter(self, x, op="sum"):
        return self._builtin("builtin_reduce_scatter", x, op)

    def builtin_allgather(self, x):
        return self._builtin("builtin_allgather", x)

    def builtin_broadcast(self, x, root=0):
        return self._builtin("builtin_broadcast", x, root)

    def builtin_reduce(self, x, op="sum", root=0):
        return self._builtin("builtin_reduce", x, op, root)
