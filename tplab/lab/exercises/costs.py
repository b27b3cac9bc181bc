"""Notebook 02's exercises: the cost model as functions you write, checked against tplab.cost.

    print(format_report(check_ring_time(ring_allreduce_time)))      # fn(p, n, alpha, beta, gamma) -> seconds
    print(format_report(check_busiest_bytes(busiest_rank_bytes)))   # fn(algorithm, p, n) -> bytes

They need no cluster: formulas run in the notebook itself.
"""

from __future__ import annotations

import math

from tplab.cost import Machine, predict, traffic
from tplab.lab.exercises.runner import Case, run_local

MACHINES = [Machine(alpha=5e-6, beta=1 / 10e9, gamma=1 / 20e9, name="a network"),
            Machine(alpha=2e-6, beta=1 / 300e9, gamma=1 / 1000e9, name="NVLink-like"),
            Machine(alpha=1e-3, beta=1e-9, gamma=1e-9, name="a slow one")]
RANKS = [1, 2, 3, 4, 8, 16, 64]


def _close(a, b, rtol=1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=1e-18)


def _ring_variants(p, n, m):
    """Typical slips, each with what it tells the reader."""
    a, b, g = m.alpha, m.beta, m.gamma
    steps = 2 * (p - 1)
    return [
        ((p - 1) * a + (p - 1) / p * n * b + (p - 1) / p * n * g,
         "half the right time: an all-reduce is a reduce-scatter *and* an allgather, p-1 steps each"),
        (steps * a + steps / p * n * b, "no γ term: the reduce-scatter adds (p-1)/p·n bytes"),
        (steps * a + steps * n * b + (p - 1) * n * g,
         "you charged the whole vector n per step: each ring step moves one block of n/p bytes"),
        (steps / p * n * b + (p - 1) / p * n * g, "no α term: each of the 2(p-1) steps is a message and pays α"),
        (steps * a + steps / p * n * b + steps / p * n * g,
         "γ counted in both phases: only the reduce-scatter adds; the allgather only copies"),
        (2 * p * a + 2 * n * b + n * g, "p steps per phase where the ring takes p-1"),
    ]


def _diagnose_time(result, case, _):
    p, n, alpha, beta, gamma = case.args
    expected = case.expected
    try:
        value = float(result)
    except (TypeError, ValueError):
        return f"returned {result!r}, not a number of seconds"
    if _close(value, expected):
        return None
    if p == 1:
        return f"p = 1 gave {value:.3g} s: on one rank there is nothing to send (0 s)"
    m = Machine(alpha, beta, gamma)
    for wrong, hint in _ring_variants(p, n, m):
        if _close(value, wrong):
            return f"p = {p}, n = {n:g} B: {value:.4g} s, expected {expected:.4g} s -- {hint}"
    if _close(value * 1e6, expected) or _close(value, expected * 1e6):
        return f"p = {p}, n = {n:g} B: {value:.4g}, expected {expected:.4g} s: return seconds, not µs"
    return f"p = {p}, n = {n:g} B on {m}: {value:.4g} s, expected {expected:.4g} s ({value / expected:.3g}x)"


def check_ring_time(fn, *, progress=True):
    """``fn(p, n, alpha, beta, gamma)``: seconds for a ring all-reduce of n bytes per rank on p ranks, checked
    against ``tplab.cost.predict("allreduce", "ring", ...)`` for p in 1..64, n from 64 B to 1 GiB, three
    machines (n a multiple of p: every block the same size)."""
    cases = []
    for p in RANKS:
        for n in (64 * p, 4096 * p, 1 << 30):
            n = n - n % p
            for m in MACHINES:
                cases.append((p, n, m))
    by_p = {}
    for p, n, m in cases:
        by_p.setdefault(p, []).append((p, n, m.alpha, m.beta, m.gamma))
    built = [Case(f"p = {p}", (rows,), [predict("allreduce", "ring", p, n, Machine(a, b, g)) for _, n, a, b, g in rows])
             for p, rows in by_p.items()]

    def several(rows):  # one case = one p, all sizes and machines: the first wrong one is reported
        return [fn(*row) for row in rows]

    def diagnose(results, case, _):
        for row, result, expected in zip(case.args[0], results, case.expected):
            problem = _diagnose_time(result, Case("", row, expected), None)
            if problem:
                return problem
        return None

    return run_local(several, built, diagnose, title="ring all-reduce time: ", progress=progress)


HINTS = {
    "naive": "rank 0 sends the whole reduced vector to each of the p-1 other ranks",
    "ring": "2(p-1) steps, one block of n/p bytes each",
    "recursive_doubling": "lg p steps (p a power of two), the whole vector in each",
    "tree": "the root sends the whole vector once in each of the lg p rounds of the broadcast",
}


def check_busiest_bytes(fn, *, algorithms=tuple(HINTS), progress=True):
    """``fn(algorithm, p, n)``: bytes sent by the busiest rank in one all-reduce of n bytes per rank, for p a
    power of two, checked against ``tplab.cost.traffic`` (which the test suite holds against the
    Communicator's counters)."""
    built = []
    for algorithm in algorithms:
        rows = [(algorithm, p, n) for p in (2, 4, 8, 16, 128) for n in (1024 * p, 3 << 20)]
        built.append(Case(algorithm, (rows,), [traffic("allreduce", *row)["max_bytes"] for row in rows]))

    def several(rows):
        return [fn(*row) for row in rows]

    def diagnose(results, case, _):
        for (algorithm, p, n), result, expected in zip(case.args[0], results, case.expected):
            try:
                value = float(result)
            except (TypeError, ValueError):
                return f"returned {result!r}, not a number of bytes"
            if not _close(value, expected):
                ratio = f" ({value / expected:.3g}x)" if expected else ""
                return (f"p = {p}, n = {n} B: {value:.6g} B, expected {expected:.6g} B{ratio}. "
                        f"{algorithm}: {HINTS.get(algorithm, '')}")
        return None

    return run_local(several, built, diagnose, title="bytes of the busiest rank: ", progress=progress)
