"""The exercise checker under a reader's typical failures, with the default cases and deadline: each is
reported quickly (<= 15 s at p = 4), says what happened and where in the reader's code, and says it the
same way on every rank.

- an exception on one rank ends that case at once, with the rank and file:line of the ``raise``;
- a blocking send that deadlocks costs one deadline, not one per case (the other cases are not run);
- a result equal to the input gets a hint.
"""

import time

import numpy as np
import pytest
from mpitest import COMM, agree

from tplab.lab.exercises import check_allreduce, format_report

P = COMM.size
# the default 5-s deadline where the time limit is asserted (p = 4); elsewhere a short one, to keep the suite fast
DEADLINE = 5.0 if P == 4 else 1.0
LIMIT = 15.0


def returns_its_input(x, comm):
    return x.copy()


def blocking_ring(x, comm):
    p, r = comm.size, comm.rank
    total, block = x.copy(), x.copy()
    for _ in range(p - 1):
        comm.send(block, (r + 1) % p)   # every rank sends first: fine while MPI buffers, a deadlock when not
        block = comm.recv(np.empty_like(block), (r - 1) % p)
        total = total + block
    return total


def raises_on_rank_1(x, comm):
    if comm.rank == 1:
        raise KeyError("rank 1's block")
    return comm.recv(np.empty_like(x), 1)   # the others wait for rank 1, which never sends


@pytest.mark.skipif(P < 2, reason="on one rank the input is the answer")
def test_identity_gets_a_hint():
    started = time.monotonic()
    report = check_allreduce(returns_its_input, timeout=DEADLINE, progress=False)
    wrong = [r for r in report if not r["ok"]]
    agree(wrong and all("your result equals your input: nothing was reduced" in r["problem"] for r in wrong)
          and time.monotonic() - started < LIMIT, format_report(report))


@pytest.mark.skipif(P < 2, reason="a deadlock needs two ranks")
def test_a_deadlock_costs_one_deadline():
    started = time.monotonic()
    report = check_allreduce(blocking_ring, timeout=DEADLINE, progress=False)
    seconds = time.monotonic() - started
    deadlocked = [i for i, r in enumerate(report) if "did not complete within" in r["problem"]]
    agree(len(deadlocked) == 1 and "in blocking_ring, line 5 of the function (test_checker_failures.py:"
          in report[deadlocked[0]]["problem"]
          and all(r["problem"].startswith("not run: case") for r in report[deadlocked[0] + 1:])
          and seconds < LIMIT and seconds < 2 * DEADLINE + 5, f"{seconds:.1f} s\n{format_report(report)}")


@pytest.mark.skipif(P < 2, reason="needs two ranks")
def test_an_exception_on_one_rank_is_reported_at_once():
    started = time.monotonic()
    report = check_allreduce(raises_on_rank_1, timeout=DEADLINE, progress=False)
    seconds = time.monotonic() - started
    problem = report[0]["problem"]
    agree(not any(r["ok"] for r in report) and problem.startswith("rank 1: raised KeyError")
          and "in raises_on_rank_1, line 3 of the function (test_checker_failures.py:" in problem
          and 'raise KeyError("rank 1' in problem and seconds < min(LIMIT, DEADLINE),
          f"{seconds:.1f} s\n{format_report(report)}")
