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

from tplab.toolkit.arrays import array_module


@dataclass(frozen=True)
class ReduceOp:
    name: str
    ufunc: np.ufunc
    mpi_name: str  # attribute of mpi4py.MPI: SUM, PROD, MAX, MIN
    bfloat16 = False  # True for the variant that reads int16 arrays as bfloat16 bits (tplab/toolkit/bfloat16.py)

    def combine(self, left, right, out):
        """out = left (op) right, elementwise. ``out`` may be ``left`` or ``right``."""
        if type(out) is np.ndarray:  # host memory: numpy's ufunc, no dispatch cost
            return self.ufunc(left, right, out=out)
        return self.ufunc_for(out)(left, right, out=out)

    def accumulate(self, acc, incoming):
        """acc = incoming (op) acc: fold a partial result that arrived from an earlier stage into ``acc``."""
        return self.ufunc_for(acc)(incoming, acc, out=acc)

    def reduce_many(self, arrays):
        """Reduce a list of equal-shaped arrays in list order: ((a0 op a1) op a2) ..."""
        acc = arrays[0].copy()
        ufunc = self.ufunc_for(acc)
        for a in arrays[1:]:
            ufunc(acc, a, out=acc)
        return acc

    def ufunc_for(self, x):
        """This op's ufunc from the module of ``x``: numpy's, or CuPy's for GPU arrays (called directly,
        not through numpy's __array_ufunc__ dispatch)."""
        if type(x) is np.ndarray:
            return self.ufunc
        return getattr(array_module(x), self.ufunc.__name__)

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


def sum_tolerance(ranks: int, eps: float) -> float:
    """How far (relative, at least 1 in scale) a float sum over ``ranks`` may differ from another order's:
    each of the p - 1 additions rounds once, by at most eps; 4x leaves room for the two orders' paths."""
    return 4 * ranks * eps
