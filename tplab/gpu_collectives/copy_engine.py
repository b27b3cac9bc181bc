"""An all-reduce that leaves the multiprocessors to the GEMMs: data moved by the copy engines.

Why: NCCL's all-reduce (and peer_memory.py's kernels) move data with kernels, so they take SMs from the
GEMMs they are meant to overlap with, and each slows the other (notebook 06: 13-20% hidden on 4x H200).
A GPU also has copy engines (DMA units that move bytes over NVLink without any SM). Here every byte
between GPUs goes through them; the SMs only add up one block per rank (the barriers are stream memory
operations, in a CUDA graph too), so the GEMMs on the other stream keep the GPU.

    two-shot with copy engines, rank r of p, its stream S (p-1 side streams copy concurrently);
    slot q = the q-th block of a rank's shared buffer (half j % 2 on call j):
      slot r of rank q's buffer <- block q of x, for every q              copy engines push, over NVLink
                                                                          (my own block: a local copy)
      barrier(all)
      slot r of my buffer <- sum over q of my slot q, in rank order      SMs: n/p elements, once
      barrier(all)
      block q of x <- slot q of rank q's buffer, for every q              copy engines pull, and mine
      barrier(all)                                                      nobody reads this call's half any more

The result is bitwise identical on every rank (block q is summed once, by rank q). The last barrier lets
any call follow, queued eagerly or replayed from a CUDA graph: once it is passed, no peer reads this call's
half any more. (Two halves still alternate between calls.) Pushing the reduce-scatter, not pulling it,
spares a copy of the whole input into the shared buffer (the peers read only what the copy engines wrote
there): 2.4 ms instead of 2.9 for the two all-reduces of the course project's layer on 4x H100. Nothing
waits on the host, so calls queue back to back on a side stream.

Inside a CUDA graph capture the barriers change. A counted stream barrier waits for a number fixed when
it is queued: a graph's second replay would find the first replay's numbers already there and not wait
at all (measured: the overlapped layer then differs from the plain one by 20% now and then). So while
capturing, each call's three barriers are replayable ones (StreamBarriers.queue_replayable: write 1, wait
for 1, reset to 0), in three flag slots, one per barrier of the call -- still no kernel, so a GEMM that
holds every SM does not delay them. (The last barrier matters most there: a graph may hold an odd number of
calls, and then a replay's first call uses the half of the previous replay's last; and a replay may follow
eager calls that used its half.)

    ce = CopyEngineComm(mpi_comm, max_bytes=160 << 20)         # collective
    tplab.allreduce(t, ce)      # torch CUDA tensor, on torch's current stream; ``ce`` is a Communicator
                                # (whole collectives only): pass it to tplab's layers
    CopyEngineComm(mpi_comm, in_place=True)   # the all-reduce overwrites its input (forward-only
                                              # experiments: the layer's partial product is not needed)
"""

from __future__ import annotations

import numpy as np

from tplab.comm.base import Communicator, Unsupported
from tplab.gpu_collectives.peer_kernels import LINE_PACKS, PACK, kernel, torch_as_cupy, type_name
from tplab.gpu_collectives.peer_agreement import capturing as is_capturing  # (a local name: `capturing` below)
from tplab.gpu_collectives.peer_memory import PeerMemory
from tplab.toolkit.arrays import external_stream, is_torch

MEMCPY_DEVICE_TO_DEVICE = 3


class CopyEngineComm(Communicator):
    """All-reduce of up to ``max_bytes`` per rank through copy engines (see the module docstring): a
    Communicator of whole collectives (no point-to-point; sums of the kernels' element types only). Its
    plans, like torch.distributed, hold no agreement round (arguments that differ across ranks are the
    caller's to avoid); the general path agrees on the host."""

    point_to_point = False
    prefers_builtin = True
    moves_gpu_memory = True
    takes_host_memory = False

    def __init__(self, mpi_comm, max_bytes: int = 64 << 20, *, in_place: bool = False):
        import cupy

        super().__init__()
        self.in_place = in_place
        self.mpi, self.rank, self.size = mpi_comm, mpi_comm.Get_rank(), mpi_comm.Get_size()
        line = PACK * LINE_PACKS * self.size                 # p blocks of whole cache lines fit a half
        self.half = -(-int(max_bytes) // line) * line
        self.peers = PeerMemory(mpi_comm, 2 * self.half)
        self.stream_barriers = StreamBarriers(self.peers)
        self.copy_streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(max(self.size - 1, 0))]
        self.calls = 0

    # ---- the algorithm, on CuPy arrays and raw pointers ---------------------------------------------------
    def allreduce_(self, x, type_name: str) -> None:
        """In place: ``x`` (a contiguous CuPy array) becomes the sum over ranks. Queued on the current
        stream; ``type_name`` is the element type of the kernels (``float``, ``bf16_bits``, ...)."""
        import cupy

        p, r, nbytes = self.size, self.rank, x.nbytes
        if nbytes > self.half:
            raise ValueError(f"{nbytes} bytes do not fit the copy-engine all-reduce's {self.half}-byte buffers")
        if nbytes == 0 or p == 1:
            return
        stream = cupy.cuda.get_current_stream()
        offset = (self.calls % 2) * self.half               # this call's half of every shared buffer
        self.calls += 1
        packs = -(-nbytes // PACK)
        block_packs = -(-packs // (p * LINE_PACKS)) * LINE_PACKS
        block = block_packs * PACK                           # bytes per block (the last may be shorter)

        def span(q):                                         # block q's bytes: [start, end) within x
            return min(q * block, nbytes), min((q + 1) * block, nbytes)

        capturing = is_capturing(stream.ptr)                                   # (see the module docstring)

        def slot(q, of):                                     # rank `of`'s slot q in this call's half
            return self._pointer(of, offset) + q * block

        self._copy_each(stream, lambda q: (slot(r, of=q), x.data.ptr + span(q)[0], span(q)[1] - span(q)[0]))
        self._barrier(stream, 0, capturing)                                   # every block has arrived
        mine_packs = -(-(span(r)[1] - span(r)[0]) // PACK)
        if mine_packs:
            blocks = max(1, min(self.peers.max_blocks, -(-mine_packs // 512)))
            my_half = self.peers.peer_buffer(r, p * block, "uint8", offset)
            kernel(f"sum_slots<{type_name}>")((blocks,), (512,), (
                my_half, np.int64(block_packs), np.int32(r), np.int32(p), np.int64(mine_packs)))
        self._barrier(stream, 1, capturing)                                   # every block is summed
        self._copy_each(stream, lambda q: (x.data.ptr + span(q)[0], slot(q, of=q), span(q)[1] - span(q)[0]))
        self._barrier(stream, 2, capturing)                                   # everyone has read my half

    def _barrier(self, stream, role: int, capturing: bool) -> None:
        """The call's barrier number ``role`` (0-2): counted eagerly, replayable in a CUDA graph."""
        if capturing:
            self.stream_barriers.queue_replayable(stream, role)
        else:
            self.stream_barriers.queue(stream)

    def _pointer(self, q: int, offset: int) -> int:
        return self.peers.data_pointer(q) + offset

    def _copy_each(self, stream, what) -> None:
        """Copy ``what(q) = (dst, src, nbytes)`` for every rank q, the peers' each on a side stream of its
        own (so that several copy engines work at once), mine on ``stream``; ``stream`` then waits for all."""
        p, r = self.size, self.rank
        forked = stream.record()
        joins = []
        for i, side in enumerate(self.copy_streams):
            q = (r + 1 + i) % p                             # rank r starts at r+1: peers spread the load
            dst, src, nbytes = what(q)
            if nbytes <= 0:
                continue
            side.wait_event(forked)
            self._memcpy(dst, src, nbytes, side)
            joins.append(side.record())
        dst, src, nbytes = what(r)
        if nbytes > 0:
            self._memcpy(dst, src, nbytes, stream)
        for done in joins:
            stream.wait_event(done)

    @staticmethod
    def _memcpy(dst: int, src: int, nbytes: int, stream) -> None:
        import cupy

        cupy.cuda.runtime.memcpyAsync(dst, src, nbytes, MEMCPY_DEVICE_TO_DEVICE, stream.ptr)

    # ---- the Communicator's own collectives ---------------------------------------------------------------
    def plan(self, collective, x, op=None, algorithm="auto"):
        """torch CUDA tensors straight to the copy engines, on torch's current stream."""
        if collective != "allreduce" or op != "sum" or not is_torch(x) or not x.is_cuda:
            return None
        return lambda t, comm: comm._allreduce_tensor(t)   # (holds no communicator)

    def _allreduce_tensor(self, t):
        import torch

        t = t.contiguous() if self.in_place else t.clone()
        raw, element = torch_as_cupy(t)
        with external_stream(torch.cuda.current_stream().cuda_stream):
            self.allreduce_(raw, element)
        return t

    def builtin_allreduce(self, x, op="sum"):
        """The sum over ranks of a CuPy array (float32/float64/int32/int64/float16, or bfloat16 bits)."""
        if getattr(op, "name", op) != "sum":
            raise Unsupported("the copy-engine all-reduce only sums")
        element = "bf16_bits" if getattr(op, "bfloat16", False) else type_name(x.dtype)
        y = x if self.in_place else x.copy()
        self.allreduce_(y, element)
        return y

    def barrier(self) -> None:
        import cupy

        cupy.cuda.Device().synchronize()
        self.mpi.Barrier()

    def allgather_object(self, obj):
        return self.mpi.allgather(obj)

    def close(self) -> None:
        self.peers.close()


class StreamBarriers:
    """A barrier with every peer queued on a stream *without any kernel*: stream memory operations, which
    the GPU's front end executes, not its SMs. Each rank writes the barrier's number into its slot of every
    peer's flags (a 32-bit write after all earlier work of the stream, with a system-wide memory fence
    first), then the stream waits until each peer has written it here (a 32-bit wait, >=): 2(p-1)
    operations queued by one driver call (cuStreamBatchMemOp).
    A GEMM that holds every SM cannot delay it, as it delays a barrier kernel waiting for a free SM.
    Falls back to the one-block flag_barrier kernel where the driver bindings (cuda-python) are missing.

    Replayable barriers (``queue_replayable``), for CUDA graphs: a counted barrier's number is fixed when it
    is queued, so a graph's replay would find it reached already. These write 1, wait for 1, then set their
    own flags back to 0 -- no number to count -- in one of several slots ("roles") that a sequence of
    barriers takes in turn (0, 1, 0, 1, ... or 0, 1, 2, 0, 1, 2, ...: the same pattern in every call, so
    that replays keep the turns). Why the turns: a peer that has passed barrier k may write barrier k+1's
    flag here before this rank has reset barrier k's; in another slot, that write survives. Barrier k's slot
    comes again at k+2 at the soonest, which a peer reaches only after this rank's write of k+1, which comes
    after its reset of k."""

    def __init__(self, peers: PeerMemory):
        from tplab.gpu_collectives.peer_agreement import MAX_RANKS, REPLAY_SLOTS, STREAM_SLOT

        self.peers, self.count = peers, 0

        def addresses(slot):   # my flag at each peer's, and each peer's here
            offset = slot * MAX_RANKS * 4
            return ([f + offset + peers.rank * 4 for f in peers._flags],
                    [peers._flags[peers.rank] + offset + q * 4 for q in range(peers.size)])

        self.remote, self.local = addresses(STREAM_SLOT)
        try:
            from cuda.bindings import driver

            self.driver = driver
        except ImportError:
            self.driver = None
        self.kind = "stream memory operations" if self.driver else "flag_barrier kernel"
        self.operations = self._operations(self.remote, self.local) if self.driver else []
        self.replayable = ([self._operations(*addresses(slot), reset=True) for slot in REPLAY_SLOTS]
                           if self.driver else [])

    def _operations(self, remote, local, reset: bool = False) -> list:
        """The barrier's 2(p-1) operations, made once (queue() only sets their number): my writes to every
        peer, then my waits for every peer's write -- one driver call queues them all, not 2(p-1): the host
        must stay ahead of the GPU, and each call costs it microseconds. ``reset``: the replayable barrier's
        3(p-1): writes of 1, waits for 1, then my flags back to 0."""
        cu, operations = self.driver, []
        peers = [q for q in range(self.peers.size) if q != self.peers.rank]

        def write(address, value):
            op = cu.CUstreamBatchMemOpParams()
            op.writeValue.operation = cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_32
            op.writeValue.address = cu.CUdeviceptr(address)
            op.writeValue.flags = cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT   # (fence first)
            op.writeValue.value = value
            return op

        for q in peers:
            operations.append(write(remote[q], 1))
        for q in peers:
            wait = cu.CUstreamBatchMemOpParams()
            wait.waitValue.operation = cu.CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_32
            wait.waitValue.address = cu.CUdeviceptr(local[q])
            wait.waitValue.flags = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
            wait.waitValue.value = 1
            operations.append(wait)
        if reset:
            operations += [write(local[q], 0) for q in peers]
        return operations

    def queue(self, stream, graph_safe: bool = False) -> None:
        """Queue the barrier on ``stream``; ``graph_safe``: as the flag_barrier kernel (for a CUDA graph)."""
        if self.driver is None or graph_safe:
            with stream:
                self.peers.queue_barrier()
            return
        self.count += 1
        if not self.operations:                                       # (one rank: nobody to meet)
            return
        half = len(self.operations) // 2
        for write, wait in zip(self.operations[:half], self.operations[half:]):
            write.writeValue.value = self.count
            wait.waitValue.value = self.count
        self._batch(stream, self.operations)

    def queue_replayable(self, stream, role: int) -> None:
        """Queue a replayable barrier (class docstring) in slot ``role`` (0, 1 or 2: the caller's sequence of
        barriers takes them in turn); the flag_barrier kernel where the driver bindings are missing."""
        if self.driver is None:
            with stream:
                self.peers.queue_barrier()
        elif self.replayable[role]:
            self._batch(stream, self.replayable[role])

    def _batch(self, stream, operations) -> None:
        _check(self.driver.cuStreamBatchMemOp(self.driver.CUstream(stream.ptr), len(operations), operations, 0))


def _check(result) -> None:
    error = result[0] if isinstance(result, tuple) else result
    if int(error) != 0:
        raise RuntimeError(f"CUDA driver call failed: {error}")
