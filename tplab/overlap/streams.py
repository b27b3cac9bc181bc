"""Nonblocking collectives on a GPU: a side CUDA stream instead of a progress thread.

On a GPU the host only *queues* work; kernels queued on one stream run one after another, kernels on
different streams may run at the same time. So a collective overlaps a GEMM when the two are queued on
different streams:

    compute stream   [GEMM chunk 0][GEMM chunk 1][GEMM chunk 2] ...            wait_event(done 0) -> use
    comm stream          wait_event(ready 0) [all-reduce chunk 0] -> record(done 0)

``start_on_side_stream`` does exactly that: it records an event on the caller's stream ("the input is
ready"), makes the side stream wait for it, queues the collective there (tplab's algorithm on a
GPU communicator: NCCL, peer memory, torch.distributed...), and records "done". ``wait()`` makes the *caller's stream* wait for
"done" -- the host does not block. Memory: the input is read on the side stream and the result made
there, so both are marked as used by the other stream (``record_stream``), or PyTorch's caching
allocator could hand their memory out again too early.

On one stream nothing overlaps (every kernel waits for the one before). Even on two, the hardware may
serialise them: ``CUDA_DEVICE_MAX_CONNECTIONS`` sets how many hardware queues the streams share (default
8); with 1, kernels start in the order the host queued them, which lets a communication kernel queued
before the next GEMM get its SMs first (Megatron-LM sets it to 1 for its overlapped TP). See
scripts/gpu_overlap.py, which measures both.
"""

from __future__ import annotations

from contextlib import nullcontext

from tplab.overlap import trace
from tplab.overlap.handles import Handle

_NOTHING = nullcontext()

_side_streams: dict = {}  # device index -> the communication stream


def side_stream(device=None):
    import torch

    device = torch.cuda.current_device() if device is None else device
    if device not in _side_streams:
        # High priority: when an SM frees up, the block scheduler starts this stream's blocks (a reduction,
        # a barrier kernel) before the next blocks of the GEMMs on the default-priority compute stream.
        _side_streams[device] = torch.cuda.Stream(device=device, priority=-1)
    return _side_streams[device]


class StreamHandle(Handle):
    """A collective queued on a side stream. ``test()``: has the GPU finished it? ``wait()``: the caller's
    current stream waits for it (no host blocking); returns the result tensor."""

    def __init__(self, what, result, done_event):
        super().__init__(what)
        self._finish(result)  # (the host-side part is done; the GPU's part is tracked by the event)
        self._event = done_event

    def test(self) -> bool:
        return self._event.query()

    def wait(self, timeout=None):
        import torch

        stream = torch.cuda.current_stream()
        stream.wait_event(self._event)
        if self._result is not None and hasattr(self._result, "record_stream"):
            self._result.record_stream(stream)  # made on the side stream, used on this one
        return self._result


def start_on_side_stream(name, x, comm, algorithm="auto", check=False) -> StreamHandle:
    import torch

    import tplab

    caller = torch.cuda.current_stream()
    side = side_stream(x.device.index)
    ready = torch.cuda.Event()
    ready.record(caller)
    side.wait_event(ready)
    x.record_stream(side)  # read there; its memory must not be reused before the side stream is done
    what = f"{name} {algorithm} {x.numel() * x.element_size()} B"
    tracer = trace.current()
    with torch.cuda.stream(side), (tracer.span(what, "comm", "comm stream", stream=side) if tracer else _NOTHING):
        result = getattr(tplab, name)(x, comm, algorithm=algorithm, check=check)
    done = torch.cuda.Event()
    done.record(side)
    return StreamHandle(what, result, done)
