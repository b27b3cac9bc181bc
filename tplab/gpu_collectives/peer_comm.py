"""PeerMemoryComm: a GPU communicator whose own all-reduce is tplab's peer-memory kernels.

    comm = PeerMemoryComm(tplab.comm.nccl_world(), max_bytes=256 << 20)   # collective; one node
    y = tplab.allreduce(x_cuda, comm)        # "auto": the one-shots / two-shots / ring by size, one launch a call
    y = tplab.allreduce(x_cuda, comm, algorithm="ring")   # tplab's hand-written ring over NCCL send/recv

Everything else -- point-to-point, NCCL's other collectives, metadata -- is the NCCL communicator inside
(``inner``). The own all-reduce takes sums of the kernels' element types up to the buffer's size; other
calls (another op, int8, a larger message) go to NCCL, and what NCCL cannot reduce either (int16) to a
hand-written algorithm (tplab.collectives' fallback).

Plans (``plan``): the first ``tplab.allreduce`` of a kind of tensor (shape, dtype, stream) works out the
kernel, its grid and its packed arguments once; every later call allocates the output, points the kernel at
input and output and launches it through cuLaunchKernel -- no conversion, no stream object, no host
round trip, and it can be captured in a CUDA graph. The ranks' agreement on the arguments is the kernel's
first step (signature.py): a disagreement stops every rank's kernel before it writes any output and raises
on every rank (at once on a plan's first call, else at the next call on this communicator).

Every call agrees exactly once on every rank, whatever path it takes (the fused step, or ``agree`` before
NCCL and hand-written algorithms), so ranks on different paths still meet and see their disagreement.
"""

from __future__ import annotations

import numpy as np

from tplab.comm.nccl import nccl_world
from tplab.comm.wrapped import Wrapped
from tplab.gpu_collectives.peer_kernels import KERNEL_TYPES, LAMPORT_KERNELS, LAMPORT_TYPES, PACK, fast_launcher
from tplab.gpu_collectives.peer_memory import PULLED, PeerMemory, capturing
from tplab.gpu_collectives.signature import signature
from tplab.toolkit.arrays import external_stream, is_gpu_array, is_torch, torch_stream_pointer

KERNELS = ("auto", "one_shot_ll", "one_shot_lamport", "one_shot", "two_shot_lamport", "two_shot", "ring")


class PeerMemoryComm(Wrapped):
    moves_gpu_memory = True
    takes_host_memory = False
    prefers_builtin = True

    def __init__(self, inner=None, max_bytes: int = 64 << 20, *, blocks: int | None = None, timeout: float = 30.0):
        super().__init__(nccl_world() if inner is None else inner)  # point-to-point, metadata: NCCL's
        self.device = self.inner.device
        self.ranks_per_node = self.inner.ranks_per_node
        self.peers = PeerMemory(self.inner.mpi, max_bytes, blocks=blocks, timeout=timeout)
        self._kernel = "auto"

    @property
    def kernel(self) -> str:
        """The own all-reduce's kernel: "auto" (by size: peers.table, ``tune()``) or one of KERNELS."""
        return self._kernel

    @kernel.setter
    def kernel(self, name: str) -> None:
        if name not in KERNELS:
            raise ValueError(f"PeerMemoryComm.kernel: {name!r} is not one of {KERNELS}")
        self._kernel = name
        self.plans.clear()  # (a plan keeps the kernel it was made with)

    def cannot_take(self, arr):
        return self.inner.cannot_take(arr) or (
            f"the array is on GPU {arr.device.id}, this rank's communicator on GPU {self.device}"
            if arr.device.id != self.device else None)

    def agree(self, description):
        """On the GPUs (one small kernel, then a wait): no host all-gather."""
        import cupy

        if description.get("collective") == "allreduce":   # (ranks whose kernels differ would not meet alike)
            description = {**description, "kernel": self.kernel}
        with cupy.cuda.Device(self.device):  # (an input on another GPU: this rank still meets its peers)
            message = self.peers.agree(signature(description))
        problems = description.get("problems")
        return f"rank {self.rank}: " + "; ".join(problems) if problems else message

    # ---- its own collectives --------------------------------------------------------------------------------
    def _kernels_take(self, nbytes: int, dtype_name: str, op_name: str) -> bool:
        fits = nbytes <= self.peers.limit(self.kernel)
        sums = dtype_name in KERNEL_TYPES and (self.kernel not in LAMPORT_KERNELS
                                               or KERNEL_TYPES[dtype_name] in LAMPORT_TYPES)
        return op_name == "sum" and sums and fits

    def builtin_allreduce(self, x, op="sum"):
        import cupy

        bf16 = getattr(op, "bfloat16", False)  # (16-bit integers holding bfloat16 bits)
        if not self._kernels_take(x.nbytes, "bfloat16" if bf16 else x.dtype.name, getattr(op, "name", op)):
            return self.inner.builtin_allreduce(x, op)
        flat = cupy.ascontiguousarray(x).reshape(-1)
        return self.peers.allreduce(flat, self.kernel, bf16=bf16, check=False, agreed=True).reshape(x.shape)

    def builtin_reduce_scatter(self, x, op="sum"):
        return self.inner.builtin_reduce_scatter(x, op)

    def builtin_allgather(self, x):
        return self.inner.builtin_allgather(x)

    def builtin_broadcast(self, x, root=0):
        return self.inner.builtin_broadcast(x, root)

    def builtin_reduce(self, x, op="sum", root=0):
        return self.inner.builtin_reduce(x, op, root)

    def plan(self, collective, x, op=None, algorithm="auto"):
        if collective != "allreduce" or op != "sum":
            return None
        # (strided views too: a plan copies them first. So whether a call takes this path depends only on
        # what the ranks agree on -- shape, dtype, op, algorithm -- and never meets a general-path call of
        # the same description, which would agree apart from the kernel that moves its data.)
        if is_torch(x):
            ok = x.is_cuda and x.device.index == self.device
            dtype, nbytes = str(x.dtype).removeprefix("torch."), x.numel() * x.element_size()
        elif is_gpu_array(x):
            ok = x.device.id == self.device
            dtype, nbytes = x.dtype.name, x.nbytes
        else:
            return None
        if not ok or not self._kernels_take(nbytes, dtype, op) or nbytes == 0 or self.size == 1:
            return None  # (the general path: it agrees, refuses or falls back as it must)
        description = {"collective": "allreduce", "shape": tuple(x.shape), "dtype": dtype, "op": op,
                       "algorithm": algorithm, "root": None, "problems": [], "kernel": self.kernel}
        plan = AllreducePlan(self, x, nbytes, KERNEL_TYPES[dtype], signature(description))
        return plan.contiguous_tensor if plan.torch and plan.contiguous and not plan.staged else plan

    def tune(self, sizes=None, iters: int = 20):
        """Collective: time the kernels here (PeerMemory.tune) so that "auto" picks the fastest by size on
        this machine; plans made before keep the kernel they chose, so they are dropped."""
        self.plans.clear()
        return self.peers.tune(sizes, iters)

    def close(self):
        """Collective: unmap and free the peer memory (the NCCL communicator stays)."""
        self.plans.clear()
        self.peers.close()


class AllreducePlan:
    """tplab.allreduce of one kind of tensor on peer memory, worked out once; ``plan(x)`` -> the sum."""

    def __init__(self, comm: PeerMemoryComm, x, nbytes: int, element: str, sig: int):
        import cupy

        peers = self.peers = comm.peers
        self.torch, self.nbytes = is_torch(x), nbytes
        self.contiguous = x.is_contiguous() if self.torch else x.flags.c_contiguous
        self.stream = torch_stream_pointer(x.device.index) if self.torch else cupy.cuda.get_current_stream().ptr
        algorithm = peers.choose(nbytes, element) if comm.kernel == "auto" else comm.kernel
        padded = -(-nbytes // PACK) * PACK
        self.staged = nbytes != padded  # odd sizes go through a padded copy (the kernels move 16-byte packs)
        if self.staged:
            self.source, self.target = cupy.zeros(padded, cupy.uint8), cupy.zeros(padded, cupy.uint8)
            placeholders = (self.source, self.target)
        else:  # the kernel's pointers are replaced on every call: any arrays of the right size hold the place
            placeholders = (peers.peer_buffer(peers.rank, padded), peers.peer_buffer(peers.rank, padded))
        self.placeholders, self.algorithm, self.element, self.sig = placeholders, algorithm, element, sig
        self.launch = self._make_launcher(algorithm, sig)
        self.pulled = None           # (made for the first input that lies in the shared buffer)
        self.checked, self.pulled_checked, self.status = False, False, peers.status
        if self.torch:  # (bound once: an import statement per call is measurable at these latencies)
            import torch

            self.empty_like = torch.empty_like
        else:
            self.empty_like, self.ascontiguousarray = cupy.empty_like, cupy.ascontiguousarray

    def __call__(self, x, comm=None):
        self.peers.raise_pending(self.stream)
        if not self.contiguous and self.peers.overlaps(x.data_ptr() if self.torch else x.data.ptr, self.nbytes):
            self._refuse("x may lie in the shared buffer only whole, from its start (PeerMemory.buffer), not "
                         "as a strided view")   # (its copy would read it while a peer may push into it)
        if self.torch:
            x = x if self.contiguous else x.contiguous()
            out = self.empty_like(x)
            source, target = x.data_ptr(), out.data_ptr()
        else:
            x = x if self.contiguous else self.ascontiguousarray(x)
            out = self.empty_like(x)
            source, target = x.data.ptr, out.data.ptr
        if self.peers.overlaps(source, self.nbytes):   # (out is new: never in the shared buffer)
            self._from_shared_buffer(source, target)
            return out
        if self.staged or source % PACK or target % PACK:
            self._through_copies(source, target)
        else:
            self.launch(source, target, self.stream)
        if not self.checked:
            self._first_call_waits()
        return out

    def contiguous_tensor(self, x, comm=None):
        """``self(x)`` for the commonest kind, a contiguous torch tensor of whole packs, with nothing left
        to check: the path whose few microseconds of host time set a small all-reduce's pace."""
        if self.status[0] or self.peers.broken or not self.checked:
            return self(x)
        out = self.empty_like(x)
        source, target = x.data_ptr(), out.data_ptr()
        if self.peers.overlaps(source, self.nbytes):
            return self(x)
        if (source | target) % PACK:
            self._through_copies(source, target)
        else:
            self.launch(source, target, self.stream)
        return out

    def _make_launcher(self, algorithm: str, sig: int):
        kernel, blocks, threads, args = self.peers.allreduce_kernel(*self.placeholders, algorithm, self.element, sig)
        return (fast_launcher(kernel, blocks, threads, args, programmatic=self.peers.programmatic)
                or _cupy_launcher(kernel, blocks, threads, args))

    def _from_shared_buffer(self, source, target):
        """An input in this rank's shared buffer, as PeerMemory.allreduce takes one. Only from the buffer's
        start: the peers write into the rest. one_shot's peers only read this buffer, so a copy of the input
        will do. two_shot and the ring push into it, a two_shot after a two_shot even before its ranks have
        met -- possibly while this rank's program was still writing the input -- so they pull it where it
        lies instead, signed as a pulled call: ranks whose inputs all lie in their buffers agree, and a
        rank whose input does not disagrees with them, which raises on every rank."""
        if source != self.peers.buffer_address:
            self._refuse("x may lie in the shared buffer only from its start (PeerMemory.buffer)")
        if self.algorithm not in ("two_shot", "ring"):
            self._through_copies(source, target)
            if not self.checked:
                self._first_call_waits()
            return
        if self.pulled is None:
            self.pulled = self._make_launcher(self.algorithm + "_pull", self.sig ^ PULLED)
        if self.staged or target % PACK:   # odd sizes: the pulled kernel copies its staged input in first
            self._through_copies(source, target, self.pulled)
        else:
            self.pulled(source, target, self.stream)
        if not self.pulled_checked and not capturing(self.stream):   # (its first call raises at once, as a plan's)
            self._wait_and_raise()
            self.pulled_checked = True

    def _refuse(self, problem: str):
        with external_stream(self.stream, self.peers.device):   # (the refusal and its barrier: on the calls' stream)
            self.peers.refuse(problem)

    def _through_copies(self, source, target, launch=None):
        import cupy

        if not self.staged:  # (a misaligned view: make the staging buffers once)
            padded = -(-self.nbytes // PACK) * PACK
            self.source, self.target, self.staged = cupy.zeros(padded, cupy.uint8), cupy.zeros(padded, cupy.uint8), True
        copy = cupy.cuda.runtime.memcpyAsync
        copy(self.source.data.ptr, source, self.nbytes, 3, self.stream)   # 3: device to device
        (launch or self.launch)(self.source.data.ptr, self.target.data.ptr, self.stream)
        copy(target, self.target.data.ptr, self.nbytes, 3, self.stream)

    def _first_call_waits(self):
        """A plan's first call waits for its kernel, so that ranks that disagree raise at once (not while a
        CUDA graph is being captured: then the next call outside it waits)."""
        if capturing(self.stream):
            return
        self.checked = True
        self._wait_and_raise()

    def _wait_and_raise(self):
        import cupy

        cupy.cuda.runtime.streamSynchronize(self.stream)
        self.peers.raise_pending(self.stream)


def _cupy_launcher(kernel, blocks, threads, args):
    """Where libcuda cannot be loaded by ctypes: CuPy's launcher, with the pointers swapped per call."""
    args = list(args)

    def launch(source, target, stream):
        args[0], args[1] = np.uint64(source), np.uint64(target)  # (a pointer is a 64-bit argument)
        with external_stream(stream):
            kernel((blocks,), (threads,), tuple(args))
    return launch

