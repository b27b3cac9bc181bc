"""Arrays wherever they live: numpy (host memory), CuPy (GPU memory), torch tensors (either).

The collectives are written once, against "an array": slices, ``.size``, ``.dtype``, ``.nbytes``,
``.copy()`` and elementwise ops with ``out=``. numpy and CuPy both offer exactly that, so the same ring
runs on host and GPU memory; only *allocation* must ask the input which module to use:

    xp = array_module(x)          # numpy or cupy
    spare = xp.empty_like(x)      # on the same device as x

torch tensors are converted at the door and back on the way out, without copying: a CPU tensor is a
numpy array (``.numpy()``), a CUDA tensor a CuPy array (DLPack). bfloat16 has no numpy or CuPy dtype:
its bits travel as int16 and ``tplab.toolkit.bfloat16`` does the arithmetic (float32 inside, rounded back).

Streams: GPU work runs on the caller's current stream (torch's current stream for torch tensors), so a
result is ordered before whatever the caller enqueues next, as with NCCL called on that stream. Inside a
CUDA graph capture of torch's, what CuPy allocates for a torch input comes from torch's allocator (the
graph's own pool), so the calls replay.

CuPy and torch are imported only when an array of theirs shows up: the CPU path stays as it was.
"""

from __future__ import annotations

import contextlib
import sys

import numpy as np

_NO_SCOPE = contextlib.nullcontext()
_external_streams: dict = {}  # (device, stream pointer) -> a CuPy stream over it (external_stream), made once


def is_gpu_array(x) -> bool:
    """A CuPy array (without importing CuPy)."""
    return type(x).__module__.split(".")[0] == "cupy"


def is_torch(x) -> bool:
    kind = type(x)
    known = _IS_TORCH.get(kind)  # (asked on every collective call: a string split per call is measurable)
    if known is None:
        known = _IS_TORCH[kind] = kind.__module__.split(".")[0] == "torch"
    return known


_IS_TORCH: dict = {}


def array_module(x):
    """numpy or cupy: the module whose ``empty``/``zeros``/ufuncs make arrays where ``x`` lives."""
    if type(x) is np.ndarray:  # the common case first, at no cost
        return np
    if is_gpu_array(x):
        import cupy

        return cupy
    return np


def as_array(x):
    """(array, back, bfloat16) for any input: ``array`` a numpy or CuPy view of x (no copy where the
    memory allows), ``back(result)`` turns a result of the same kind into the caller's type, and
    ``bfloat16`` says the array holds bfloat16 bits as int16."""
    if type(x) is np.ndarray:
        return x, _same, False
    if is_torch(x):
        return _from_torch(x)
    if is_gpu_array(x):
        return x, _same, False
    return np.asarray(x), _same, False


def _same(a):
    return a


def _from_torch(x):
    import torch

    t = x.detach()
    if t.device.type == "cpu":
        if t.dtype == torch.bfloat16:
            raise TypeError("bfloat16 has no numpy dtype: convert to float32 for the CPU transport")
        return t.contiguous().numpy(), torch.from_numpy, False
    if t.device.type != "cuda":
        raise TypeError(f"tplab works on CPU and CUDA tensors; got one on {t.device}")
    import cupy

    t = t.contiguous()
    bf16 = t.dtype == torch.bfloat16   # no bf16 in CuPy: the same 16 bits as int16, viewed back at the end
    view = t.view(torch.int16) if bf16 else t
    if torch.cuda.is_current_stream_capturing():   # (DLPack's handshake would make CuPy's stream -- the legacy
        with torch_stream(t.device):                #  one -- wait on the capturing stream, which a capture refuses)
            arr = cupy.from_dlpack(view)
    else:
        arr = cupy.from_dlpack(view)
    return (arr, _torch_bfloat16, True) if bf16 else (arr, torch.from_dlpack, False)


def _torch_bfloat16(a):
    import torch

    return torch.from_dlpack(a).view(torch.bfloat16)


def gpu_scope(x, arr):
    """Where GPU work for input ``x`` (converted to ``arr``) must run: ``arr``'s device, and for a torch
    tensor torch's current stream (so the result is ordered like the caller's own kernels). A shared
    no-op context for host arrays."""
    if type(arr) is np.ndarray or not is_gpu_array(arr):
        return _NO_SCOPE
    import cupy

    scope = contextlib.ExitStack()
    device = arr.device.id
    if device != cupy.cuda.runtime.getDevice():
        scope.enter_context(cupy.cuda.Device(device))
    if is_torch(x):
        stream = torch_stream(x.device)
        if stream.ptr != cupy.cuda.get_current_stream().ptr:
            scope.enter_context(stream)
        if _capturing():   # what CuPy allocates comes from torch's graph pool (see _torch_allocator)
            scope.enter_context(cupy.cuda.using_allocator(_torch_allocator()))
    return scope


def _capturing() -> bool:
    import torch

    return torch.cuda.is_current_stream_capturing()


_allocator = None


def _torch_allocator():
    """CuPy's allocations through torch's caching allocator, on torch's current stream: inside a CUDA graph
    capture they come from the graph's private pool, which keeps them for the graph's replays. (CuPy's own
    pool would call cudaMalloc, which a capture refuses, or hand a block that the graph still writes at every
    replay to the next caller once the array is freed.)"""
    global _allocator
    if _allocator is None:
        import cupy
        import torch

        alloc, delete, current_stream = (torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete,
                                         torch.cuda.current_stream)

        def malloc(size: int, device: int) -> int:
            return alloc(size, device, current_stream(device))

        def free(pointer: int, device: int) -> None:
            # (bound above: an array that outlives a test session is freed while the interpreter tears down
            # torch's modules, whose attributes are None by then -- "Exception ignored" noise on every rank)
            if not sys.is_finalizing():
                delete(pointer)

        _allocator = cupy.cuda.memory.PythonFunctionAllocator(malloc, free).malloc
    return _allocator


class _RawStream:
    """A raw cudaStream_t in the CUDA stream protocol (what cupy.cuda.Stream.from_external takes)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


def external_stream(ptr: int, device_id: int = -1):
    """A CUDA stream made elsewhere (torch's), as a CuPy stream object to run CuPy's work on:
    Stream.from_external where CuPy has it (CuPy 14 deprecates ExternalStream), ExternalStream before."""
    import cupy

    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:
        return cupy.cuda.ExternalStream(ptr, device_id)
    stream = from_external(_RawStream(ptr))
    if device_id >= 0:   # (from_external cannot know it: then entering the stream on another GPU raises at once)
        stream.device_id = device_id
    return stream


def torch_stream(device):
    """torch's current stream on ``device`` as a CuPy stream object (made once per stream)."""
    import torch

    ptr = torch.cuda.current_stream(device).cuda_stream
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _external_streams.get((index, ptr))
    if stream is None:
        import cupy

        stream = cupy.cuda.Stream.null if ptr == 0 else external_stream(ptr, index)
        _external_streams[(index, ptr)] = stream
    return stream


def torch_stream_pointer(device_index) -> int:
    """torch's current CUDA stream on a device, as the raw pointer (cheaper than building a Stream object:
    this is on every fast-path collective call)."""
    global _raw_stream
    if _raw_stream is None:
        import torch

        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
            lambda index: torch.cuda.current_stream(index).cuda_stream)  # (a torch without the private accessor)
    return _raw_stream(device_index)


_raw_stream = None


def current_stream(buf):
    """The stream GPU work on ``buf`` belongs to: torch's current stream for a torch tensor, CuPy's
    current stream otherwise."""
    if is_torch(buf):
        return torch_stream(buf.device)
    import cupy

    return cupy.cuda.get_current_stream()


def device_buffer(buf) -> tuple[int, int]:
    """(device pointer, bytes) of a contiguous CuPy array or CUDA tensor; a clear error for anything
    else (a transport for GPU memory was handed host memory, or a strided view)."""
    if is_gpu_array(buf):
        if not buf.flags.c_contiguous:
            raise ValueError("GPU messages must be contiguous (got a strided CuPy view)")
        return buf.data.ptr, buf.nbytes
    if is_torch(buf) and buf.device.type == "cuda":
        if not buf.is_contiguous():
            raise ValueError("GPU messages must be contiguous (got a strided torch view)")
        return buf.data_ptr(), buf.numel() * buf.element_size()
    raise TypeError(f"this transport moves GPU memory (CuPy arrays, CUDA tensors); got {type(buf).__name__}"
                    + (f" on {buf.device}" if is_torch(buf) else ""))
