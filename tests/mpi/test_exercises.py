"""The exercise checkers tell right from wrong, say why, and turn a reader's deadlock or exception into a report.

Every solution in tplab.lab.exercises.solutions passes its checker; typical wrong attempts fail with the
hint a reader needs. Small cases and short deadlines: the whole file takes seconds at any rank count.
"""

import time

import numpy as np
import pytest
from mpitest import COMM, agree

from tplab.lab.exercises import (
    check_allgather_attention,
    check_allreduce,
    check_column_parallel,
    check_overlapped_mlp,
    check_parallel_run,
    check_reduce_scatter,
    check_row_parallel,
    format_report,
    passed,
    solutions,
)
from tplab.toolkit.blocks import block_bounds

P = COMM.size
CASES = [("p elements", P, "int64"), ("odd", 2 * P + 1, "float64"), ("large", 1 << 17, "float64")]
ring_allreduce = solutions.ring_allreduce


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


def whole_vectors_reduce_scatter(x, comm):
    """Right values, but every step passes a whole vector around the ring: (p-1)·n bytes, not (p-1)/p·n."""
    p, r = comm.size, comm.rank
    total, current = x.copy(), x.copy()
    for _ in range(p - 1):
        current = comm.sendrecv(current, (r + 1) % p, np.empty_like(current), (r - 1) % p)
        total += current
    b = block_bounds(x.size, p)
    return total[b[r]:b[r + 1]].copy()


def test_solutions_pass():
    reports = [check_allreduce(ring_allreduce, cases=CASES, algorithm="ring", progress=False),
               check_reduce_scatter(solutions.ring_reduce_scatter, cases=CASES, progress=False),
               check_column_parallel(solutions.column_parallel_forward, progress=False),
               check_row_parallel(solutions.row_parallel_forward, progress=False),
               check_allgather_attention(solutions.allgather_attention, progress=False),
               check_overlapped_mlp(solutions.overlapped_mlp, progress=False),
               check_parallel_run(solutions.parallel_run, progress=False)]
    agree(all(passed(r) for r in reports), "\n".join(format_report(r) for r in reports))


def test_full_default_cases_pass():
    reports = [check_allreduce(ring_allreduce, timeout=10, algorithm="ring", progress=False),
               check_reduce_scatter(solutions.ring_reduce_scatter, timeout=10, progress=False)]
    agree(all(passed(r) for r in reports), "\n".join(format_report(r) for r in reports))


@pytest.mark.skipif(P < 2, reason="needs two ranks")
def test_identity_is_named():
    report = check_allreduce(lambda x, comm: x.copy(), cases=CASES[:1], progress=False)
    agree(not report[0]["ok"] and "every rank: your result equals your input: nothing was reduced"
          in report[0]["problem"], format_report(report))


@pytest.mark.skipif(P < 2, reason="needs two ranks")
def test_only_rank_0_right():
    def root_only(x, comm):
        total = send_then_receive_everything(x, comm)
        return total if comm.rank == 0 else x.copy()

    report = check_allreduce(root_only, cases=CASES[:1], progress=False)
    agree(not report[0]["ok"] and report[0]["problem"].startswith("only rank 0 has the right result"),
          format_report(report))


@pytest.mark.skipif(P < 2, reason="needs two ranks")
def test_wrong_blocks_are_named():
    def off_by_one(x, comm):
        y = ring_allreduce(x, comm)
        b = block_bounds(y.size, comm.size)
        y[b[1]:b[2]] += 1
        return y

    report = check_allreduce(off_by_one, cases=CASES[:1], timeout=10, progress=False)
    agree(not report[0]["ok"] and "in blocks [1]" in report[0]["problem"], format_report(report))


@pytest.mark.skipif(P < 2, reason="a deadlock needs two ranks")
def test_deadlock_is_reported_not_hung():
    started = time.monotonic()
    report = check_allreduce(send_then_receive_everything, cases=CASES, timeout=1.0, progress=False)
    small, large = report[0], report[-1]
    agree(small["ok"] and not large["ok"] and "did not complete within 1 s" in large["problem"]
          and "send_then_receive_everything, line 5 of the function" in large["problem"]
          and time.monotonic() - started < 10, format_report(report))


@pytest.mark.skipif(P < 2, reason="needs two ranks")
def test_exception_on_one_rank_ends_the_case_at_once():
    def fails_on_rank_1(x, comm):
        if comm.rank == 1:
            raise IndexError("block 7 does not exist")
        return ring_allreduce(x, comm)

    started = time.monotonic()
    report = check_allreduce(fails_on_rank_1, cases=CASES[:1], timeout=20.0, progress=False)  # no waiting for 20 s
    problem = report[0]["problem"]
    agree(not report[0]["ok"] and problem.startswith("rank 1: raised IndexError: block 7")
          and "in fails_on_rank_1, line 3 of the function" in problem and "test_exercises.py:" in problem
          and time.monotonic() - started < 5, format_report(report))


@pytest.mark.skipif(P < 3, reason="with two ranks both orders give the same sum")
def test_not_bitwise_identical_is_caught():
    report = check_allreduce(own_order_sum, cases=[("floats", 4000, "float64")], timeout=10, progress=False)
    agree(not report[0]["ok"] and "not bitwise identical" in report[0]["problem"], format_report(report))


@pytest.mark.skipif(P < 2, reason="one rank sends nothing")
def test_wrong_byte_count():
    report = check_reduce_scatter(whole_vectors_reduce_scatter, cases=CASES[:1], progress=False)
    agree(not report[0]["ok"] and "instead of one block (n/p)" in report[0]["problem"], format_report(report))
    report = check_allreduce(send_then_receive_everything, cases=CASES[:1], algorithm="ring", progress=False)
    agree(P == 2 or (not report[0]["ok"] and "right values, but sent" in report[0]["problem"]), format_report(report))


@pytest.mark.skipif(P < 2, reason="needs two ranks")
def test_reduce_scatter_wrong_block():
    def next_block(x, comm):
        total = send_then_receive_everything(x, comm)
        b = block_bounds(x.size, comm.size)
        k = (comm.rank + 1) % comm.size
        return total[b[k]:b[k + 1]].copy()

    report = check_reduce_scatter(next_block, cases=CASES[:1], wire=False, progress=False)
    agree(not report[0]["ok"] and "returned the sum of block" in report[0]["problem"], format_report(report))


def test_skeleton_reports_not_written():
    def skeleton(x, comm):
        raise NotImplementedError("fill in the ring")

    started = time.monotonic()
    report = check_allreduce(skeleton, progress=False)
    agree(not any(r["ok"] for r in report) and "not written yet" in report[0]["problem"]
          and time.monotonic() - started < 10, format_report(report))


@pytest.mark.skipif(P < 2, reason="f and g do nothing on one rank")
def test_megatron_typical_mistakes():
    from tplab.layers.mappings import reduce_from_tensor_parallel_region

    def column_without_f(x, weight, bias, comm):
        return x @ weight.T + bias

    def row_without_g(x, weight, bias, comm):
        return x @ weight.T + bias

    def row_bias_before_g(x, weight, bias, comm):
        return reduce_from_tensor_parallel_region(x @ weight.T + bias, comm)

    expected = [(check_column_parallel, column_without_f, "x.grad holds only this rank's share"),
                (check_row_parallel, row_without_g, "each rank holds only its partial product"),
                (check_row_parallel, row_bias_before_g, "the bias was added p times")]
    for checker, attempt, hint in expected:
        report = checker(attempt, progress=False)
        agree(not report[0]["ok"] and hint in report[0]["problem"], format_report(report))


def gathered(t, comm):
    """(b, n, s/p, d) on every rank -> (b, n, s, d), with the ring all-gather."""
    import tplab

    flat = tplab.allgather(t.movedim(2, 0).contiguous(), comm, algorithm="ring")
    return flat.reshape(comm.size * t.shape[2], t.shape[0], t.shape[1], t.shape[3]).movedim(0, 2)


@pytest.mark.skipif(P < 2, reason="one rank holds every key")
def test_attention_typical_mistakes():
    from tplab.layers.attend import attend

    def own_keys(q, k, v, causal, comm):
        return attend(q, k, v, causal=causal)

    def bottom_right(q, k, v, causal, comm):
        return attend(q, gathered(k, comm), gathered(v, comm), causal=causal)

    def queries_too(q, k, v, causal, comm):
        gathered(q, comm)
        return solutions.allgather_attention(q, k, v, causal, comm)

    expected = [(own_keys, "you attended to your own tokens' keys only"),
                (bottom_right, "causal mask aligned to the last rank (bottom right)"),
                (queries_too, "did the queries travel too?")]
    for attempt, hint in expected:
        report = check_allgather_attention(attempt, progress=False, stop_at_first_failure=True)
        agree(not report[0]["ok"] and hint in report[0]["problem"], format_report(report))


@pytest.mark.skipif(P < 2, reason="nothing to reduce on one rank")
def test_overlapped_mlp_typical_mistakes():
    import torch

    import tplab
    from tplab.overlap import iallreduce
    from tplab.overlap.pipeline import chunk_bounds

    def chunks_of(x, w1, b1, w2, k):
        for start, end in chunk_bounds(x.shape[0], k):
            yield torch.nn.functional.gelu(x[start:end] @ w1.T + b1) @ w2.T

    def blocking(x, w1, b1, w2, b2, k, comm):
        return torch.cat([tplab.allreduce(c, comm, algorithm="ring") for c in chunks_of(x, w1, b1, w2, k)]) + b2

    def waits_at_once(x, w1, b1, w2, b2, k, comm):
        return torch.cat([iallreduce(c, comm, algorithm="ring").wait() for c in chunks_of(x, w1, b1, w2, k)]) + b2

    def bias_in_every_rank(x, w1, b1, w2, b2, k, comm):
        handles = [iallreduce(c + b2, comm, algorithm="ring") for c in chunks_of(x, w1, b1, w2, k)]
        return torch.cat([h.wait() for h in handles])

    expected = [(blocking, "no nonblocking all-reduce was started"), (waits_at_once, "nothing overlapped"),
                (bias_in_every_rank, "b2 was added p times")]
    for attempt, hint in expected:
        report = check_overlapped_mlp(attempt, progress=False, stop_at_first_failure=True)
        agree(any(hint in r["problem"] for r in report), format_report(report))


@pytest.mark.skipif(P < 2, reason="one rank: nothing to add up")
def test_parallel_run_typical_mistakes():
    import tplab

    def streams_summed(x, blocks, comm):
        mine = x.copy()
        for block in blocks:
            mine = mine + block(mine)
        return tplab.allreduce(mine, comm, algorithm="ring")

    def sync_every_block(x, blocks, comm):
        for block in blocks:
            x = x + tplab.allreduce(block(x), comm, algorithm="ring")
        return x

    expected = [(streams_summed, "x counted p times"), (sync_every_block, "you summed after every block")]
    for attempt, hint in expected:
        report = check_parallel_run(attempt, progress=False, stop_at_first_failure=True)
        agree(any(hint in r["problem"] for r in report), format_report(report))
