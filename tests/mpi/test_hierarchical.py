"""Hierarchical allreduce, and the node topology it runs on (node_of, split_by_node), on every rank.

Nodes are emulated with ``ranks_per_node`` (1, 2, 3 and p: many one-rank nodes, pairs, triples that
leave an uneven last node for most p, and one node), so every layout runs on one machine.
"""

import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpitest import COMM, abort_on_exception, agree, rearm_watchdog, same_on_every_rank
from test_collectives import DTYPES, LAYOUTS, OPS, abs_sum, check_common, counts, make_input, matches, needs_scale

import tplab
from tplab.collectives.snapshots import recording
from tplab.comm import EmulatedNetwork, MPIComm

P = COMM.size
RANKS_PER_NODE = sorted({1, 2, 3, P})
# One communicator per layout, made once: split_by_node() keeps its sub-communicators for reuse.
COMMS = {q: MPIComm(COMM.Dup(), timeout=10, ranks_per_node=q) for q in RANKS_PER_NODE}


def expected_nodes(q):
    return [r // q for r in range(P)]


# ---- node topology ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("q", RANKS_PER_NODE)
def test_split_by_node_groups_the_right_ranks(q):
    c = COMMS[q]
    local, cross = c.split_by_node()
    node, local_index = COMM.rank // q, COMM.rank % q
    want_local = [r for r in range(P) if r // q == node]
    want_cross = [r for r in range(P) if r % q == local_index]  # ordered by node, as rank // q is
    got_local, got_cross = local.allgather_object(COMM.rank), cross.allgather_object(COMM.rank)
    agree(c.node_ids() == expected_nodes(q) and all(c.node_of(r) == r // q for r in range(P)), f"{c.node_ids()}")
    agree(got_local == want_local and local.rank == local_index, f"local {got_local} != {want_local}")
    agree(got_cross == want_cross and cross.rank == node, f"cross {got_cross} != {want_cross}")
    agree(cross.node_ids() == list(range(cross.size)) and set(local.node_ids()) == {0}, "sub-communicator nodes")
    agree(local.timeout == 10 and cross.timeout == 10, "split lost the timeout")
    agree(c.split_by_node() == (local, cross), "split_by_node() made new communicators on a second call")


def test_split_keeps_the_parents_nodes():
    """Without rank 0, ranks 1..p-1 of 2-rank nodes sit on nodes 0, 1, 1, 2, 2, ...: not rank // 2."""
    c = COMMS[2]
    sub = c.split(color=0 if COMM.rank > 0 else 1)
    if COMM.rank > 0:
        want = [(r + 1) // 2 for r in range(P - 1)]
        ok = sub.node_ids() == want and sub.timeout == 10
        again = sub.with_timeout(5)  # a duplicate keeps the explicit layout too
        ok = ok and again.node_ids() == want and again.timeout == 5
        detail = f"{sub.node_ids()} / {again.node_ids()} != {want}"
    else:
        ok, detail = sub.node_ids() == [0] and sub.size == 1, f"{sub.node_ids()}"
    agree(ok, detail)


def test_with_timeout_carries_ranks_per_node():
    twin = COMMS[2].with_timeout(3)
    agree(twin.ranks_per_node == 2 and twin.node_ids() == expected_nodes(2) and twin.timeout == 3, repr(twin))


def test_real_nodes_detected():
    """Under mpiexec on one machine every rank shares memory with every other: one node. Across the
    network namespaces of ``tplab nodes`` (tests/test_nodes.py sets TPLAB_NODES_RANKS_PER_NODE) MPI finds
    the real nodes, q consecutive ranks each, and hierarchical splits by them."""
    q = min(int(os.environ.get("TPLAB_NODES_RANKS_PER_NODE", P)), P)
    c = MPIComm(COMM.Dup())
    agree(c.node_ids() == expected_nodes(q) and c.ranks_per_node == q,
          f"{c.node_ids()} (ranks_per_node {c.ranks_per_node}), expected {q} ranks per node")
    local, cross = c.split_by_node()
    want_local = [r for r in range(P) if r // q == COMM.rank // q]
    want_cross = [r for r in range(P) if r % q == COMM.rank % q]
    agree(local.allgather_object(COMM.rank) == want_local and cross.allgather_object(COMM.rank) == want_cross,
          f"local {local.size}, cross {cross.size}")


def test_bad_ranks_per_node():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="ranks_per_node"):
            MPIComm(COMM, ranks_per_node=bad)


# ---- the algorithm ------------------------------------------------------------------------------------------
@given(count=counts, dtype=st.sampled_from(DTYPES), op=st.sampled_from(OPS),
       ranks_per_node=st.sampled_from(RANKS_PER_NODE), layout=st.sampled_from(LAYOUTS),
       seed=st.integers(0, 2**16))
@abort_on_exception
def test_hierarchical_matches_builtin(count, dtype, op, ranks_per_node, layout, seed):
    rearm_watchdog()
    agree(same_on_every_rank((count, dtype, op, ranks_per_node, layout, seed)), "ranks drew different examples")
    comm = COMMS[ranks_per_node]
    x = make_input(count, dtype, op, seed, layout)
    before = np.asarray(x).tobytes()
    result = tplab.allreduce(x, comm, op=op, algorithm="hierarchical")
    reference = comm.builtin_allreduce(np.ascontiguousarray(x), op)
    scale = abs_sum(x) if needs_scale(op, dtype) else None
    problems = check_common(result, x, before, x.shape, dtype)
    ok, why = matches(result, reference, op, scale)
    agree(ok and not problems, f"{ranks_per_node}/node {op} {dtype} n={count} {layout}: {why if not ok else ''} "
                               f"{problems}")
    agree(same_on_every_rank(result.tobytes()), f"{ranks_per_node}/node: results differ between ranks")


@pytest.mark.parametrize("q", RANKS_PER_NODE)
def test_large_message(q):
    count = 3 * 2**17 + 5
    x = make_input(count, "float64", "sum", 7, "contiguous")
    result = tplab.allreduce(x, COMMS[q], algorithm="hierarchical")
    ok, why = matches(result, COMMS[q].builtin_allreduce(x, "sum"), "sum", abs_sum(x))
    agree(ok, why)
    agree(same_on_every_rank(result.tobytes()), "results differ between ranks")


@pytest.mark.parametrize("q", [q for q in range(1, P + 1) if P % q == 0])
def test_only_one_qth_crosses_the_network(q):
    """N nodes of q ranks, n bytes per rank (whole blocks): each rank sends 2(q-1)/q n inside its node and
    2(N-1)/N n/q across nodes, in 2(q-1) and 2(N-1) messages."""
    nodes = P // q
    net = EmulatedNetwork(MPIComm(COMM.Dup(), timeout=10), ranks_per_node=q)
    x = np.ones(8 * P)
    n = x.nbytes
    result = tplab.allreduce(x, net, algorithm="hierarchical")
    across = 2 * (nodes - 1) * n // (nodes * q)
    inside = 2 * (q - 1) * n // q
    agree(np.all(result == P), f"result {result[:4]}")
    agree(net.inter_node_bytes == across and net.inter_node_messages == 2 * (nodes - 1),
          f"{q}/node: {net.inter_node_bytes} B in {net.inter_node_messages} messages across nodes, "
          f"expected {across} B in {2 * (nodes - 1)}")
    agree(net.bytes_sent == inside + across and net.messages_sent == 2 * (q - 1) + 2 * (nodes - 1),
          f"{q}/node: {net.bytes_sent} B in {net.messages_sent} messages, expected {inside + across} B")


@pytest.mark.parametrize("q", RANKS_PER_NODE)
def test_snapshots_end_with_every_contribution(q):
    x = np.full(2 * P + 1, 2**COMM.rank, dtype=np.int64)
    with recording() as steps:
        result = tplab.allreduce(x, COMMS[q], algorithm="hierarchical")
    rounds = [k for _, _, k in steps]
    agree(steps and steps[0][0] == "start" and rounds == sorted(rounds), f"{[(s[0], s[2]) for s in steps]}")
    agree(np.all(result == 2**P - 1), f"result {result}")
    if P > 1:
        agree(np.array_equal(steps[-1][1], result), f"last snapshot {steps[-1]} != result")
    if P > q:
        agree(any(label.startswith("across nodes") for label, _, _ in steps) or COMM.rank % q != 0,
              "no inter-node phase in the pictures")
