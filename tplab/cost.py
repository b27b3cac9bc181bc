"""What each allreduce algorithm sends, per rank, by formula: to put next to the counters of a real run.

``allreduce_traffic(algorithm, p, n)`` gives the messages and bytes that one rank sends for an
allreduce of ``n`` bytes per rank on ``p`` ranks. Ranks do not all send the same (the root of the naive
algorithm sends p-1 copies; folded ranks of a non-power-of-two sit out), so it reports both the busiest
rank and the total over ranks. The formulas are exact when n is a multiple of p's blocks (n/p whole
elements); otherwise the block sizes round by at most one element.

    algorithm            busiest rank: messages      bytes                    (p a power of two)
    naive                p - 1                        (p-1) n                  the root sends p-1 copies
    ring                 2 (p-1)                      2 (p-1)/p n
    recursive_doubling   lg p                         n lg p
    rabenseifner         2 lg p                       2 (p-1)/p n
    tree                 lg p                         n lg p                   rank 0 in the broadcast

With p = 2**k + r and r > 0 the odd ranks among the first 2r absorb a neighbour and hand the result
back: one more message of n bytes for them (shared/REFERENCE.md s.1, "non-power-of-two handling").
"""

from __future__ import annotations

import math


def _lg(p: int) -> int:
    return max(p.bit_length() - 1, 0)


def _pof2(p: int) -> int:
    return 1 << _lg(p)


def allreduce_traffic(algorithm: str, p: int, n: float) -> dict:
    """Messages and bytes sent for one allreduce of ``n`` bytes per rank on ``p`` ranks."""
    if p == 1:
        return {"max_messages": 0, "max_bytes": 0.0, "total_messages": 0, "total_bytes": 0.0}
    pof2, lg, extra = _pof2(p), _lg(p), p - _pof2(p)
    if algorithm == "naive":
        busiest = (p - 1, (p - 1) * n)
        total = (2 * (p - 1), 2 * (p - 1) * n)
    elif algorithm == "ring":
        busiest = (2 * (p - 1), 2 * (p - 1) / p * n)
        total = (2 * p * (p - 1), 2 * (p - 1) * n)
    elif algorithm == "recursive_doubling":
        hops = lg + (1 if extra else 0)  # a folding odd rank also returns the result
        busiest = (hops, hops * n)
        messages = pof2 * lg + 2 * extra
        total = (messages, messages * n)
    elif algorithm == "rabenseifner":
        exchange = 2 * (pof2 - 1) / pof2 * n
        busiest = (2 * lg + (1 if extra else 0), exchange + (n if extra else 0))
        total = (pof2 * 2 * lg + 2 * extra, pof2 * exchange + 2 * extra * n)
    elif algorithm == "tree":
        rounds = math.ceil(math.log2(p))
        busiest = (rounds, rounds * n)
        total = (2 * (p - 1), 2 * (p - 1) * n)
    else:
        raise ValueError(f"no traffic formula for allreduce algorithm {algorithm!r}")
    return {"max_messages": busiest[0], "max_bytes": float(busiest[1]),
            "total_messages": total[0], "total_bytes": float(total[1])}
