"""Folding a non-power-of-two rank count onto a power of two, as MPICH and Open MPI do.

Recursive doubling and halving pair rank ``i`` with rank ``i XOR mask``: that needs 2**k ranks.
With p = 2**k + r ranks, the first 2r ranks pair up before the algorithm starts:

    ranks      0  1 | 2  3 | ... | 2r-2 2r-1 | 2r ... p-1
    fold in    0 -> 1 , 2 -> 3, ...           (even ranks hand their data to the odd neighbour, sit out)
    new rank      0      1    ...     r-1      r ... 2**k-1
    fold out   0 <- 1 , 2 <- 3, ...           (odd ranks hand the finished result back)

So new rank n < r stands for the real ranks {2n, 2n+1}; new rank n >= r stands for real rank n + r.
That costs one extra message of the full vector each way (the "+2" terms of Thakur, Rabenseifner & Gropp (2005)).
"""

from __future__ import annotations



def largest_power_of_two_at_most(p: int) -> int:
    return 1 << (p.bit_length() - 1)


class PowerOfTwoFold:
    """Where this rank stands in the fold: computed once per call (the loops ask often)."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank  # p, the real rank count; this process's real rank
        self.pof2 = largest_power_of_two_at_most(size)
        self.extra = size - self.pof2  # r = p - 2**floor(lg p)
        folded = rank < 2 * self.extra
        self.sits_out = folded and rank % 2 == 0  # hands its data over and waits for the result
        self.absorbs_neighbour = folded and rank % 2 == 1  # takes its even neighbour's data, stands for both
        self.newrank = None if self.sits_out else (rank // 2 if folded else rank - self.extra)

    def real_rank(self, newrank: int) -> int:
        return 2 * newrank + 1 if newrank < self.extra else newrank + self.extra

    def real_ranks_of(self, newrank: int) -> range:
        """The real ranks a new rank stands for, in order (one or two of them, always contiguous)."""
        if newrank < self.extra:
            return range(2 * newrank, 2 * newrank + 2)
        return range(newrank + self.extra, newrank + self.extra + 1)
