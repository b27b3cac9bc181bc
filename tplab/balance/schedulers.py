"""Static schedules: which of m workers (data-parallel groups) gets which work items, decided up front.

Every function takes the items' costs (seconds, FLOPs: any additive unit) and m, and returns one list
of item indices per worker, in the order that worker runs them. Every item appears exactly once.

    round_robin        item i -> worker i mod m, in arrival order. Blind to cost: equal *counts*.
    sorted_by_length   longest first, dealt round-robin. Each worker gets a similar mix, but the
                       deal ignores what each already holds: the first worker gets the longest of
                       every round.
    lpt                Graham's longest-processing-time rule: longest first, each to the worker with
                       the least work so far. Makespan <= (4/3 - 1/(3m)) x optimal (Graham 1969).
    list_schedule      the general greedy: items in a given order, each to the first worker to be free.
                       This is what dynamic work pulling does when the costs are exact; in arrival order
                       it is within (2 - 1/m) x optimal, and LPT is this rule in descending order.

``makespan`` prices a schedule; ``optimal_makespan`` finds the best one by brute force (tiny cases only:
m^n assignments) to check the bounds.
"""

from __future__ import annotations

import heapq
import itertools

import numpy as np


def _check(costs, m):
    costs = [float(c) for c in costs]
    if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
        raise ValueError(f"the number of workers must be a positive int, not {m!r}")
    if any(not c >= 0 for c in costs):  # also catches NaN
        raise ValueError("costs must be non-negative numbers")
    return costs, int(m)


def round_robin(costs, m) -> list[list[int]]:
    costs, m = _check(costs, m)
    return [list(range(w, len(costs), m)) for w in range(m)]


def longest_first(costs) -> list[int]:
    """Item indices by decreasing cost (ties: lower index first, so every rank sorts alike)."""
    return sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i))


def sorted_by_length(costs, m) -> list[list[int]]:
    costs, m = _check(costs, m)
    order = longest_first(costs)
    return [order[w::m] for w in range(m)]


def list_schedule(costs, m, order=None) -> list[list[int]]:
    """Each item (in ``order``, default arrival) to the worker that becomes free first (ties: lowest
    worker). A heap of (time the worker is free, worker): O(n log m)."""
    costs, m = _check(costs, m)
    order = range(len(costs)) if order is None else order
    free_at = [(0.0, w) for w in range(m)]
    assignment = [[] for _ in range(m)]
    for i in order:
        t, w = heapq.heappop(free_at)
        assignment[w].append(i)
        heapq.heappush(free_at, (t + costs[i], w))
    return assignment


def lpt(costs, m) -> list[list[int]]:
    return list_schedule(costs, m, longest_first(costs))


STATIC_SCHEDULERS = {"round_robin": round_robin, "sorted": sorted_by_length, "lpt": lpt}


def static_schedule(strategy: str, costs, m) -> list[list[int]]:
    if strategy not in STATIC_SCHEDULERS:
        raise ValueError(f"static strategy must be one of {sorted(STATIC_SCHEDULERS)}, not {strategy!r}")
    return STATIC_SCHEDULERS[strategy](costs, m)


def loads(assignment, costs) -> list[float]:
    return [float(sum(costs[i] for i in items)) for items in assignment]


def makespan(assignment, costs) -> float:
    """When the last worker finishes (all start at 0 and never wait)."""
    return max(loads(assignment, costs), default=0.0)


def imbalance(assignment, costs) -> float:
    """Most loaded worker / mean load: 1.0 is perfect balance."""
    work = loads(assignment, costs)
    mean = float(np.mean(work)) if work else 0.0
    return max(work) / mean if mean > 0 else 1.0


def optimal_makespan(costs, m) -> float:
    """The best makespan over all m^n assignments (symmetry: item 0 always on worker 0). Tiny n only."""
    costs, m = _check(costs, m)
    if len(costs) > 12:
        raise ValueError("brute force over m^n assignments: keep n <= 12")
    if not costs:
        return 0.0
    best = float("inf")
    for rest in itertools.product(range(m), repeat=len(costs) - 1):
        work = [0.0] * m
        for i, w in enumerate((0, *rest)):
            work[w] += costs[i]
        best = min(best, max(work))
    return best


def graham_bound(m: int) -> float:
    """LPT's worst-case ratio to the optimum, 4/3 - 1/(3m)."""
    return 4 / 3 - 1 / (3 * m)
