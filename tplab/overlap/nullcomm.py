"""The layer without its communication: a communicator whose collectives are no-ops.

Exposed communication is measured against the same layer with the collectives taken out:

    exposed = time(layer) - time(layer on a NullComm)

``NullComm(rank, size)`` has the rank and size of the real communicator (so every shard keeps its
shape) and tensor collectives that return at once with a result of the right shape: all-reduce returns
the input, all-gather repeats it, reduce-scatter keeps this rank's block. The numbers are wrong, the
time is the compute alone. tplab's layers use a communicator's ``tensor_*`` methods when it has them
(tplab.layers.mappings), and so does ``tplab.overlap``.

    with without_communication(layer):      # every submodule's .comm is a NullComm inside the block
        layer(x)
    with with_comm(layer, other_comm):      # the same, with another communicator of the same ranks
        layer(x)
"""

from __future__ import annotations

from contextlib import contextmanager


class NullComm:
    is_null = True

    def __init__(self, rank: int = 0, size: int = 1):
        self.rank, self.size = rank, size
        self.log: list[tuple] = []  # (collective, shape, dtype, device) of every call: what the layer sends

    @classmethod
    def like(cls, comm) -> "NullComm":
        return cls(comm.rank, comm.size)

    def _note(self, name, x):
        self.log.append((name, tuple(x.shape), x.dtype, x.device))

    def tensor_allreduce(self, x):
        self._note("allreduce", x)
        return x

    def tensor_allgather(self, x):  # every rank's flat x, concatenated: here p copies of mine
        self._note("allgather", x)
        return x.reshape(-1).repeat(self.size)

    def tensor_reduce_scatter(self, x):  # this rank's block of the flat vector
        self._note("reduce_scatter", x)
        return x.reshape(-1).chunk(self.size)[self.rank]

    def barrier(self):
        pass

    def allgather_object(self, obj):
        return [obj] * self.size

    def __repr__(self):
        return f"<NullComm rank {self.rank} of {self.size}>"


def _holders(module):
    """The submodules that hold a communicator (wrappers that only pass their inner layer's on are skipped)."""
    return [m for m in module.modules()
            if getattr(m, "comm", None) is not None and not isinstance(getattr(type(m), "comm", None), property)]


@contextmanager
def with_comm(module, comm):
    """Inside the block, every submodule of ``module`` that holds a ``comm`` talks to ``comm`` instead (the
    same ranks, another transport: say, tplab's ring over NCCL instead of torch.distributed)."""
    swapped = [(m, m.comm) for m in _holders(module)]
    try:
        for m, _ in swapped:
            m.comm = comm
        yield comm
    finally:
        for m, original in swapped:
            m.comm = original


@contextmanager
def without_communication(module):
    """Inside the block, every submodule of ``module`` that holds a ``comm`` talks to one NullComm instead
    (yielded: its ``log`` lists the collectives the layer would have run)."""
    holders = _holders(module)
    with with_comm(module, NullComm.like(holders[0].comm) if holders else NullComm()) as null:
        yield null
