"""Notebook 07's exercises: an LPT scheduler, and the time of a pipeline of unequal micro-batches.

    print(format_report(check_lpt(my_lpt)))        # fn(costs, groups) -> one list of request indices per group
    print(format_report(check_gpipe(my_gpipe)))    # fn(costs, stages) -> (makespan, bubble)

Both need no cluster. An LPT schedule is right when it is a schedule (every request exactly once) whose
makespan equals Graham's rule's (ties may be broken either way); the pipeline against
``tplab.balance.pipeline.gpipe_makespan``.
"""

from __future__ import annotations

import math

import numpy as np

from tplab.lab.exercises.runner import Case, run_local

# (tplab.balance is imported where it is used: importing the package brings torch, and the exercises of
# notebooks 01-03 should not wait for it)

LPT_CASES = [("7 requests, 3 groups", [5, 3, 8, 1, 9, 2, 4], 3),
             ("long tail, 4 groups", [1, 1, 2, 1, 30, 2, 1, 3, 25, 1, 2, 1, 1, 20, 2, 1], 4),
             ("one group", [3, 1, 2], 1), ("more groups than requests", [4, 2], 3), ("no requests", [], 2),
             ("ties", [2, 2, 2, 2, 2, 3, 3], 3), ("the worst case for LPT", [3, 3, 2, 2, 2], 2),
             ("arrival order hurts", [1, 1, 1, 1, 1, 1, 6], 3)]


def _is_schedule(result, n, groups) -> str | None:
    if result is None:
        return "returned None (return one list of request indices per group)"
    try:
        lists = [[int(i) for i in group] for group in result]
    except TypeError:
        return f"returned {result!r}: one list of request indices per group, e.g. [[0, 3], [1], [2]]"
    if len(lists) != groups:
        return f"returned {len(lists)} lists for {groups} groups: one per group (empty if it gets nothing)"
    flat = sorted(i for group in lists for i in group)
    if flat != list(range(n)):
        missing = sorted(set(range(n)) - set(flat))
        twice = sorted({i for i in flat if flat.count(i) > 1})
        return (f"not every request exactly once: missing {missing[:5]}, more than once {twice[:5]}, "
                f"out of range {[i for i in flat if not 0 <= i < n][:5]}")
    return None


def _diagnose_lpt(result, case, _):
    from tplab.balance import schedulers

    costs, groups = case.args
    problem = _is_schedule(result, len(costs), groups)
    if problem:
        return problem
    got = schedulers.makespan(result, costs)
    want = case.expected
    if math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-12):
        return None
    text = f"makespan {got:g} where LPT's is {want:g}"
    others = [(schedulers.round_robin, "that is round-robin (request i to group i mod G): it ignores the costs"),
              (schedulers.sorted_by_length, ("longest first, but dealt round-robin: give each request to the group "
                                            "with the least work so far")),
              (schedulers.list_schedule, ("each request to the least-loaded group, but in arrival order: sort "
                                         "longest first, so the short ones fill the gaps at the end")),
              (lambda c, m: schedulers.list_schedule(c, m, sorted(range(len(c)), key=lambda i: c[i])),
               "shortest first: the long requests come last and land on already loaded groups. Longest first")]
    as_sets = lambda schedule: sorted(sorted(int(i) for i in group) for group in schedule)
    for scheduler, hint in others:  # the same groups of requests as a typical slip (in any order)
        if as_sets(result) == as_sets(scheduler(costs, groups)):
            return f"{text} -- {hint}"
    return text


def check_lpt(fn, *, progress=True):
    """``fn(costs, groups)``: Graham's LPT rule. Requests longest first (by cost), each to the group with the
    least work so far; return one list of request indices per group."""
    from tplab.balance import schedulers

    cases = [Case(name, (list(costs), groups), schedulers.makespan(schedulers.lpt(costs, groups), costs),
                  {"groups": groups}) for name, costs, groups in LPT_CASES]
    return run_local(fn, cases, _diagnose_lpt, title="LPT: ", progress=progress)


# ---- the pipeline -------------------------------------------------------------------------------------------------
GPIPE_CASES = [("4 equal micro-batches, 4 stages", [1.0] * 4, 4), ("one 3x longer", [1.0, 3.0, 1.0, 1.0], 4),
               ("one stage", [2.0, 1.0], 1), ("one micro-batch, 3 stages", [5.0], 3),
               ("8 unequal, 2 stages", [0.5, 2.0, 1.0, 1.5, 0.25, 1.0, 3.0, 0.75], 2), ("16 equal, 8 stages", [2.0] * 16, 8)]


def _diagnose_gpipe(result, case, _):
    from tplab.balance.pipeline import gpipe_bubble

    costs, stages = case.args
    makespan, bubble = case.expected
    try:
        got_time, got_bubble = (float(v) for v in result)
    except (TypeError, ValueError):
        return f"returned {result!r}: a pair (makespan, bubble)"
    close = lambda a, b: math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    where = f"{len(costs)} micro-batches on {stages} stages"
    c = np.asarray(costs, dtype=float)
    if not close(got_time, makespan):
        hints = [(c.sum() + (stages - 1) * c.mean(), ("the fill and the drain wait for the *longest* micro-batch: "
                                                      "Σc + (p-1)·max c, not the mean")),
                 ((len(c) + stages - 1) * c.max(), ("(m+p-1)·max c prices every micro-batch as the longest: the "
                                                    "stages run the others at their own cost, Σc + (p-1)·max c")),
                 (stages * c.sum(), ("p·Σc: the stages run one after another there. In a pipeline they work at once "
                                    "on different micro-batches"))]
        hint = next((h for wrong, h in hints if close(got_time, wrong)), "")
        return f"{where}: makespan {got_time:g}, expected {makespan:g}" + (f" -- {hint}" if hint else "")
    if not close(got_bubble, bubble):
        if close(got_bubble, gpipe_bubble(stages, len(costs))):
            return (f"{where}: bubble {got_bubble:.4g}, expected {bubble:.4g} -- (p-1)/(m+p-1) holds for equal "
                    "micro-batches only: the idle share is 1 - (work done) / (p·makespan), with p·Σc work done")
        return f"{where}: bubble {got_bubble:.4g}, expected {bubble:.4g} (the share of stage-time spent idle)"
    return None


def check_gpipe(fn, *, progress=True):
    """``fn(costs, stages)``: micro-batches of costs c_j (each takes c_j on every stage) through ``stages``
    identical stages in GPipe's order; return (makespan, bubble), the bubble being the idle share of the
    stages' time."""
    from tplab.balance.pipeline import gpipe_makespan

    cases = []
    for name, costs, stages in GPIPE_CASES:
        makespan = gpipe_makespan(costs, stages)
        cases.append(Case(name, (list(costs), stages), (makespan, 1 - sum(costs) / makespan), {"stages": stages}))
    return run_local(fn, cases, _diagnose_gpipe, title="GPipe: ", progress=progress)
