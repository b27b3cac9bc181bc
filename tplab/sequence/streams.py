"""A second CUDA stream for a scheme's transfers, so that they run while the attention computes.

On a GPU the host only queues work; kernels queued on one stream run one after another. tplab's GPU
transports (tplab.comm.nccl, the peer-memory all-gather) queue their transfers on the caller's *current*
stream, so a transfer called in the middle of the compute waits for the compute queued before it, and
the compute queued after it waits for the transfer: nothing overlaps. Queued on a second stream they
may run at the same time:

    compute stream   [attention on block i ........][wait: arrived] [attention on block i+1 ...]
    side stream       [wait: ready][send block i, receive block i+1] -> record "arrived"

``SideStream`` makes the three links that keep this correct:

    with side.after_compute(kv):     the side stream first waits for the compute queued so far ("kv is
        ...transfers...              ready"), and the transfers queued inside run on the side stream
    arrived = side.record()          an event: everything queued on the side stream so far is done
    side.wait(arrived, incoming)     the compute stream waits for it before it uses ``incoming``

and tells PyTorch's caching allocator about tensors used on both streams (``record_stream``): a tensor
freed by Python while the other stream still uses it must not be handed out again before that stream is
done. Memory that another allocator made (CuPy's pool, which tplab.allgather's NCCL path uses) is not
covered by ``record_stream``; ``fence()`` (the side stream waits for the compute queued so far) orders
any later reuse on the side stream after the compute that read it.

On the CPU there are no streams: every call here does nothing, and the same code runs in program order.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

_streams: dict = {}  # device index -> its side stream (one per device, made once)


class SideStream:
    def __init__(self, device: torch.device):
        self.stream = None
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            if index not in _streams:  # high priority: a transfer's kernels get SMs before the next GEMM's blocks
                _streams[index] = torch.cuda.Stream(device=index, priority=-1)
            self.stream = _streams[index]

    @contextmanager
    def after_compute(self, *reads: torch.Tensor):
        """Queue what runs inside on the side stream, after the compute queued so far; ``reads``: tensors
        made on the compute stream that the side stream reads."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        for t in reads:
            t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            yield

    def record(self):
        """An event for "the side stream's work queued so far is done" (None on the CPU)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event, *results: torch.Tensor) -> None:
        """The compute stream waits for ``event`` (the host does not); ``results``, made on the side
        stream, are now used on the compute stream too."""
        if self.stream is None:
            return
        compute = torch.cuda.current_stream()
        compute.wait_event(event)
        for t in results:
            t.record_stream(compute)

    def fence(self) -> None:
        """The side stream waits for the compute queued so far (see the module's docstring)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
