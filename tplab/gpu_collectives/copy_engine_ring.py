"""The ring's step through the copy engines (``CopyEngineExchange.start_pass``): every rank pulls its left
neighbour's block over NVLink.

Ring attention (tplab.sequence.ring) passes blocks around the ring: at every step each rank sends the block
it holds to the right and receives the next one from the left. Here the block a rank holds lies in its
shared memory (CUDA IPC: an area of three slots, one block each, made by the exchange's first pass), so a
step is one copy per rank, made by a copy engine, with no SM taken from the attention:

    start_pass(block), queued on the ring's own stream (i: the slot that holds my block):
        wait for the caller's stream, as it was    the compute that read slot i+1 is done (it was queued
          at the call of the pass before            before that call: the rule below)
        block -> slot i+1, i = i+1                 only if it is not in slot i already: a ring's first pass (a
                                                   local copy; this one waits for the caller's stream as it is now)
        barrier with every peer                    stream memory operations, no kernel (copy_engine.StreamBarriers)
        my slot i+1 <- the left's slot i           the copy engine pulls over NVLink
    wait():  the caller's stream (not the host) waits for the pull; returns my slot i+1 as a tensor, which
             the next pass forwards from where it lies (i becomes i+1)

Why three slots: with two, a pass would overwrite the block the caller is computing on, so it could start
only when that compute ends, and the ring would move one block at a time with the compute. With three, a pass
overwrites the block received three passes before, and the ring's transfers can run a step ahead: the second block
travels while the layer still computes Q, and a slow step of either kind is absorbed by the next.

Why one barrier per pass is enough (every rank makes the same passes, so i is the same on every rank):
  - the left's slot i holds its block: its pull (or copy) into it was queued before it reached the barrier;
  - my slot i+1 was last read by my right neighbour's pull two passes before, queued before it reached the
    barrier of the pass before this one, and by my own compute, which the ring's stream waited for;
  - a new ring copies my block into slot i+1 the same way, after the caller's whole stream.
So a block that ``wait()`` returned may be rewritten once the pass after next starts on the GPU: use it before
you start the next pass but one -- or, after a ring's last pass, before you start the next ring's second pass
(ring attention folds each block right after it arrives: in time).

Bytes: one block per rank per pass, each GPU sending to one peer and receiving from another at once, which
is what a copy engine does best (about 340 GB/s to one peer on an H100). A ring's first pass also copies my
block into the shared area (a local copy, at memory speed).

Inside a CUDA graph. A counted barrier waits for a number fixed when it is queued, so a replay would find it
reached already: a captured pass queues a replayable barrier instead (StreamBarriers.queue_replayable: write
1, wait for 1, reset), in slots 1 and 2 taken in turn. And the slots' rotation no longer protects a slot: a
replay writes the slots the capture chose, whatever ran since, so a neighbour may still be pulling from the
slot a replay's first copy overwrites (the last pull of the replay before, which no barrier follows). So once
a ring has been captured (``graphed``), every new ring first meets its peers, on the ring's stream, before
it copies its block in (in slot 0 inside a capture; eagerly a counted barrier): every peer's stream has then
finished its earlier pulls. With slot 0 for the meeting and 1, 2 in turn for the passes, no two barriers in
a row share a slot, across replays too (what makes a replayable barrier safe: copy_engine.StreamBarriers).
The ring's first pass runs eagerly (it makes the area, which a capture cannot), and a ring lies wholly inside
one capture or wholly outside any: the exchange refuses a pass that forwards a block across a capture's edge
(captures told apart by the driver's capture id). A pass left open by a capture that failed (it never ran) is
dropped by the next pass. Replay a graph only with no pass open, on the stream of the eager calls around it,
and once every rank has captured it: a capture that failed on one rank leaves its peers' graphs waiting at
their first meeting (agree on it first, as scripts/gpu_sequence_parallel.py does).
"""

from __future__ import annotations

from tplab.gpu_collectives.copy_engine import StreamBarriers
from tplab.gpu_collectives.copy_engine_calls import _copy, _cupy_stream
from tplab.gpu_collectives.peer_memory import PeerMemory

SLOTS = 3  # blocks in the ring's area (the module docstring says why three)
UNKNOWN_CAPTURE = -1   # a capture whose id the driver bindings (cuda-python) could not tell


def capture_of(stream: int):
    """The id of the CUDA graph capture that ``stream`` (a pointer) is in, None if it is not capturing:
    what tells two captures apart (the driver's cuStreamGetCaptureInfo; UNKNOWN_CAPTURE without cuda-python)."""
    import torch

    if not torch.cuda.is_current_stream_capturing():
        return None
    try:
        from cuda.bindings import driver

        found = driver.cuStreamGetCaptureInfo(driver.CUstream(stream))
        return int(found[2]) if int(found[0]) == 0 else UNKNOWN_CAPTURE   # (error, status, id, ...)
    except Exception:  # noqa: BLE001 - bindings missing or of another shape: captures not told apart
        return UNKNOWN_CAPTURE


class CopyEngineRing:
    """The shared area, barriers and stream of an exchange's ring passes (made by its first pass:
    collective)."""

    def __init__(self, exchange):
        import cupy
        import torch

        self.exchange, self.rank, self.size, self.slot = exchange, exchange.rank, exchange.size, exchange.slot
        torch.cuda.empty_cache()   # (torch's cached blocks back to the GPU: the area is a plain cudaMalloc)
        with cupy.cuda.Device(exchange.device):
            self.memory = PeerMemory(exchange.mpi, SLOTS * self.slot)
        self.barriers = StreamBarriers(self.memory)
        with torch.cuda.device(exchange.device):
            self.stream = torch.cuda.Stream()
        self.held = 0            # the slot that holds the block my next pass sends on
        self._called = None      # the caller's stream at the last pass's call (an event)
        self._sent = None        # the last pass's block: (shape, dtype)
        self.graphed = False     # a pass was captured: from then on every new ring meets first (docstring)
        self.capture = None      # the capture the last pass was in (capture_of), None if eager
        self._role = 0           # the replayable barrier slot of the last captured barrier
        self._views = {}         # tensors over my slots, by (slot, shape, dtype)

    def _pointer(self, rank: int, slot: int) -> int:
        return self.memory.data_pointer(rank) + slot * self.slot

    def forwards(self, block) -> bool:
        """Whether ``block`` is the one the last pass returned (my slot that it filled, as that shape and dtype)."""
        return (self._sent is not None and block.data_ptr() == self._pointer(self.rank, self.held)
                and (tuple(block.shape), block.dtype) == self._sent)

    def start_pass(self, block, caller, forwards: bool, capture=None) -> "CopyEnginePass":
        """``forwards``: ``block`` is the one the last pass returned (``forwards()``, as the exchange found);
        ``capture``: the capture this pass is in (capture_of), None eagerly."""
        import torch

        captured = capture is not None
        block = block.contiguous()                                   # (on the caller's stream, before the waits)
        nbytes = block.numel() * block.element_size()
        called = torch.cuda.Event()
        called.record(caller)
        self.graphed = self.graphed or captured
        if not forwards:                                             # a new ring: my block into the next slot
            self.stream.wait_event(called)
            if self.graphed and self.size > 1:                       # every peer is done pulling from my slots
                self._barrier(captured, meeting=True)
            self.held = (self.held + 1) % SLOTS
            _copy(self._pointer(self.rank, self.held), block.data_ptr(), nbytes, self.stream, self.exchange.piece)
            block.record_stream(self.stream)                         # (the allocator: still being read)
        elif self._called is not None:
            self.stream.wait_event(self._called)                     # the compute on the slot I now overwrite
        self._called, self.capture = called, capture
        self._barrier(captured)
        left, target = (self.rank - 1) % self.size, (self.held + 1) % SLOTS
        _copy(self._pointer(self.rank, target), self._pointer(left, self.held), nbytes, self.stream,
              self.exchange.piece)
        self.held, self._sent = target, (tuple(block.shape), block.dtype)
        return CopyEnginePass(self.exchange, caller, self.stream.record_event(),
                              self._view(target, tuple(block.shape), block.dtype), capture)

    def _barrier(self, captured: bool, meeting: bool = False) -> None:
        """A barrier with every peer on the ring's stream: the flag_barrier kernel (the exchange's
        ``barrier_kernels``: its counts live in GPU memory, so it replays as it is); inside a capture a
        replayable one, slot 0 for a meeting and 1, 2 in turn for the passes; else a counted one."""
        stream = _cupy_stream(self.stream)
        if self.exchange.barrier_kernels:
            self.barriers.queue(stream, True)
        elif captured:
            self._role = 0 if meeting else 2 if self._role == 1 else 1
            self.barriers.queue_replayable(stream, self._role)
        else:
            self.barriers.queue(stream)

    def _view(self, slot: int, shape, dtype):
        """My slot as a tensor of ``shape`` and ``dtype`` (no copy), made once: a tensor over foreign memory
        costs the host tens of microseconds, and the host must stay ahead of the GPU."""
        import torch

        key = (slot, shape, dtype)
        if key not in self._views:
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            raw = self.memory.peer_buffer(self.rank, nbytes, "uint8", slot * self.slot)
            with torch.inference_mode(False):   # (a view made under inference_mode could not be written outside it)
                self._views[key] = torch.as_tensor(raw, device=f"cuda:{self.exchange.device}").view(dtype).view(shape)
        return self._views[key]

    def close(self) -> None:
        self._views.clear()
        self.memory.close()


class CopyEnginePass:
    def __init__(self, exchange, caller, landed, block, capture=None):
        self._exchange, self._caller, self._landed, self._block = exchange, caller, landed, block
        self.capture = capture   # (its events exist inside that capture only)

    def wait(self):
        """The block from the left, once the caller's stream has waited for its pull (the host does not)."""
        self._caller.wait_event(self._landed)
        if self._exchange._open.get("pass") is self:
            del self._exchange._open["pass"]
        return self._block
