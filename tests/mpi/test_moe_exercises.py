"""Notebook 09's all-to-all exercise: the solution passes; a deadlocking, a wrong and a wasteful attempt are
reported as such on every rank, within seconds."""

import numpy as np
from mpitest import COMM, agree

from tplab.lab.exercises import check_alltoall, passed, solutions

P = COMM.size


def blocking_sends_first(x, comm):
    """Every rank sends everything before receiving: a deadlock once messages are too large to buffer."""
    out = np.empty_like(x)
    out[comm.rank] = x[comm.rank]
    for k in range(1, comm.size):
        comm.send(np.ascontiguousarray(x[(comm.rank + k) % comm.size]), (comm.rank + k) % comm.size)
    for k in range(1, comm.size):
        comm.recv(out[(comm.rank - k) % comm.size], (comm.rank - k) % comm.size)
    return out


def everything_to_everyone(x, comm):
    """Right values, but the whole input to every rank: p times the bytes."""
    out = np.empty_like(x)
    out[comm.rank] = x[comm.rank]
    whole = np.empty_like(x)
    for k in range(1, comm.size):
        to, frm = (comm.rank + k) % comm.size, (comm.rank - k) % comm.size
        comm.sendrecv(x, to, whole, frm)
        out[frm] = whole[comm.rank]
    return out


def test_the_alltoall_checker():
    agree(passed(check_alltoall(solutions.pairwise_alltoall, progress=False)), "the solution fails")
    if P == 1 or P > 4:  # (the wrong attempts need a few ranks; many oversubscribed ones only cost time)
        return
    report = check_alltoall(lambda x, comm: x.copy(), progress=False, stop_at_first_failure=True)
    agree(any("nothing was exchanged" in r["problem"] for r in report), str(report))
    report = check_alltoall(everything_to_everyone, progress=False, stop_at_first_failure=False)
    agree(any("right values, but sent" in r["problem"] for r in report), str(report))
    report = check_alltoall(blocking_sends_first, timeout=1.0, progress=False, stop_at_first_failure=True)
    agree(not passed(report) and any("within" in r["problem"] or "deadlock" in r["problem"].lower() for r in report),
          str(report))
