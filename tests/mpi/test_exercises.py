"""The exercise checker tells right from wrong, and turns a reader's deadlock into a report."""

import numpy as np
import pytest
from mpitest import COMM, agree

from tplab.toolkit.blocks import block_bounds
from tplab.lab.exercises import check_allreduce, format_report

P = COMM.size
CASES = [("p elements", P, "int64"), ("odd", 2 * P + 1, "float64"), ("large", 1 << 17, "float64")]


def ring_allreduce(x, comm):
    p, r = comm.size, comm.rank
    buf = x.copy()
    b = block_bounds(buf.size, p)
    tmp = np.empty_like(buf)
    for s in range(p - 1):
        send, recv = (r - s) % p, (r - s - 1) % p
        got = comm.sendrecv(buf[b[send]:b[send + 1]], (r + 1) % p, tmp[: b[recv + 1] - b[recv]], (r - 1) % p)
        buf[b[recv]:b[recv + 1]] += got
    for s in range(p - 1):
        send, recv = (r + 1 - s) % p, (r - s) % p
        comm.sendrecv(buf[b[send]:b[send + 1]], (r + 1) % p, buf[b[recv]:b[recv + 1]], (r - 1) % p)
    return buf


def send_then_receive_everything(x, comm):
    """Blocking send before receive: fine while MPI buffers the message (eager), a deadlock when not."""
    total = x.copy()
    for k in range(1, comm.size):
        comm.send(x, (comm.rank + k) % comm.size)
        total += comm.recv(np.empty_like(x), (comm.rank - k) % comm.size)
    return total


def own_order_sum(x, comm):
    """Right to rounding, but each rank adds in its own order: not bitwise identical."""
    parts = [None] * comm.size
    parts[comm.rank] = x
    reqs = [comm.isend(x, r) for r in range(comm.size) if r != comm.rank]
    for r in range(comm.size):
        if r != comm.rank:
            parts[r] = comm.recv(np.empty_like(x), r)
    comm.waitall(reqs)
    total = np.zeros_like(x)
    for k in range(comm.size):
        total += parts[(comm.rank + k) % comm.size]
    return total


def test_correct_ring_passes():
    report = check_allreduce(ring_allreduce, timeout=10)
    agree(all(r["ok"] for r in report), format_report(report))


@pytest.mark.skipif(P < 2, reason="needs two ranks")
def test_wrong_blocks_are_named():
    def off_by_one(x, comm):
        y = ring_allreduce(x, comm)
        b = block_bounds(y.size, comm.size)
        y[b[1]:b[2]] += 1
        return y

    report = check_allreduce(off_by_one, cases=CASES[:1], timeout=10)
    agree(not report[0]["ok"] and "in blocks [1]" in report[0]["problem"], format_report(report))


@pytest.mark.skipif(P < 2, reason="a deadlock needs two ranks")
def test_deadlock_is_reported_not_hung():
    report = check_allreduce(send_then_receive_everything, cases=CASES, timeout=1.0)
    small, large = report[0], report[-1]
    agree(small["ok"] and not large["ok"] and "did not complete within 1 s" in large["problem"],
          format_report(report))


@pytest.mark.skipif(P < 2, reason="needs two ranks")
def test_exception_on_one_rank():
    def fails_on_rank_1(x, comm):
        if comm.rank == 1:
            raise IndexError("block 7 does not exist")
        return ring_allreduce(x, comm)

    report = check_allreduce(fails_on_rank_1, cases=CASES[:1], timeout=1.0)
    agree(not report[0]["ok"] and "rank 1: raised IndexError: block 7" in report[0]["problem"], format_report(report))


@pytest.mark.skipif(P < 3, reason="with two ranks both orders give the same sum")
def test_not_bitwise_identical_is_caught():
    report = check_allreduce(own_order_sum, cases=[("floats", 4000, "float64")], timeout=10)
    agree(not report[0]["ok"] and "not bitwise identical" in report[0]["problem"], format_report(report))
