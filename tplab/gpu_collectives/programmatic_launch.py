"""Programmatic dependent launch (Hopper and later): the GPU schedules the next kernel of a stream or a CUDA
graph while the one before it finishes, and the new kernel's first instruction waits until the old one's
writes are visible (kernels/memory_model.cuh's ``after_previous_kernel``). What it saves is the gap between
two launches, a fraction of a microsecond per call (0.7 µs of one_shot_ll's 4.2 at 1 KiB on 2x H200 with the
host ahead); the driver call that asks for it, cuLaunchKernelEx, goes through ctypes.

    if works_here(libcuda, probe, device):       # once per process and GPU (PeerMemory does it)
        config = launch_config(blocks, threads)  # per kernel; set config.stream per launch
        launch(libcuda, config, function, params)

``works_here`` asks for everything the launch needs before anyone relies on it: the environment does not
turn it off (TPLAB_PROGRAMMATIC_LAUNCH=0), a driver of CUDA 12.3 or later (programmatic edges in captured
graphs), a GPU of compute capability 9.0 or later, kernels compiled for it (``probe``'s PTX version: a kernel
compiled for an older architecture would lack the wait and read its inputs too early), a capture of a
memset followed by two such launches that the driver accepts (the graph is never run), and two such launches
made eagerly, on a stream of its own and on the legacy default stream.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache

PROGRAMMATIC_STREAM_SERIALIZATION = 6     # CUlaunchAttributeID in cuda.h
FUNC_ATTRIBUTE_PTX_VERSION = 5            # CUfunction_attribute in cuda.h


class _Attribute(ctypes.Structure):       # CUlaunchAttribute: an id, then a 64-byte union (its first int)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("allowed", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _Config(ctypes.Structure):          # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attributes", ctypes.POINTER(_Attribute)), ("count", ctypes.c_uint)]


def launch_config(blocks: int, threads: int) -> _Config:
    """cuLaunchKernelEx's configuration for ``blocks`` x ``threads`` with the programmatic dependency
    allowed; the caller sets ``.stream`` before each launch."""
    attribute = _Attribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, allowed=1)
    config = _Config(grid=(blocks, 1, 1), block=(threads, 1, 1), shared=0, attributes=ctypes.pointer(attribute),
                     count=1)
    config.keep_alive = attribute
    return config


def launch(lib, config: _Config, function: int, params: int) -> None:
    """cuLaunchKernelEx(config, function, params) on ``config.stream``: ``params`` the address of the kernel's
    argument pointers."""
    launcher(lib, config, function, params)(config.stream)


def launcher(lib, config: _Config, function: int, params: int):
    """``launch`` with its arguments bound once: the returned function(stream) sets ``config.stream`` and
    launches (the addresses are taken here, not per call: this is on every eager call's host path)."""
    config_address, launch_ex = ctypes.addressof(config), lib.cuLaunchKernelEx

    def launch_on(stream: int) -> None:
        config.stream = stream
        error = launch_ex(config_address, function, params, None)
        if error:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUDA error {error}")
    return launch_on


@cache
def works_here(lib, probe: int, device: int) -> bool:
    """Whether kernels launched on GPU ``device`` (the current one) may ask for programmatic dependent launch
    (see the module's docstring); ``lib``: libcuda through ctypes, ``probe``: a kernel (CUfunction) of the
    module that starts with the wait. (``lib``'s argument types are peer_kernels.libcuda's.)"""
    import cupy

    if os.environ.get("TPLAB_PROGRAMMATIC_LAUNCH", "1") == "0" or lib is None or not hasattr(lib, "cuLaunchKernelEx"):
        return False
    if cupy.cuda.runtime.driverGetVersion() < 12030 or int(cupy.cuda.Device().compute_capability) < 90:
        return False
    version = ctypes.c_int(0)
    if lib.cuFuncGetAttribute(ctypes.byref(version), FUNC_ATTRIBUTE_PTX_VERSION, ctypes.c_void_p(probe)) \
            or version.value < 90:
        return False
    stream, scratch = cupy.cuda.Stream(non_blocking=True), cupy.zeros(16, cupy.uint8)
    config, no_arguments = launch_config(1, 32), (ctypes.c_void_p * 1)()
    config.stream = stream.ptr
    try:
        stream.begin_capture()
        try:
            cupy.cuda.runtime.memsetAsync(scratch.data.ptr, 0, 16, stream.ptr)
            for _ in range(2):
                launch(lib, config, probe, ctypes.addressof(no_arguments))
        finally:
            stream.end_capture()
        for eager_stream in (stream.ptr, 0):   # eagerly too, as every launch is (and on the legacy stream)
            config.stream = eager_stream
            launch(lib, config, probe, ctypes.addressof(no_arguments))
        cupy.cuda.runtime.deviceSynchronize()
    except Exception:  # noqa: BLE001 - any refusal means: launch the plain way
        return False
    return True
