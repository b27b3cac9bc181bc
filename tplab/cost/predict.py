"""Predicted time of one collective on a machine of one kind of link (formulas.py) or of two (two_level.py)."""

from __future__ import annotations

from tplab.cost.alltoall import alltoall_path
from tplab.cost.formulas import critical_path
from tplab.cost.two_level import TwoLevelMachine, predict_two_level


def predict(collective: str, algorithm: str, p: int, n: float, machine, *, itemsize: int = 1) -> float:
    """Predicted seconds for ``collective`` by ``algorithm`` on ``p`` ranks with n bytes (nccl-tests' S).
    ``machine``: a Machine, or a TwoLevelMachine (ranks in blocks of ranks_per_node per node)."""
    if collective == "alltoall":  # pairwise or bruck (alltoall.py); n = one rank's whole input
        if isinstance(machine, TwoLevelMachine):
            raise ValueError("alltoall has a one-level model only: pass a Machine")
        return machine.entry_time(n) + alltoall_path(algorithm, p, n).time(machine)
    if isinstance(machine, TwoLevelMachine):
        return predict_two_level(collective, algorithm, p, n, machine, itemsize=itemsize)
    path = critical_path(collective, algorithm, p, n, itemsize=itemsize)
    return machine.entry_time(n) + path.time(machine)
