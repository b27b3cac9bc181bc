"""CopyEngineExchange: token shards moved between the GPUs of one node by the copy engines, for the GEMMs
that consume and produce them (tplab.comm.shard_exchange describes the contract, tplab.overlap.async_tp
uses it).

Why copy engines: NCCL's collectives and tplab's peer kernels move data with SMs, and every SM they hold is
one a GEMM waits for. Copy engines (DMA units) move bytes over NVLink with no SM at all, so a GEMM next to
them keeps the whole GPU; what they share is memory bandwidth, which compute-bound GEMMs leave over.

Each rank's shared memory (CUDA IPC, PeerMemory) holds two areas, each in two halves that alternate
between calls (a call writes a half only when the call before last is over everywhere -- see below):

    gather area, half h:   my shard, published for the peers to pull
    scatter area, half h:  p slots; slot q receives rank q's partial sum of my rows (slot r: my own);
                           made by the first start_scatter (an exchange that only gathers never needs it)

    start_gather(x):   side stream: copy x into my half, barrier with every peer ("all published"),
                       then a side stream pulls the peers' shards into local tensors one after another,
                       r+1 first (the one the caller needs first), one event each.
                       The caller's stream goes on at once with my own shard and waits, shard by shard,
                       only for the event of the shard it needs next. ``start_gather(x, out=all)``: the
                       peers' shards land in all[q] (one contiguous (p, ...) tensor; mine copied to all[r]):
                       an all-gather that no SM moves (tplab.sequence.gather.exchange_allgather_first_dim).
    out_for(q), send(q):  the GEMM writes rank q's partial into a local tensor, then a side stream pushes
                       it into slot r of rank q's half with a copy engine (in the order sent, one at a
                       time). With ``pushes="gemm"`` the GEMM writes it straight into that slot, over
                       NVLink, tile by tile (SMs store it; no copy).
    finish():          the caller's stream waits for my pushes, barrier ("every push has landed
                       everywhere"), then one reduction over my p slots -> my rows of the sum.
    start_pass(block): a ring's step (ring attention): the copy engine pulls my left neighbour's block into
                       a ring area of three slots, made by the first pass (copy_engine_ring.py explains it,
                       and how a ring replays from a CUDA graph).

Why one peer at a time (``peers_at_once=1``): the copy engines of an H100 carry about 340 GB/s to one peer
but only 220-230 GB/s in all when they talk to three at once, so one at a time lands the first shard three
times sooner and the last one sooner too. Every rank starts with its own r+1, so at each step every GPU sends
to one peer and receives from another. ``peers_at_once=k`` runs k such lanes side by side (p-1: every peer at
once, each copy on its own stream).

The barriers are stream memory operations (copy_engine.StreamBarriers): no kernel, no SM, no host wait.
Why halves make one barrier per call enough: a rank overwrites half h of call j only after its barrier of
call j-1, which every peer reaches only after its own stream consumed call j-2 (the pulls it waited for,
or the slots it summed) -- and call j-2 is the one that used half h.

    exchange = CopyEngineExchange(mpi_comm, max_shard_bytes=80 << 20)   # collective; one node
    AsyncTPBlock(block, exchange)(x_shard)                              # tplab.overlap.async_tp

Inside a CUDA graph. A counted barrier waits for a number fixed when it is queued, so a replay would find
its numbers already reached and not wait. Once a call has been captured (``graphed``), every barrier is a
replayable one instead (StreamBarriers.queue_replayable: write 1, wait for 1, reset to 0, in two slots
taken in turn), still without a kernel. The halves' rule breaks too: a graph replayed again and again
repeats its halves, and one with an odd number of calls meets its own last call's half at the start of the
next replay, with no barrier in between. So once graphed, every call also meets its peers *before* it
writes into shared memory: a gather's publisher before it copies my shard in (every peer's stream has then
finished its earlier gathers: it waited for their pulls), a scatter before its first push (every peer has
summed its earlier scatters' slots) -- on the side streams, so the GEMMs go on meanwhile. Each call then
holds two barriers, the first in slot 0 and the second in slot 1: the turns hold across replays. Warm up
eagerly first (the first scatter makes the scatter area, which a capture cannot; compilation and cuBLAS's
set-up neither). ``barrier_kernels=True``: the one-block flag_barrier kernel instead (its counts live in
GPU memory, so it replays as it is; it needs a free SM, which a GEMM holding them all makes it wait for).
``graph_meetings=False``: no meeting first, one barrier per call in the slot of the call's half -- safe only
for graphs that hold an even number of gathers and of scatters (AsyncTPBlock: two of each per block, so any
stack), replayed back to back: then the halves' rule holds across replays as it does between eager calls.

Rules, each checked by every call's agreement (so that a rank that breaks one raises on every rank; a ring
pass that forwards the block the last pass returned agrees only where it finds a problem: start_pass): every
rank captures the same calls; a scatter finished before the next starts; no first scatter, and no first ring
pass, inside a capture; no ring pass that forwards a block across a capture's edge.
A capture's agreement runs when it is captured, not at replays. A call on another stream than the last
one's first waits for that stream (the barriers of two streams must not overtake each other: a counted
barrier waits for ">= its number"), except inside a capture, where the graph's own order holds. Replays are
not calls: replay a graph on the stream the eager calls around it use (or order the streams yourself). After an
error left a call open (``abandon``), the halves' rule no longer holds: the exchange refuses every later
call; make a new one.
"""

from __future__ import annotations

from tplab.comm.shard_agreement import agree_on_shards, digests_agree, out_problem
from tplab.gpu_collectives.copy_engine import StreamBarriers
from tplab.gpu_collectives.copy_engine_calls import CopyEngineGather, CopyEngineScatter, _copy, _cupy_stream
from tplab.gpu_collectives.copy_engine_ring import CopyEngineRing, capture_of
from tplab.gpu_collectives.peer_memory import PeerMemory

ALIGN = 256  # bytes: every slot starts on a boundary that any element type and the copy engines like


class CopyEngineExchange:
    """Shards of up to ``max_shard_bytes`` each, through the copy engines (torch CUDA tensors)."""

    def __init__(self, mpi_comm, max_shard_bytes: int = 64 << 20, *, pushes: str = "copy_engines",
                 barrier_kernels: bool = False, piece_bytes: int = 0, peers_at_once: int = 1,
                 graph_meetings: bool = True):
        import cupy
        import torch

        self.mpi, self.rank, self.size = mpi_comm, mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.slot = -(-int(max_shard_bytes) // ALIGN) * ALIGN
        self.device = cupy.cuda.Device().id
        self.gather_memory = PeerMemory(mpi_comm, 2 * self.slot)                 # halves of one slot
        self.scatter_memory = None     # halves of p slots, p times the gather area: made by the first scatter
        self.ring = None               # a ring's three slots (copy_engine_ring.py): made by the first pass
        # one barrier sequence per area, each in the order of its calls (a barrier waits for ">= its number":
        # numbers of two streams would overtake each other; see _check)
        self.gather_barriers = StreamBarriers(self.gather_memory)
        self.scatter_barriers = None
        if int(peers_at_once) < 1:
            raise ValueError(f"peers_at_once must be >= 1, not {peers_at_once}")
        # one side stream per lane: a lane's copies run one after another, the lanes side by side
        lanes = max(1, min(int(peers_at_once), self.size - 1))
        with torch.cuda.device(self.device):
            self.publisher = torch.cuda.Stream()
            self.pullers = [torch.cuda.Stream() for _ in range(lanes)]
            self.pushers = [torch.cuda.Stream() for _ in range(lanes)]
        self.gathers = self.scatters = 0
        self.barrier_kernels = barrier_kernels   # the one-block flag_barrier kernel instead of stream operations
        if pushes not in ("copy_engines", "gemm"):
            raise ValueError(f"pushes: 'copy_engines' or 'gemm', not {pushes!r}")
        self.pushes = pushes                     # partial sums: pushed by a copy engine, or written by the GEMM
        if int(piece_bytes) < 0:
            raise ValueError(f"piece_bytes must be >= 0 (0: whole copies), not {piece_bytes}")
        self.piece = int(piece_bytes)            # > 0: every copy in pieces of this many bytes (_copy)
        self._open = {}   # the last gather and scatter: the next one may start only once they are over
        self.calls, self._stream = 0, None       # the last call's stream (see _check)
        self.graphed = False                     # a call was captured: from then on every call meets first
        self.graph_meetings = graph_meetings     # False: graphs of even call counts only (module docstring)
        self._capturing = False                  # the last call was captured
        self.broken = ""                         # set by abandon() when a call was left open
        self._pass_capture = None                # the capture a ring pass being made is in (start_pass)
        self._pass_forwards = False              # it forwards the block the last pass returned (start_pass)
        self._views = {}                         # tensors over the scatter slots, by (rank, half, shape, dtype)

    def _peers(self) -> list[int]:
        return [(self.rank + i) % self.size for i in range(1, self.size)]  # r+1 first: peers spread the load

    def _check(self, t, what, problem="", agreed=False):
        """Every rank makes the same call, with a shard that fits, lies on its GPU and has one shape and
        dtype, on a stream it may use, or every rank raises. Returns the call's stream (torch's current).
        ``agreed``: the ranks agree on the call by construction (a ring pass forwarding the block the last
        one returned: start_pass), so the host agreement runs only if this rank finds a problem -- which,
        the same call on every rank, every rank finds."""
        import torch

        stream = torch.cuda.current_stream(self.device)
        capturing = torch.cuda.is_current_stream_capturing()
        problem = problem or self._problem(t, what, capturing)
        self.calls += 1
        what = f"CopyEngineExchange.{what}{' (captured)' if capturing else ''}"   # (capturing alike, or an error)
        if (not agreed or problem) and not digests_agree(self.mpi, what, self.calls, t.shape, t.dtype, problem):
            agree_on_shards(self.mpi.allgather, what, self.calls, t.shape, t.dtype, problem)   # (all take one branch)
        if not capturing and self._stream is not None and stream != self._stream:
            stream.wait_stream(self._stream)     # (this call's barriers after the last call's)
        self._stream = stream
        self.graphed = self.graphed or capturing
        self._capturing = capturing
        return stream

    def _problem(self, t, what: str, capturing: bool) -> str:
        """What is wrong with this rank's call, or "" (see _check)."""
        import torch

        if self.broken:
            return self.broken
        if not t.is_cuda or t.device.index != self.device:
            return f"a tensor on GPU {self.device}, not on {t.device}"
        if torch.cuda.current_device() != self.device:
            return f"torch's current GPU is {torch.cuda.current_device()}, the exchange's {self.device}"
        if t.numel() * t.element_size() > self.slot:
            return (f"a shard of {t.numel() * t.element_size()} bytes does not fit the {self.slot}-byte slots (make "
                    "the exchange with a larger max_shard_bytes)")
        if capturing and what == "start_scatter" and self.scatter_memory is None:
            return ("the first scatter must run eagerly, before any capture: it allocates the shared scatter area, "
                    "which a capture cannot")
        if what == "start_gather" and "gather" in self._open and self._open["gather"].captured != capturing:
            return ("the last gather is still open across a CUDA graph capture's edge (its events belong to one "
                    "side only): call its done() on the side that started it")
        if capturing and what == "start_pass" and self.ring is None:
            return ("the first ring pass must run eagerly, before any capture: it makes the ring's shared area, "
                    "which a capture cannot")
        if what == "start_pass" and self._pass_forwards and self.ring.capture != self._pass_capture:
            return ("a ring lies wholly inside one CUDA graph capture or wholly outside any: this pass forwards the "
                    "last pass's block across a capture's edge (start a new ring on this side)")
        if what == "start_pass" and "pass" in self._open:
            return "the last ring pass has not been waited for (wait() on it first)"
        if what == "start_scatter" and "scatter" in self._open:
            return "the last scatter has not finished (its barrier is what makes the next one's pushes safe)"
        return ""

    @property
    def meets_first(self) -> bool:
        """Graphed, with meetings: every call meets its peers before it writes shared memory (module docstring)."""
        return self.graphed and self.graph_meetings and self.size > 1

    def _closing_barrier(self, barriers, stream, half: int) -> None:
        """A call's own barrier: in slot 1 after a meeting in slot 0, else in the slot of the call's half."""
        self._barrier(barriers, stream, 1 if self.graph_meetings else half)

    def _barrier(self, barriers, stream, role: int) -> None:
        """A barrier with every peer, queued on ``stream``: the flag_barrier kernel (``barrier_kernels``), a
        replayable stream barrier in slot ``role`` once graphed, else a counted one (module docstring)."""
        if self.barrier_kernels:
            barriers.queue(_cupy_stream(stream), True)
        elif self.graphed:
            barriers.queue_replayable(_cupy_stream(stream), role)
        else:
            barriers.queue(_cupy_stream(stream))

    def refuse(self, what: str, problem: str, like=None) -> None:
        """This rank cannot make its next call (``problem``): agree on it, so that every rank raises."""
        import torch

        self._check(torch.empty(0) if like is None else like, what, problem)

    def abandon(self) -> None:
        """After an error mid-block. A call left open (a gather, a scatter without its barrier) breaks the
        halves' rule for the calls after it, so the exchange refuses every later call on every rank (through
        the agreement): make a new one."""
        if self._open:
            self.broken = (f"an error interrupted call {self.calls} ({', '.join(sorted(self._open))} open): this "
                           "exchange cannot go on safely; make a new CopyEngineExchange")
        self._open.clear()

    def start_gather(self, shard, out=None) -> "CopyEngineGather":
        import torch

        caller = self._check(shard, "start_gather", out_problem(shard, out, self.size))
        if "gather" in self._open:                                       # (the halves' rule needs it: this call's
            self._open.pop("gather").done(caller)                        #  stream waits for the last call's pulls)
        shard = shard.contiguous()
        if out is not None:                                              # an all-gather: every shard lands in out
            out[self.rank].copy_(shard)
        nbytes, half = shard.numel() * shard.element_size(), self.gathers % 2
        self.gathers += 1
        self.publisher.wait_stream(caller)                               # the shard has been computed
        if self.meets_first:                                             # every peer is done with its pulls
            self._barrier(self.gather_barriers, self.publisher, 0)
        _copy(self.gather_memory.data_pointer(self.rank) + half * self.slot, shard.data_ptr(), nbytes,
              self.publisher, self.piece)
        shard.record_stream(self.publisher)                              # (the allocator: still being read)
        self._closing_barrier(self.gather_barriers, self.publisher, half)   # all shards published
        published = self.publisher.record_event()
        landed, events = {}, {}
        for i, q in enumerate(self._peers()):                          # r+1 first: the shard needed first
            stream = self.pullers[i % len(self.pullers)]
            if i < len(self.pullers):                                  # (once per lane: its copies run in order)
                stream.wait_event(published)
            landed[q] = torch.empty_like(shard) if out is None else out[q]
            _copy(landed[q].data_ptr(), self.gather_memory.data_pointer(q) + half * self.slot, nbytes, stream,
                  self.piece)
            landed[q].record_stream(stream)
            events[q] = stream.record_event()
        self._open["gather"] = CopyEngineGather(self, caller, shard, landed, events, published, self._capturing)
        return self._open["gather"]

    def start_pass(self, block):
        """A ring's step: my block to my right neighbour, the left's to me (copy_engine_ring.py). A pass that
        forwards the block the last pass returned needs no host agreement: every rank forwards its own, of
        the shape and dtype they agreed on then (the MPI call, which ties the hosts together, cost 0.1-0.15 ms
        a pass on 4x H100 hosts, and ring attention is host-bound there). What this gives up: ranks whose
        programs diverge mid-ring (one forwards the block, another a copy of it) now wait for each other instead
        of raising. A rank whose compute fails mid-ring passes on the blocks it still owes first (ring.py's
        RingAttention._pass_on), so its peers finish."""
        import torch

        self._pass_capture = capture_of(torch.cuda.current_stream(self.device).cuda_stream)   # None eagerly
        stale = self._open.get("pass")
        if stale is not None and stale.capture is not None and stale.capture != self._pass_capture:
            del self._open["pass"]     # (left open by a capture that failed: it never ran; every rank drops it)
        self._pass_forwards = self.ring is not None and self.ring.forwards(block)   # (one test, for all below)
        agreed = self._pass_forwards and "pass" not in self._open and self.ring.capture == self._pass_capture
        caller = self._check(block, "start_pass", agreed=agreed)
        if self.ring is None:          # (collective: every rank has just agreed to this call)
            self.ring = CopyEngineRing(self)
        self._open["pass"] = self.ring.start_pass(block, caller, self._pass_forwards, self._pass_capture)
        return self._open["pass"]

    def start_scatter(self, like) -> "CopyEngineScatter":
        caller = self._check(like, "start_scatter")
        if self.scatter_memory is None:  # (collective: every rank has just agreed to this call; a program that
            import cupy                  #  only gathers -- sequence parallelism -- never holds these p slots)
            import torch

            torch.cuda.empty_cache()     # (torch's cached blocks back to the GPU: the area is a plain cudaMalloc)
            with cupy.cuda.Device(self.device):
                self.scatter_memory = PeerMemory(self.mpi, 2 * self.size * self.slot)
            self.scatter_barriers = StreamBarriers(self.scatter_memory)
        half = self.scatters % 2
        self.scatters += 1
        self._open["scatter"] = CopyEngineScatter(self, caller, half, tuple(like.shape), like.dtype)
        return self._open["scatter"]

    def _slots(self, q: int, half: int, shape, dtype):
        """Rank q's half of p slots (mapped here) as one tensor (p, *shape) over the shared memory (no copy).
        Made once per (q, half, shape, dtype): making a tensor over foreign memory costs the host tens of
        microseconds, and the host must stay ahead of the GPU."""
        import torch

        key = (q, half, tuple(shape), dtype)
        if key not in self._views:
            with torch.inference_mode(False):   # (a view made under inference_mode could not be written outside it)
                self._views[key] = self._make_slots(q, half, shape, dtype)
        return self._views[key]

    def _make_slots(self, q: int, half: int, shape, dtype):
        import cupy
        import torch

        itemsize = torch.empty((), dtype=dtype).element_size()
        count = 1
        for n in shape:
            count *= n
        memory = cupy.cuda.UnownedMemory(self.scatter_memory.data_pointer(q) + half * self.size * self.slot,
                                         self.size * self.slot, self, self.device)
        raw = torch.as_tensor(cupy.ndarray((self.size * self.slot,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0)),
                              device=f"cuda:{self.device}")
        per_slot = raw.view(self.size, self.slot)[:, : count * itemsize]   # each slot's first bytes
        return per_slot.view(dtype).view(self.size, *shape)

    def close(self) -> None:
        """Collective: free the shared memory."""
        self._views.clear()
        self.gather_memory.close()
        for area in (self.scatter_memory, self.ring):
            if area is not None:
                area.close()
