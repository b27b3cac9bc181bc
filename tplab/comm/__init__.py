"""tplab.comm — the wire. ``world()`` is the usual entry point; ``MPIComm(c)`` wraps any mpi4py communicator;
``EmulatedNetwork(comm, ranks_per_node)`` makes messages between emulated nodes pay a network's price."""

from tplab.comm.base import Communicator, CommTimeoutError, Request
from tplab.comm.emulated import EmulatedNetwork
from tplab.comm.mpi import MPIComm

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


__all__ = ["Communicator", "CommTimeoutError", "EmulatedNetwork", "MPIComm", "Request", "world"]
