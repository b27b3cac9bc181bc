"""Notebook 01's exercises: an all-reduce and a reduce-scatter written by hand, checked on every rank.

    report = cluster.run(check_allreduce, my_allreduce)[0]                     # any algorithm: values only
    report = cluster.run(check_allreduce, my_ring, algorithm="ring")[0]        # + the ring's bytes and messages
    report = cluster.run(check_reduce_scatter, my_reduce_scatter)[0]          # ring reduce-scatter
    print(format_report(report))

Cases: sizes 0, 1, fewer than p, p, odd, 1000 and 2^17 elements, in int64 and float64. Integers must be
exact, floats right to rounding; an all-reduce must also be bitwise identical on every rank.
"""

from __future__ import annotations

import numpy as np

from tplab.comm import world
from tplab.lab.exercises.runner import Case, run_cases
from tplab.toolkit.blocks import block_bounds


def default_cases(p: int):
    sizes = {"empty": 0, "one element": 1, "fewer than p": max(p - 1, 1), "p elements": p,
             "odd (2p+1)": 2 * p + 1, "medium (1000)": 1000, "large (2^17)": 1 << 17}
    return [(name, n, dtype) for name, n in sizes.items() for dtype in ("int64", "float64")]


def _input(count, dtype, rank):
    rng = np.random.default_rng([count, rank])
    if dtype == "int64":
        return rng.integers(-1000, 1000, size=count).astype(np.int64)
    return rng.standard_normal(count)


def _wrong_elements(result, expected, p):
    if expected.dtype.kind == "f":
        return ~np.isclose(result, expected, rtol=1e-12, atol=1e-12 * p)
    return result != expected


def _compare(result, expected, x, p, blocks_of) -> str | None:
    """What is wrong with one rank's array result, or None."""
    if result is None:
        return "returned None (return the result array)"
    result = np.asarray(result)
    if result.shape != expected.shape:
        return f"returned shape {result.shape}, expected {expected.shape}"
    if result.dtype != expected.dtype:
        return f"returned dtype {result.dtype}, expected {expected.dtype}"
    wrong = _wrong_elements(result, expected, p)
    if not wrong.any():
        return None
    if p > 1 and np.array_equal(result, x):
        return "your result equals your input: nothing was reduced"
    blocks = []
    if blocks_of == expected.size:
        bounds = block_bounds(blocks_of, p)
        blocks = [i for i in range(p) if wrong[bounds[i]:bounds[i + 1]].any()]
    first = int(np.argmax(wrong))
    where = f", in blocks {blocks}" if blocks else ""
    return (f"{int(wrong.sum())} of {wrong.size} elements wrong{where} "
            f"(first: element {first} is {result[first].item()!r}, expected {expected[first].item()!r})")


def _diagnose_allreduce(result, case, p):
    (x,) = case.args
    return _compare(result, case.expected, x, p, case.expected.size)


def ring_allreduce_wire(count, itemsize, p, rank) -> dict:
    """What rank ``rank`` sends in the ring: every block but its own (reduce-scatter) and every block but its
    right neighbour's (allgather): 2(p-1)/p·n bytes when p divides n, in 2(p-1) messages."""
    b = block_bounds(count, p)
    size = lambda i: (b[i % p + 1] - b[i % p]) * itemsize
    wire = {"bytes": int(2 * count * itemsize - size(rank) - size(rank + 1)) if p > 1 else 0,
            "messages": 2 * (p - 1) if count >= p else None,  # (empty blocks: sending them is optional)
            "hint": "The ring takes p-1 steps per phase, one sendrecv each."}
    return wire


def check_allreduce(fn, comm=None, *, timeout: float = 5.0, cases=None, algorithm=None, stop_at_first_failure=False,
                    progress=True):
    """Run ``fn(x, comm)`` (an all-reduce, op sum) on every rank for each case; return a list of dicts
    (case, count, dtype, ok, problem, seconds), identical on every rank. ``algorithm="ring"`` also checks that
    every rank sent exactly the ring's bytes. Call it on every rank."""
    base = comm or world()
    p, rank = base.size, base.rank
    built = []
    for name, count, dtype in cases or default_cases(p):
        x = _input(count, dtype, rank)
        expected = getattr(base, "inner", base).builtin_allreduce(x, "sum")  # (past an emulated network)
        wire = ring_allreduce_wire(count, x.itemsize, p, rank) if algorithm == "ring" else None
        built.append(Case(f"{name}, {dtype}", (x,), expected, {"count": count, "dtype": dtype}, wire))
    return run_cases(fn, built, _diagnose_allreduce, comm=base, timeout=timeout, bitwise=True,
                     title=f"{algorithm or 'allreduce'}: ", progress=progress, stop_at_first_failure=stop_at_first_failure)


def _diagnose_reduce_scatter(result, case, p):
    x, = case.args
    total, rank = case.expected
    b = block_bounds(total.size, p)
    expected = total[b[rank]:b[rank + 1]]
    if result is not None and np.asarray(result).shape == total.shape and expected.size != total.size:
        return ("returned the whole vector: a reduce-scatter leaves rank r only block r of the sum "
                f"({expected.size} of {total.size} elements)")
    if result is not None and p > 1 and expected.size:
        result_ = np.asarray(result)
        for k in range(p):
            other = total[b[k]:b[k + 1]]
            if k != rank and result_.shape == other.shape and result_.dtype == other.dtype and \
                    not _wrong_elements(result_, other, p).any():
                return f"returned the sum of block {k}: rank {rank} must end with block {rank}"
        if result_.shape == expected.shape and np.array_equal(result_, x[b[rank]:b[rank + 1]]):
            return f"your result equals your own block {rank} of the input: nothing was reduced"
    return _compare(result, expected, x[b[rank]:b[rank + 1]], p, -1)


def ring_reduce_scatter_wire(count, itemsize, p, rank) -> dict:
    """The ring reduce-scatter: every block but its own once, (p-1)/p·n bytes in p-1 messages."""
    b = block_bounds(count, p)
    return {"bytes": int((count - (b[rank + 1] - b[rank])) * itemsize) if p > 1 else 0,
            "messages": p - 1 if count >= p else None,
            "hint": "The ring reduce-scatter takes p-1 steps, one sendrecv each."}


def check_reduce_scatter(fn, comm=None, *, timeout: float = 5.0, cases=None, wire=True, stop_at_first_failure=False,
                         progress=True):
    """Run ``fn(x, comm)``: rank r must return block r (blocks cut as ``block_bounds(x.size, p)``) of the
    elementwise sum over ranks, having sent what the ring sends ((p-1)/p·n bytes, ``wire=False``: not checked)."""
    base = comm or world()
    p, rank = base.size, base.rank
    built = []
    for name, count, dtype in cases or default_cases(p):
        x = _input(count, dtype, rank)
        total = getattr(base, "inner", base).builtin_allreduce(x, "sum")
        traffic = ring_reduce_scatter_wire(count, x.itemsize, p, rank) if wire else None
        built.append(Case(f"{name}, {dtype}", (x,), (total, rank), {"count": count, "dtype": dtype}, traffic))
    return run_cases(fn, built, _diagnose_reduce_scatter, comm=base, timeout=timeout, title="reduce-scatter: ",
                     progress=progress, stop_at_first_failure=stop_at_first_failure)
