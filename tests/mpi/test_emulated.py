"""EmulatedNetwork: same results as the plain transport, messages between nodes pay latency + n/bandwidth,
the counters see what crossed the network, and the MPI library's own collectives refuse to run.

Ranks oversubscribe the cores, so times are only bounded from below: the model guarantees a minimum
wait, the machine may always add more.
"""

import time

import numpy as np
import pytest
from mpitest import COMM, agree

import tplab
from tplab.toolkit.blocks import block_bounds
from tplab.comm import EmulatedNetwork, MPIComm

P = COMM.size
multi_rank = pytest.mark.skipif(P < 2, reason="needs two ranks")
HAND_WRITTEN = [a for a in tplab.ALGORITHMS["allreduce"] if a not in ("builtin", "auto")]

# made once for the module: the hierarchical algorithm keeps the node split of a communicator
PLAIN = MPIComm(COMM.Dup(), timeout=10, ranks_per_node=2)
NET = EmulatedNetwork(MPIComm(COMM.Dup(), timeout=10), ranks_per_node=2)


@pytest.mark.parametrize("algorithm", HAND_WRITTEN)
def test_same_result_as_on_the_plain_communicator(algorithm):
    """Same algorithm, same nodes, same arithmetic: bitwise the same result."""
    for count in (0, 1, P + 1, 1000):
        for dtype in ("int64", "float32"):
            x = (np.random.default_rng([count, COMM.rank]).standard_normal(count) * 100).astype(dtype)
            on_net = tplab.allreduce(x, NET, algorithm=algorithm)
            plain = tplab.allreduce(x, PLAIN, algorithm=algorithm)
            agree(on_net.tobytes() == plain.tobytes(), f"{algorithm} {dtype} n={count}: results differ")


@multi_rank
def test_a_message_between_nodes_takes_latency_plus_size_over_bandwidth():
    """1 MB at 1 GB/s between two nodes: at least 1 ms at the sender. Inside a node the model adds nothing."""
    message = np.ones(10**6, dtype=np.uint8)
    results = {}
    for name, per_node in (("between nodes", 1), ("inside a node", 2)):
        net = EmulatedNetwork(MPIComm(COMM.Dup(), timeout=10), ranks_per_node=per_node, bandwidth=1e9)
        t0 = time.perf_counter()
        if COMM.rank == 0:
            net.send(message, 1)
        elif COMM.rank == 1:
            net.recv(np.empty_like(message), 0)
        results[name] = (time.perf_counter() - t0, net.charged_seconds, net.message_seconds(message.nbytes, 1))
    between, inside = results["between nodes"], results["inside a node"]
    if COMM.rank == 0:  # (elapsed, charged, model's price) at the sender
        ok = between[0] >= 1e-3 and between[1] == between[2] == 5e-6 + 1e-3 and inside[1] == inside[2] == 0.0
    else:
        ok = True
    agree(ok, f"between nodes {between}, inside a node {inside}")


def ring_sends(r, p, bounds):
    """Sizes of the blocks rank r sends in a ring allreduce: reduce-scatter step s sends block r-s-1,
    allgather step s sends block r-s (ring.py)."""
    size = [bounds[i + 1] - bounds[i] for i in range(p)]
    return [size[(r - s - 1) % p] for s in range(p - 1)] + [size[(r - s) % p] for s in range(p - 1)]


def test_inter_node_bytes_of_a_ring():
    """Nodes of 2 ranks (2 nodes x 2 ranks at p = 4): only the ranks whose right neighbour is on the
    next node (1 -> 2 and 3 -> 0) cross the network, each with every block it sends."""
    count = 4 * P + 3  # uneven blocks
    NET.reset_counters()
    tplab.allreduce(np.ones(count), NET, algorithm="ring")
    r = COMM.rank
    sends = ring_sends(r, P, block_bounds(count, P))
    crosses = r // 2 != ((r + 1) % P) // 2
    want_bytes = 8 * sum(sends) if crosses else 0
    want_messages = len(sends) if crosses else 0
    agree(NET.inter_node_bytes == want_bytes and NET.inter_node_messages == want_messages,
          f"{NET.inter_node_bytes} B in {NET.inter_node_messages} messages, expected {want_bytes} in {want_messages}")
    agree(NET.bytes_sent == 8 * sum(sends), f"{NET.bytes_sent} B sent in all")


def test_splits_are_emulated_networks_on_the_same_nodes():
    local, cross = NET.split_by_node()
    twin = NET.with_timeout(3)
    agree(isinstance(local, EmulatedNetwork) and isinstance(cross, EmulatedNetwork), f"{local!r} {cross!r}")
    agree(cross.node_ids() == list(range(cross.size)) and set(local.node_ids()) == {0}, "node ids")
    agree(twin.node_ids() == NET.node_ids() and twin.timeout == 3 and twin.network == NET.network, repr(twin))
    NET.reset_counters()
    cross.reset_counters()
    if cross.size > 1:  # one message to the next node on my cross ring is inter-node, on both levels
        right, left = (cross.rank + 1) % cross.size, (cross.rank - 1) % cross.size
        cross.sendrecv(np.ones(5), right, np.empty(5), left)
        agree(cross.inter_node_bytes == 40 and NET.inter_node_bytes == 40 and NET.inter_node_messages == 1,
              f"cross {cross.inter_node_bytes} B, parent {NET.inter_node_bytes} B")
    else:
        agree(True)


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"])
def test_builtin_collectives_refuse_to_run(collective):
    try:
        getattr(tplab, collective)(np.ones(4), NET, algorithm="builtin")
        ok, message = False, "no error"
    except NotImplementedError as e:
        message = str(e)
        ok = "past the emulated network" in message and "cannot be charged" in message
    agree(ok, message)
