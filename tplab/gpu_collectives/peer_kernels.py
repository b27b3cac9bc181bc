"""How tplab's peer-memory kernels (kernels/*.cu, KERNEL_FILES) are compiled and launched, and how arrays reach them.

    kernel("two_shot<float>")       the compiled kernel (NVRTC through CuPy, once per process)
    fast_launcher(k, blocks, ...)    a launch with its arguments packed once, straight through the driver
                                     (programmatic dependent launch on Hopper and later)
    whole_packs(a)                   a itself, or a zero-padded copy: the kernels move 16-byte packs only
    torch_as_cupy(t), raw_bytes(t)   torch CUDA tensors seen by CuPy, no copy (bfloat16 as its 16 bits)
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from pathlib import Path

import numpy as np

from tplab.gpu_collectives.programmatic_launch import launch_config, launcher, works_here

PACK = 16                   # bytes per vector load/store
LINE_PACKS = 8              # chunks are whole 128-byte cache lines

# numpy's name of an element type -> the kernels' (16-bit floats travel as their bits, summed in float32)
KERNEL_TYPES = {"float32": "float", "float64": "double", "int32": "int", "int64": "long long",
                "bfloat16": "bf16_bits", "float16": "f16_bits"}
# one_shot_lamport's and two_shot_lamport's: the types whose all-ones 32-bit word is a NaN, which they can swap
# for another NaN (kernels/one_shot_lamport.cu)
LAMPORT_TYPES = ("float", "bf16_bits", "f16_bits")
LAMPORT_KERNELS = ("one_shot_lamport", "two_shot_lamport")


def kernel(name: str):
    """A kernel of kernels/, e.g. ``kernel("two_shot<float>")`` (compiled once, on first use)."""
    return _module().get_function(name)


@lru_cache(maxsize=None)
def _module():
    import cupy

    templates = ("one_shot", "one_shot_ll", "two_shot", "two_shot_pull", "ring", "ring_pull", "sum_slots")
    names = ["flag_barrier", "failure_barrier", "allgather", "alltoall", "agree_only", "pdl_probe"]
    names += [f"{k}<{t}>" for k in templates for t in KERNEL_TYPES.values()]
    names += [f"{k}<{t}>" for k in LAMPORT_KERNELS for t in LAMPORT_TYPES]
    return cupy.RawModule(code=kernel_source(), options=("-std=c++17",), name_expressions=names)


# The kernels' source, one concept per file, compiled as one translation unit in this order (each file uses
# what the files before it define).
KERNEL_FILES = ("memory_model.cuh", "agreement.cuh", "one_shot.cu", "one_shot_lamport.cu", "two_shot_lamport.cu",
                "two_shot.cu", "ring.cu", "allgather.cu", "copy_engine_sum.cu", "alltoall.cu")


def kernel_source() -> str:
    """The files of kernels/, joined in the order of KERNEL_FILES."""
    folder = Path(__file__).with_name("kernels")
    return "".join((folder / name).read_text() for name in KERNEL_FILES)


def type_name(dtype) -> str:
    """The kernels' element type for a numpy/CuPy dtype; a clear error for the others."""
    name = "bfloat16" if str(dtype) in ("bfloat16", "|V2") else np.dtype(dtype).name
    if name not in KERNEL_TYPES:
        raise TypeError(f"peer all-reduce sums {sorted(KERNEL_TYPES)}, not {dtype}")
    return KERNEL_TYPES[name]


TORCH_TYPES = {"bfloat16": "bf16_bits", "float16": "f16_bits", "float32": "float", "float64": "double",
               "int32": "int", "int64": "long long"}


def torch_as_cupy(t):
    """A contiguous torch CUDA tensor as a flat CuPy array over the same memory (bfloat16 as int16, so
    that it needs no CuPy support), and the element type of the kernels."""
    import cupy

    if not t.is_contiguous() or not t.is_cuda:
        raise ValueError("needs a contiguous CUDA tensor")
    element = TORCH_TYPES.get(str(t.dtype).removeprefix("torch."))
    if element is None:
        raise TypeError(f"peer all-reduce sums {sorted(TORCH_TYPES)}, not {t.dtype}")
    dtype = np.int16 if element == "bf16_bits" else np.dtype(str(t.dtype).removeprefix("torch."))
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), t.numel() * t.element_size(), t, t.device.index)
    return cupy.ndarray((t.numel(),), dtype, cupy.cuda.MemoryPointer(memory, 0)), element


def raw_bytes(t):
    """A contiguous torch CUDA tensor's memory as a CuPy uint8 array (no copy)."""
    import cupy

    nbytes = t.numel() * t.element_size()
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), nbytes, t, t.device.index)
    return cupy.ndarray((nbytes,), cupy.uint8, cupy.cuda.MemoryPointer(memory, 0))


@lru_cache(maxsize=None)
def libcuda():
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    lib.cuLaunchKernel.restype = ctypes.c_int
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    if hasattr(lib, "cuLaunchKernelEx"):                          # (CUDA 12 and later)
        lib.cuLaunchKernelEx.restype = ctypes.c_int
        lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p] * 4
    lib.cuFuncGetAttribute.restype = ctypes.c_int
    lib.cuFuncGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_void_p]
    return lib


def programmatic_launch_works() -> bool:
    """Whether this process's kernels may be launched with programmatic dependent launch on the current GPU
    (programmatic_launch.works_here, asked once): PeerMemory asks when it is made, never during a capture."""
    import cupy

    return works_here(libcuda(), kernel("pdl_probe").kernel.ptr, cupy.cuda.Device().id)


def cupy_launch_kernel():
    """CuPy's compiled binding of cuLaunchKernel (it converts the 11 arguments far faster than ctypes: 3.6
    against 7.8 µs per launch measured on an H100 node), or None. CuPy 13 has it in cupy.cuda.driver,
    CuPy 14 only in cupy_backends."""
    for module in ("cupy.cuda.driver", "cupy_backends.cuda.api.driver"):
        try:
            return importlib.import_module(module).launchKernel
        except (ImportError, AttributeError):
            pass
    return None


def fast_launcher(function, blocks: int, threads: int, args, *, programmatic: bool = False):
    """A launch of ``function`` with ``args`` packed once, straight through the driver -- several
    microseconds less host time per call than CuPy's general launcher, which is most of one_shot's eager
    latency. Where ``programmatic`` (programmatic_launch_works): cuLaunchKernelEx with programmatic
    dependent launch, eagerly and in CUDA graphs alike, so the kernel is scheduled while the one before it
    ends. Else cuLaunchKernel: CuPy's compiled binding, or a ctypes call where it is missing. None where
    neither launch is available.

    Measured on 2x H200 (CUDA 13 driver, CuPy 14.2; one_shot_ll at 1 / 64 KiB): the GPU's time per call
    with the launches queued ahead of it, as in a model whose host runs ahead, 3.45 / 4.9 µs with the
    programmatic launch against 4.2 / 5.6 without; host time per launch 5.0-5.3 µs either way (ctypes
    converts cuLaunchKernelEx's 4 arguments about as fast as CuPy's binding takes cuLaunchKernel's 11; an
    empty kernel costs this host 4.6 µs). On an earlier H100 node the ctypes call cost about a
    microsecond more host time: ``TPLAB_PROGRAMMATIC_LAUNCH=0`` turns the programmatic launch off."""
    import ctypes

    import cupy

    launchKernel = cupy_launch_kernel()
    lib = libcuda()
    if launchKernel is None and lib is None:
        return None
    kinds = {np.int32: ctypes.c_int32, np.int64: ctypes.c_int64, np.uint32: ctypes.c_uint32,
             np.uint64: ctypes.c_uint64}
    values = [ctypes.c_void_p(a.data.ptr) if isinstance(a, cupy.ndarray) else kinds[type(a)](int(a)) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    handle, get_stream = function.kernel.ptr, cupy.cuda.get_current_stream
    params_address = ctypes.addressof(params)

    def launch_by_ctypes(handle, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared, stream, params, extra):
        error = lib.cuLaunchKernel(handle, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared, stream,
                                   params, None)
        if error:
            raise RuntimeError(f"cuLaunchKernel failed with CUDA error {error}")
    driver_launch = launchKernel or launch_by_ctypes

    def launch(source=None, target=None, stream=None):
        """Launch; ``source`` / ``target``: other device pointers for the first two arguments (a plan's
        per-call input and output), ``stream``: a stream pointer (default: CuPy's current stream)."""
        if source is not None:
            values[0].value, values[1].value = source, target
        driver_launch(handle, blocks, 1, 1, threads, 1, 1, 0, get_stream().ptr if stream is None else stream,
                      params_address, 0)  # (raises on error)

    if programmatic and lib is not None:
        config = launch_config(blocks, threads)
        launch_on = launcher(lib, config, handle, params_address)

        def launch(source=None, target=None, stream=None):  # (the same, its start overlapping the last kernel's end)
            if source is not None:
                values[0].value, values[1].value = source, target
            launch_on(get_stream().ptr if stream is None else stream)
        launch.keep_alive = (values, params, args, config)
        return launch

    launch.keep_alive = (values, params, args)   # the packed arguments must outlive the launcher
    return launch


def whole_packs(a):
    """``a`` itself when it is 16-byte aligned and a whole number of 16-byte packs; else a zero-padded copy
    (the kernels move whole packs only)."""
    import cupy

    if a.nbytes % PACK == 0 and a.data.ptr % PACK == 0:
        return a
    padded = cupy.zeros(-(-a.nbytes // PACK) * PACK, dtype=cupy.uint8)
    padded[: a.nbytes] = a.ravel().view(cupy.uint8)
    return padded
