"""Checkers for the notebooks' exercises: run a reader's collective on every rank and say what is wrong.

    def my_allreduce(x, comm):          # the reader's code, using comm.send/recv/sendrecv/isend/irecv
        ...
    report = cluster.run(tplab.lab.exercises.check_allreduce, my_allreduce)[0]   # the same on every rank

Each case (sizes 0, 1, fewer than p, p, odd, medium, large; int64 and float64) runs the reader's
function on a fresh duplicate of the communicator with a deadline, so
- a deadlock (say, every rank calling a blocking send first) becomes "rank 2: send to rank 3 did not
  complete within 5 s" instead of a frozen notebook,
- an exception on one rank makes the others time out instead of hanging,
and then every rank learns every rank's verdict, so all ranks return the same report.
Only the Communicator's own methods are protected: raw mpi4py calls in the reader's code are not.
"""

from __future__ import annotations

import hashlib
import textwrap

import numpy as np

from tplab.toolkit.blocks import block_bounds
from tplab.comm import CommTimeoutError, world


def default_cases(p: int):
    sizes = {"empty": 0, "one element": 1, "fewer than p": max(p - 1, 1), "p elements": p,
             "odd (2p+1)": 2 * p + 1, "medium (1000)": 1000, "large (2^17)": 1 << 17}
    return [(name, n, dtype) for name, n in sizes.items() for dtype in ("int64", "float64")]


def _input(count, dtype, rank):
    rng = np.random.default_rng([count, rank])
    if dtype == "int64":
        return rng.integers(-1000, 1000, size=count).astype(np.int64)
    return rng.standard_normal(count)


def _diagnose(result, expected, x, x_before, p) -> str | None:
    """One line saying what is wrong with this rank's result, or None."""
    if result is None:
        return "returned None"
    result = np.asarray(result)
    if not np.array_equal(x, x_before):
        return "modified its input x (return a new array instead)"
    if result.shape != expected.shape:
        return f"returned shape {result.shape}, expected {expected.shape}"
    if result.dtype != expected.dtype:
        return f"returned dtype {result.dtype}, expected {expected.dtype}"
    if expected.dtype.kind == "f":
        wrong = ~np.isclose(result, expected, rtol=1e-12, atol=1e-12 * p)
    else:
        wrong = result != expected
    if not wrong.any():
        return None
    bounds = block_bounds(expected.size, p)
    blocks = [i for i in range(p) if wrong[bounds[i]:bounds[i + 1]].any()]
    first = int(np.argmax(wrong))
    return (f"{int(wrong.sum())} of {wrong.size} elements wrong, in blocks {blocks} "
            f"(first: element {first} is {result[first].item()!r}, expected {expected[first].item()!r})")


def _summarise(failing: dict) -> str:
    """The most telling failure first (an exception, then wrong values, then timeouts, which are often
    only ranks left waiting for a rank that failed), and which other ranks failed too."""
    if not failing:
        return ""

    def telling(rank):
        text = failing[rank]
        return (0 if text.startswith("raised") else 2 if text.startswith("deadlock") else 1), rank

    first, *others = sorted(failing, key=telling)
    text = f"rank {first}: {failing[first]}"
    if len(others) == 1:
        text += f" (rank {others[0]} also failed: {failing[others[0]]})"
    elif others:
        text += f" (ranks {', '.join(map(str, sorted(others)))} also failed)"
    return text


def check_allreduce(fn, comm=None, *, timeout: float = 5.0, cases=None, stop_at_first_failure=False):
    """Run ``fn(x, comm)`` (an allreduce with op sum) on every rank for each case; return a list of
    dicts (case, count, dtype, ok, problem), identical on every rank. Call it on every rank."""
    base = comm or world()
    report = []
    for name, count, dtype in cases or default_cases(base.size):
        c = base.with_timeout(timeout)  # a fresh duplicate: a broken case's stray messages stay there
        x = _input(count, dtype, base.rank)
        x_before = x.copy()
        expected = getattr(base, "inner", base).builtin_allreduce(x, "sum")  # (past an emulated network)
        result = None
        try:
            result = fn(x, c)
            problem = _diagnose(result, expected, x, x_before, base.size)
        except CommTimeoutError as e:
            problem = f"deadlock or missing message: {e}"
        except Exception as e:  # noqa: BLE001 - the reader's bug, reported rather than raised
            problem = f"raised {type(e).__name__}: {e}"
        digest = None if problem else hashlib.sha256(np.asarray(result).tobytes()).hexdigest()
        verdicts = base.allgather_object((problem, digest))
        failing = {r: v for r, (v, _) in enumerate(verdicts) if v}
        summary = _summarise(failing)
        if not failing and len({d for _, d in verdicts}) > 1:
            failing = {"all": True}
            summary = "correct to rounding, but not bitwise identical on every rank (reduction order differs)"
        report.append({"case": name, "count": count, "dtype": dtype, "ok": not failing, "problem": summary})
        if failing and stop_at_first_failure:
            break
    return report


def format_report(report) -> str:
    """Plain-text summary of a check_allreduce report."""
    passed = sum(r["ok"] for r in report)
    lines = [f"{passed} of {len(report)} cases correct"]
    for r in report:
        mark = "ok   " if r["ok"] else "WRONG"
        problem = textwrap.fill(r["problem"], width=100, subsequent_indent=" " * 33)
        lines.append(f"  {mark} {r['case']:<14} {r['dtype']:<8} {r['count']:>7}  {problem}")
    return "\n".join(lines)
