"""tplab.comm — the wire. ``world()`` is the usual entry point; ``MPIComm(c)`` wraps any mpi4py communicator;
``EmulatedNetwork(comm, ranks_per_node)`` makes messages between emulated nodes pay a network's price.
GPU memory: ``nccl_world()`` (NCCL, one rank per GPU) and ``StagedComm`` (MPI through host buffers); both
import CuPy only when used."""

from tplab.comm.devices import bind_local_gpu, is_gpu, use_bound_gpu
from tplab.comm.base import Communicator, CommTimeoutError, Request
from tplab.comm.emulated import EmulatedNetwork
from tplab.comm.mpi import MPIComm
from tplab.comm.nccl import NcclComm, nccl_world
from tplab.comm.staged import StagedComm

_world = None


def world(timeout: float | None = None) -> MPIComm:
    """A Communicator over ``MPI.COMM_WORLD`` (the same object on every call unless a timeout is asked for,
    which gives a fresh one on a duplicate of COMM_WORLD)."""
    global _world
    if timeout is not None:
        return MPIComm(None, timeout=None).with_timeout(timeout)
    if _world is None:
        _world = MPIComm()
    return _world


def communicator(device="cpu"):
    """The Communicator for ``device``: ``tplab.comm.world()`` (host MPI) for "cpu"; for "gpu" the bound GPU
    and ``tplab.comm.nccl_world()`` (NCCL point-to-point, CuPy arrays / CUDA tensors). Collective the
    first time on each rank."""
    if not is_gpu(device):
        return world()
    if use_bound_gpu() is None:
        raise RuntimeError(f"rank {bind_local_gpu()['rank']}: device 'gpu' asked for, but this process sees no GPU")
    return nccl_world()


__all__ = ["Communicator", "CommTimeoutError", "EmulatedNetwork", "MPIComm", "NcclComm", "Request", "StagedComm",
           "communicator", "nccl_world", "world"]
