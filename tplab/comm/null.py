"""NullComm: a communicator whose collectives are no-ops -- the layer without its communication.

Exposed communication is measured against the same layer with the collectives taken out:

    exposed = time(layer) - time(layer on a NullComm)          (tplab.overlap.without_communication)

``NullComm(rank, size)`` has the rank and size of the real communicator (so every shard keeps its shape) and
collectives that return at once with a result of the right shape: all-reduce returns the input, all-gather
repeats it, reduce-scatter keeps this rank's block. The numbers are wrong; the time is the compute alone.
Like every transport without point-to-point, it runs its own (no-op) collectives whatever algorithm is named.
``log`` lists (collective, shape, dtype, device) of every call: what the layer would have sent.
"""

from __future__ import annotations

from tplab.comm.base import Communicator
from tplab.toolkit.arrays import array_module, is_torch
from tplab.toolkit.blocks import block_bounds


class NullComm(Communicator):
    point_to_point = False
    prefers_builtin = True
    moves_gpu_memory = True  # takes anything, moves nothing

    def __init__(self, rank: int = 0, size: int = 1):
        super().__init__()
        self.rank, self.size = rank, size
        self.log: list[tuple] = []

    @classmethod
    def like(cls, comm) -> "NullComm":
        return cls(comm.rank, comm.size)

    def _note(self, name, x):
        self.log.append((name, tuple(x.shape), x.dtype, getattr(x, "device", "cpu")))

    def plan(self, collective, x, op=None, algorithm="auto"):
        """No conversion, no agreement: straight to the no-op (what the layer costs without its messages)."""
        if collective == "allgather":
            return lambda x, comm: comm.builtin_allgather(x)
        if collective in ("allreduce", "reduce_scatter"):
            name = f"builtin_{collective}"
            return lambda x, comm: getattr(comm, name)(x, op)
        return None

    def agree(self, description):
        return "; ".join(description.get("problems", ())) or None

    def builtin_allreduce(self, x, op="sum"):
        self._note("allreduce", x)
        return x

    def builtin_allgather(self, x):  # every rank's flat x, concatenated: here p copies of mine
        self._note("allgather", x)
        flat = x.reshape(-1)
        return flat.repeat(self.size) if is_torch(flat) else array_module(flat).tile(flat, self.size)

    def builtin_reduce_scatter(self, x, op="sum"):  # this rank's block of the flat vector
        self._note("reduce_scatter", x)
        bounds = block_bounds(x.reshape(-1).shape[0], self.size)
        return x.reshape(-1)[bounds[self.rank]:bounds[self.rank + 1]]

    def builtin_broadcast(self, x, root=0):
        self._note("broadcast", x)
        return x

    def builtin_reduce(self, x, op="sum", root=0):
        self._note("reduce", x)
        return x if self.rank == root else None

    def barrier(self):
        pass

    def allgather_object(self, obj):
        return [obj] * self.size

    def __repr__(self):
        return f"<NullComm rank {self.rank} of {self.size}>"

