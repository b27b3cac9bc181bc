"""Reduction operators: sum, prod, max, min.

Each is an elementwise, associative and commutative operation, applied in place on numpy-like arrays
(anything that honours numpy's ufunc protocol, so CuPy arrays too).

Why the argument order matters even for commutative ops: floating-point ``+`` is commutative but not
associative, so ``(a + b) + c`` may differ from ``a + (b + c)`` in the last bit. The algorithms make every
rank get *bitwise identical* results by computing each partial result once (ring, Rabenseifner, tree) or
by always combining the lower-ranked operand on the left (recursive doubling), so that two ranks doing
"the same" combination really do the same arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ReduceOp:
    name: str
    ufunc: np.ufunc
    mpi_name: str  # attribute of mpi4py.MPI: SUM, PROD, MAX, MIN

    def combine(self, left, right, out):
        """out = left (op) right, elementwise. ``out`` may be ``left`` or ``right``."""
        return self.ufunc(left, right, out=out)

    def accumulate(self, acc, incoming):
        """acc = incoming (op) acc: fold a partial result that arrived from an earlier stage into ``acc``."""
        return self.ufunc(incoming, acc, out=acc)

    def reduce_many(self, arrays):
        """Reduce a list of equal-shaped arrays in list order: ((a0 op a1) op a2) ..."""
        acc = arrays[0].copy()
        for a in arrays[1:]:
            self.ufunc(acc, a, out=acc)
        return acc

    @property
    def mpi_op(self):
        from mpi4py import MPI

        return getattr(MPI, self.mpi_name)


OPS = {
    "sum": ReduceOp("sum", np.add, "SUM"),
    "prod": ReduceOp("prod", np.multiply, "PROD"),
    "max": ReduceOp("max", np.maximum, "MAX"),
    "min": ReduceOp("min", np.minimum, "MIN"),
}


def get_op(op: str | ReduceOp) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    try:
        return OPS[op]
    except (KeyError, TypeError):
        raise ValueError(f"unknown reduction op {op!r}; choose one of {sorted(OPS)}") from None
