"""Where a rank's work runs: host memory, or the GPU this process is bound to.

One MPI rank per GPU. Each rank takes the GPU whose index is its rank among the ranks of its own node
(``MPI_COMM_TYPE_SHARED``), so 8 ranks on 2 nodes of 4 GPUs take GPUs 0-3 on each node. The binding is
made once per process and sets the current device of CuPy and of torch.

    bind_local_gpu()        {"rank", "local_rank", "local_size", "device", "name", "memory_gib", "host"};
                            device None on a machine without GPUs (no error)
    gpu_count()             CUDA GPUs this process sees (0 without a driver, a GPU, CuPy or torch)
    to_device(x, "gpu")     a numpy array as a CuPy array on the bound GPU ("cpu": x itself)
    to_host(x)              CuPy array / torch tensor / numpy array -> numpy array

Device names: "cpu", or "gpu" (also "cuda", torch's word). The module is light on purpose: no ipyparallel,
and CuPy or torch only once a GPU is asked for, since scripts under mpiexec import it through tplab.comm.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import socket
import sys

_bound: dict | None = None  # this process's binding, made once (bind_local_gpu)


def is_gpu(device) -> bool:
    """True for "gpu" / "cuda" / "cuda:N", False for "cpu" or None; a clear error for anything else."""
    name = str("cpu" if device is None else device).lower()
    if name == "cpu":
        return False
    if name in ("gpu", "cuda") or name.startswith("cuda:"):
        return True
    raise ValueError(f"device must be 'cpu' or 'gpu' (or 'cuda'), not {device!r}")


def torch_device(device) -> str:
    """torch's name for a device: "cuda" (the current, i.e. bound, GPU) or "cpu"."""
    return "cuda" if is_gpu(device) else "cpu"


# ---- what this process sees --------------------------------------------------------------------------------
def _nvidia_device_nodes() -> bool:
    """An NVIDIA driver's device files (Linux; /dev/dxg under WSL): cheap, and no import needed."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/dxg")


def _has(module: str) -> bool:
    return module in sys.modules or importlib.util.find_spec(module) is not None


def gpu_count() -> int:
    """CUDA GPUs this process sees (CUDA_VISIBLE_DEVICES honoured): CuPy's count if CuPy is installed, else
    torch's. Without an NVIDIA device file torch is not even imported, so a CPU machine pays nothing."""
    if _has("cupy"):
        try:
            import cupy

            return int(cupy.cuda.runtime.getDeviceCount())
        except Exception:  # noqa: BLE001 - no driver, no device, a CuPy for another CUDA: no GPU here
            return 0
    if "torch" in sys.modules or (_nvidia_device_nodes() and _has("torch")):
        try:
            import torch

            return int(torch.cuda.device_count())
        except Exception:  # noqa: BLE001
            return 0
    return 0


def local_rank(mpi_comm=None) -> tuple[int, int]:
    """(this rank's rank among the ranks on its node, how many ranks its node has). Collective."""
    from mpi4py import MPI

    mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, key=mpi_comm.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def gpu_probe() -> dict:
    """What one engine has, for ``Cluster.resolve_device``: GPUs seen, whether CuPy (the GPU transports
    need it) is installed, and how many ranks share its node. Collective (the node split)."""
    _, local_size = local_rank()
    return {"gpus": gpu_count(), "cupy": _has("cupy"), "local_size": local_size}


# ---- binding --------------------------------------------------------------------------------------------------
def use_gpu(index: int, *, import_torch: bool = True) -> None:
    """Make GPU ``index`` the current device of this thread for CuPy and torch (each where installed;
    torch only if already imported unless ``import_torch``)."""
    if _has("cupy"):
        import cupy

        cupy.cuda.Device(index).use()
    if "torch" in sys.modules or (import_torch and _has("torch")):
        import torch

        torch.cuda.set_device(index)


def _gpu_name(index: int) -> tuple[str, float]:
    """(name, memory in GiB) of GPU ``index``; ("?", nan) where no library can say."""
    try:
        if _has("cupy"):
            import cupy

            props = cupy.cuda.runtime.getDeviceProperties(index)
            name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
            return name, props["totalGlobalMem"] / 2**30
        import torch

        props = torch.cuda.get_device_properties(index)
        return props.name, props.total_memory / 2**30
    except Exception:  # noqa: BLE001 - only a label
        return "?", float("nan")


def bind_local_gpu(mpi_comm=None, *, import_torch: bool = True) -> dict:
    """Bind this process to GPU <node-local rank> and say what it got:

        {"rank", "local_rank", "local_size", "device", "name", "memory_gib", "host"}

    ``device`` (and ``name``) are None on a machine without GPUs: no error, nothing bound. A node with
    more ranks than GPUs raises RuntimeError (one rank per GPU: NCCL refuses two ranks on one GPU).
    Collective on ``mpi_comm`` (default COMM_WORLD) the first time; later calls return the first answer
    without binding again (``use_bound_gpu`` re-selects the device for the calling thread)."""
    global _bound
    if _bound is not None:
        return dict(_bound)
    from mpi4py import MPI

    mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
    local, local_size = local_rank(mpi_comm)
    gpus = gpu_count()
    info = {"rank": mpi_comm.Get_rank(), "local_rank": local, "local_size": local_size, "device": None,
            "name": None, "memory_gib": None, "host": socket.gethostname()}
    if gpus:
        if local_size > gpus:
            raise RuntimeError(f"{local_size} ranks on this node but {gpus} visible GPU(s): start one rank per "
                               "GPU (NCCL refuses two ranks on one GPU)")
        use_gpu(local, import_torch=import_torch)
        info["device"] = local
        info["name"], info["memory_gib"] = _gpu_name(local)
    _bound = info
    return dict(info)


def bound_gpu() -> int | None:
    """The GPU this process was bound to (None: not bound, or no GPU)."""
    return None if _bound is None else _bound["device"]


def use_bound_gpu() -> int | None:
    """Bind if not yet (collective then), and make the bound GPU current for the calling thread (CUDA's
    current device is per thread). Returns it (None without GPUs)."""
    device = bind_local_gpu()["device"]
    if device is not None:
        use_gpu(device)
    return device


# ---- arrays for a device ----------------------------------------------------------------------------
def to_device(x, device="cpu"):
    """A host array on ``device``: a CuPy array on the current (bound) GPU for "gpu", else ``x`` itself."""
    if not is_gpu(device):
        return x
    import cupy

    return cupy.asarray(x)


def to_host(x):
    """Any array tplab handles as a numpy array: CuPy arrays and torch tensors are copied to the host
    (waiting for the GPU work that produces them); numpy arrays come back as they are."""
    kind = type(x).__module__.split(".")[0]
    if kind == "cupy":
        import cupy

        return cupy.asnumpy(x)
    if kind == "torch":
        return x.detach().cpu().numpy()
    return x
