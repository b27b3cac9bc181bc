"""The Communicator: point-to-point, counters, timeouts."""

import time

import numpy as np
import pytest
from mpitest import COMM, agree

import tplab
from tplab.comm import CommTimeoutError, MPIComm, world

P = COMM.size
multi_rank = pytest.mark.skipif(P < 2, reason="needs two ranks")


def test_world_is_comm_world():
    c = world()
    agree(c.rank == COMM.rank and c.size == P and world() is c, repr(c))


def test_ring_sendrecv_and_counters():
    c = MPIComm(COMM.Dup())
    right, left = (c.rank + 1) % P, (c.rank - 1) % P
    got = c.sendrecv(np.full(5, c.rank, dtype=np.int64), right, np.empty(5, dtype=np.int64), left)
    agree(np.all(got == left), f"got {got}")
    agree(c.bytes_sent == 40 and c.messages_sent == 1, f"{c.bytes_sent} B, {c.messages_sent} msgs")
    c.reset_counters()
    agree(c.bytes_sent == 0 and c.messages_sent == 0, "reset")


@multi_rank
def test_nonblocking_waited_in_any_order():
    c = MPIComm(COMM.Dup())
    peers = [r for r in range(P) if r != c.rank]
    recvs = {r: c.irecv(np.empty(3), r, tag=7) for r in peers}
    sends = [c.isend(np.full(3, float(c.rank)), r, tag=7) for r in peers]
    for r in reversed(peers):  # wait in the opposite order of posting
        recvs[r].wait()
    c.waitall(sends)
    agree(all(np.all(recvs[r].buf == r) for r in peers), "wrong payloads")
    agree(c.messages_sent == P - 1 and c.bytes_sent == 24 * (P - 1), f"{c.messages_sent}")


def test_counters_ring_allreduce_match_formula():
    """Ring allreduce on n = p*k elements: 2(p-1) messages of n/p elements per rank."""
    c = MPIComm(COMM.Dup())
    k = 6
    tplab.allreduce(np.ones(P * k), c, algorithm="ring")
    agree(c.messages_sent == 2 * (P - 1) and c.bytes_sent == 2 * (P - 1) * k * 8,
          f"{c.messages_sent} msgs, {c.bytes_sent} B")


def test_counters_recursive_doubling_match_formula():
    """Power of two: lg p messages of the whole vector. Otherwise the folded ranks add one each way."""
    c = MPIComm(COMM.Dup())
    n = 10
    tplab.allreduce(np.ones(n), c, algorithm="recursive_doubling")
    pof2 = 1 << (P.bit_length() - 1)
    lg = pof2.bit_length() - 1
    extra = P - pof2
    if c.rank < 2 * extra:
        expected = 1 if c.rank % 2 == 0 else lg + 1
    else:
        expected = lg
    agree(c.messages_sent == expected and c.bytes_sent == expected * n * 8,
          f"{c.messages_sent} msgs (expected {expected})")


def test_builtin_counted_as_nothing():
    """The MPI library's own collectives move bytes we cannot see: they are not counted."""
    c = MPIComm(COMM.Dup())
    tplab.allreduce(np.ones(8), c, algorithm="builtin")
    agree(c.messages_sent == 0, f"{c.messages_sent}")


@multi_rank
def test_timeout_turns_deadlock_into_error():
    c = world(timeout=0.5)
    t0 = time.monotonic()
    try:
        if c.rank == 0:
            c.recv(np.empty(1), 1, tag=3)  # rank 1 never sends
            outcome = "no error"
        else:
            outcome = "not waiting"
    except CommTimeoutError as e:
        outcome = str(e)
    elapsed = time.monotonic() - t0
    if c.rank == 0:
        agree("recv from rank 1" in outcome and "did not complete within 0.5 s" in outcome and elapsed < 5,
              f"{outcome} after {elapsed:.1f} s")
    else:
        agree(True)
