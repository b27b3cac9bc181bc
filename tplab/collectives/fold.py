"""Folding a non-power-of-two rank count onto a power of two, as MPICH and Open MPI do.

Recursive doubling and halving pair rank ``i`` with rank ``i XOR mask``: that needs 2**k ranks.
With p = 2**k + r ranks, the first 2r ranks pair up before the algorithm starts:

    ranks      0  1 | 2  3 | ... | 2r-2 2r-1 | 2r ... p-1
    fold in    0 -> 1 , 2 -> 3, ...           (even ranks hand their data to the odd neighbour, sit out)
    new rank      0      1    ...     r-1      r ... 2**k-1
    fold out   0 <- 1 , 2 <- 3, ...           (odd ranks hand the finished result back)

So new rank n < r stands for the real ranks {2n, 2n+1}; new rank n >= r stands for real rank n + r.
That costs one extra message of the full vector each way (the "+2" terms of REFERENCE s.1).
"""

from __future__ import annotations

from dataclasses import dataclass


def largest_power_of_two_at_most(p: int) -> int:
    return 1 << (p.bit_length() - 1)


@dataclass(frozen=True)
class PowerOfTwoFold:
    size: int  # p, the real rank count
    rank: int  # this process's real rank

    @property
    def pof2(self) -> int:
        return largest_power_of_two_at_most(self.size)

    @property
    def extra(self) -> int:  # r = p - 2**floor(lg p)
        return self.size - self.pof2

    @property
    def sits_out(self) -> bool:
        """Even ranks among the first 2r hand their data over and wait for the result."""
        return self.rank < 2 * self.extra and self.rank % 2 == 0

    @property
    def absorbs_neighbour(self) -> bool:
        """Odd ranks among the first 2r take their even neighbour's data and stand for both."""
        return self.rank < 2 * self.extra and self.rank % 2 == 1

    @property
    def newrank(self) -> int | None:
        if self.sits_out:
            return None
        return self.rank // 2 if self.rank < 2 * self.extra else self.rank - self.extra

    def real_rank(self, newrank: int) -> int:
        return 2 * newrank + 1 if newrank < self.extra else newrank + self.extra

    def real_ranks_of(self, newrank: int) -> range:
        """The real ranks a new rank stands for, in order (one or two of them, always contiguous)."""
        if newrank < self.extra:
            return range(2 * newrank, 2 * newrank + 2)
        return range(newrank + self.extra, newrank + self.extra + 1)
