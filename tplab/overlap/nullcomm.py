"""The layer without its communication, or on another transport: swap the communicator its modules hold.

Exposed communication is measured against the same layer with the collectives taken out:

    exposed = time(layer) - time(layer on a NullComm)           (tplab.comm.null.NullComm)

    with without_communication(layer):      # every submodule's .comm is a NullComm inside the block
        layer(x)
    with with_comm(layer, other_comm):      # the same, with another communicator of the same ranks
        layer(x)
"""

from __future__ import annotations

from contextlib import contextmanager

from tplab.comm.null import NullComm


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
