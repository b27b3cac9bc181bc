"""algorithm="auto": a measured tuning table if one is in use (tuning.py), else MPICH's classic rules.

A table measured on the machine at hand (notebook 03; ``tuning.use_table`` or TPLAB_TUNING=path) takes
precedence; without one, this is what a textbook MPI does (MPICH's default selection):
- allreduce: recursive doubling for short messages (<= 2048 bytes, MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE)
  or fewer elements than the power of two below p; Rabenseifner otherwise.
- reduce-scatter: recursive halving below 512 KiB, ring (pairwise) above.
- allgather: recursive doubling below 512 KiB of gathered data, ring above.
- broadcast and reduce: the binomial tree.
"""

from __future__ import annotations

from tplab.collectives import tuning
from tplab.collectives.fold import largest_power_of_two_at_most

ALLREDUCE_SHORT_MSG_BYTES = 2048
REDUCE_SCATTER_LONG_MSG_BYTES = 512 * 1024
ALLGATHER_LONG_MSG_BYTES = 512 * 1024


def choose(collective: str, nbytes: int, count: int, p: int) -> str:
    """The algorithm for ``collective`` with ``nbytes`` (``count`` elements) per rank on ``p`` ranks.
    For allgather, whose ranks may contribute different sizes, ``nbytes`` is the gathered total."""
    table = tuning.active_table()
    if table is not None and p > 1:
        chosen = tuning.lookup(table, collective, nbytes, p)
        if chosen is not None:
            return chosen
    return mpich_rule(collective, nbytes, count, p)


def mpich_rule(collective: str, nbytes: int, count: int, p: int) -> str:
    if collective == "allreduce":
        if nbytes <= ALLREDUCE_SHORT_MSG_BYTES or count < largest_power_of_two_at_most(p):
            return "recursive_doubling"
        return "rabenseifner"
    if collective == "reduce_scatter":
        return "recursive_halving" if nbytes < REDUCE_SCATTER_LONG_MSG_BYTES else "ring"
    if collective == "allgather":
        return "recursive_doubling" if nbytes < ALLGATHER_LONG_MSG_BYTES else "ring"
    return "binomial"
