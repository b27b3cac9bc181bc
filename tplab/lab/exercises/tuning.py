"""Notebook 03's exercises: read a crossover off measurements, and turn measurements into a decision.

    print(format_report(check_crossover(crossover)))   # fn(df, small, large) -> a size in bytes, or None
    print(format_report(check_decision(decide)))        # fn(df, nbytes) -> an algorithm's name

``df`` has the columns of ``tplab.lab.bench.sweep``: algorithm, size (bytes per rank), time_us, wrong. The
checks run on made-up sweeps (from the cost model, with noise and a few traps) whose answers are known.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from tplab.cost import Machine, predict
from tplab.lab.exercises.runner import Case, run_local

CANDIDATES_EXCLUDED = ("builtin", "auto")


EXAMPLE = Machine(alpha=5e-6, beta=1 / 10e9, gamma=1 / 20e9)


def _sweep(p=4, machine=EXAMPLE, sizes=None, noise=0.0, seed=0,
           algorithms=("naive", "ring", "recursive_doubling", "rabenseifner", "builtin")):
    """A made-up sweep: the model's times, with multiplicative noise; builtin 20% faster than the best."""
    rng = np.random.default_rng(seed)
    sizes = sizes or [8 << 2 * k for k in range(11)]  # 8 B .. 8 MiB
    rows = []
    for size in sizes:
        times = {a: predict("allreduce", a, p, size, machine) * 1e6 for a in algorithms if a != "builtin"}
        times["builtin"] = 0.8 * min(times.values())
        for a in algorithms:
            rows.append({"algorithm": a, "ranks": p, "size": size, "wrong": 0,
                         "time_us": times[a] * float(np.exp(noise * rng.standard_normal()))})
    return pd.DataFrame(rows)


def reference_crossover(df, small, large):
    """The smallest measured size from which ``large`` is faster than ``small`` at that size and every larger
    one; None if ``small`` is still as fast at the largest size."""
    t = df[df.algorithm.isin([small, large])].pivot_table(index="size", columns="algorithm", values="time_us")
    answer = None
    for size in sorted(t.index, reverse=True):
        if t.loc[size, large] < t.loc[size, small]:
            answer = int(size)
        else:
            break
    return answer


def _crossover_cases():
    steady = _sweep()
    flip = steady.copy()  # at one small size the ring wins by luck: not a crossover
    lucky = (flip.algorithm == "ring") & (flip["size"] == 32)
    flip.loc[lucky, "time_us"] = 0.5 * flip.loc[(flip.algorithm == "recursive_doubling") & (flip["size"] == 32),
                                                 "time_us"].to_numpy()
    return [("model, 4 ranks", steady, "recursive_doubling", "ring"),
            ("model, 8 ranks, slow network", _sweep(8, Machine(alpha=50e-6, beta=1 / 1e9, gamma=1 / 20e9)),
             "recursive_doubling", "rabenseifner"),
            ("a lucky small size", flip, "recursive_doubling", "ring"),
            ("naive against ring", _sweep(2), "naive", "ring"),
            ("never: ring against recursive doubling", steady[steady["size"] <= 512], "ring", "recursive_doubling"),
            ("noisy, 4 ranks", _sweep(noise=0.1, seed=3), "recursive_doubling", "rabenseifner")]


def _diagnose_crossover(result, case, _):
    df, small, large = case.args
    expected = case.expected
    t = df[df.algorithm.isin([small, large])].pivot_table(index="size", columns="algorithm", values="time_us")
    if result is not None and not isinstance(result, (int, float, np.integer, np.floating)):
        return f"returned {result!r}: return a size in bytes (an int), or None"
    if result is None and expected is None:
        return None
    if result is not None and expected is not None and int(result) == expected:
        return None
    if expected is None:
        return f"returned {result}, but {small} is still as fast at the largest size ({int(t.index.max())} B): None"
    if result is None:
        return f"returned None, but {large} is faster from {expected} B up"
    result = int(result)
    if result not in t.index:
        if 0 <= result < len(t.index):
            return f"returned {result}: a row number? return the size in bytes ({expected})"
        return f"returned {result} B, which is not a measured size (the crossover is a size in the table)"
    wins = t[large] < t[small]
    if result < expected and wins.loc[result]:
        return (f"returned {result} B, where {large} wins by luck and loses again at a larger size: the crossover "
                f"is where it wins for good ({expected} B)")
    if result < expected:
        return f"returned {result} B: there {small} is still faster; expected {expected} B"
    previous = [s for s in t.index if s < expected]
    if previous and result == max(previous):
        return f"returned {result} B, the last size {small} wins; the question asks for the first size {large} wins"
    return f"returned {result} B, expected {expected} B: {large} already wins for good from {expected} B up"


def check_crossover(fn, *, progress=True):
    """``fn(df, small, large)``: the smallest measured size from which ``large`` beats ``small`` for good."""
    built = [Case(name, (df, small, large), reference_crossover(df, small, large))
             for name, df, small, large in _crossover_cases()]
    return run_local(fn, built, _diagnose_crossover, title="crossover: ", progress=progress)


def reference_decision(df, nbytes):
    """The hand-written algorithm (not builtin or auto, no wrong results) fastest at the measured size nearest
    to ``nbytes`` on a log scale (a tie: the smaller size)."""
    good = df[~df.algorithm.isin(CANDIDATES_EXCLUDED) & (df.get("wrong", 0) == 0)]
    sizes = sorted(good["size"].unique())
    nearest = min(sizes, key=lambda s: (abs(math.log2(s) - math.log2(max(nbytes, 1))), s))
    at = good[good["size"] == nearest]
    return str(at.loc[at.time_us.idxmin(), "algorithm"])


def _decision_cases():
    base = _sweep()
    broken = base.copy()  # a fast algorithm with wrong results must never be chosen
    tiny = broken["size"] == 8
    broken.loc[tiny & (broken.algorithm == "naive"), ["time_us", "wrong"]] = [0.01, 3]
    return [("measured sizes", base, [8, 512, 8192, 1 << 23]),
            ("sizes between the measured ones", base, [3, 100, 3000, 700_000, 1 << 30]),
            ("near a crossover, log scale", _sweep(8, Machine(alpha=50e-6, beta=1 / 1e9, gamma=1 / 20e9)),
             [1500, 6000, 24_000, 100_000]),
            ("a fast algorithm with wrong results", broken, [8, 10])]


def _diagnose_decision(results, case, _):
    df, sizes = case.args
    for nbytes, result, expected in zip(sizes, results, case.expected):
        if result == expected:
            continue
        if not isinstance(result, str):
            return f"for {nbytes} B returned {result!r}: return an algorithm's name (a str)"
        if result in CANDIDATES_EXCLUDED:
            return (f"for {nbytes} B chose {result!r}: the table chooses among the hand-written algorithms "
                    f"(builtin is what it is compared with); expected {expected!r}")
        if "wrong" in df and (df[(df.algorithm == result)]["wrong"] > 0).any():
            return f"for {nbytes} B chose {result!r}, whose results were wrong (column 'wrong'): expected {expected!r}"
        overall = df[~df.algorithm.isin(CANDIDATES_EXCLUDED)].groupby("algorithm").time_us.sum().idxmin()
        if result == overall:
            return (f"for {nbytes} B chose {result!r}, the fastest summed over all sizes; the decision depends on "
                    f"the size: take the fastest at the measured size nearest to {nbytes} B ({expected!r})")
        return (f"for {nbytes} B chose {result!r}, expected {expected!r} (fastest at the measured size nearest to "
                f"{nbytes} B on a log scale, i.e. nearest ratio)")
    return None


def check_decision(fn, *, progress=True):
    """``fn(df, nbytes)``: which algorithm to use for a message of ``nbytes`` bytes per rank, from a sweep."""
    built = [Case(name, (df, sizes), [reference_decision(df, n) for n in sizes])
             for name, df, sizes in _decision_cases()]

    def several(df, sizes):
        return [fn(df, n) for n in sizes]

    return run_local(several, built, _diagnose_decision, title="tuning decision: ", progress=progress)
