"""Hierarchical allreduce: what NCCL and Horovod do on several machines.

Inside a node ranks share memory (or NVLink: hundreds of GB/s); between nodes they share a network
(tens of GB/s). A flat ring sends 2(p-1)/p n bytes per rank, and the slowest links in the ring, those
that cross nodes, carry as much as any other. The hierarchical allreduce sends most bytes on the fast
links and only a fraction across the slow ones. With N nodes of q ranks (p = N q):

    1. reduce-scatter inside the node      ring over the q local ranks: I hold block i (my local
                                           index) of my node's sum                 2(q-1)/q n  fast
    2. allreduce block i across the nodes  ring over the N ranks that hold block i: 2(N-1)/N n/q  slow
    3. allgather inside the node           ring over the q local ranks            (counted in 1.)

    time  ~  2(q-1) a_intra + 2(q-1)/q n b_intra  +  2(N-1) a_inter + 2(N-1)/N (n/q) b_inter

Only 1/q of the data crosses the network, and the q ranks of a node cross it at the same time, each
with its own block (on GPUs: one NIC per GPU). It wins when the network is much slower than the
links inside a node and messages are large; for small messages the 2(q-1) + 2(N-1) latencies lose
to a log p algorithm.

Blocks inside the node are cut like ``numpy.array_split`` over q, and block i is cut again over N for
the ring across nodes. That needs every node to hold the same number of ranks, so that block i means
the same elements everywhere. If the nodes are uneven (5 ranks, 2 per node: nodes of 2, 2 and 1) the
algorithm falls back to the leader scheme: binomial reduce to the first rank of each node, ring
allreduce of the whole vector among those leaders, binomial broadcast inside each node. Correct, but
the whole vector crosses the network.

The node layout comes from the communicator (``comm.split_by_node()``: ``MPIComm(..., ranks_per_node=q)``
or the real nodes); ``tplab.comm.EmulatedNetwork`` makes the links between nodes slow on one machine.
"""

from __future__ import annotations

import contextlib
from collections import Counter

from tplab.toolkit.blocks import block_bounds
from tplab.collectives import snapshots
from tplab.collectives.binomial import binomial_broadcast, binomial_reduce
from tplab.collectives.ring import ring_allgather_blocks, ring_allreduce, ring_reduce_scatter_blocks
from tplab.collectives.snapshots import snapshot


@contextlib.contextmanager
def phase(name: str, after_round: int):
    """Snapshots taken by a sub-algorithm (which counts its rounds from 0, on a sub-communicator) become
    "<name>: <label>" at rounds after ``after_round``; its own "start" is dropped (the picture has one)."""
    if not snapshots.is_recording():  # not recording: nothing to relabel
        yield
        return
    with snapshots.recording() as steps:
        yield
    for label, buf, at_round in steps:
        if label != "start":
            snapshot(f"{name}: {label}", buf, at_round=after_round + at_round)


def hierarchical_allreduce(buf, comm, op):
    local, cross = comm.split_by_node()
    ranks_on_each_node = Counter(comm.node_ids()).values()
    if len(set(ranks_on_each_node)) > 1:
        return leader_allreduce(buf, comm, op, local, cross)
    q, nodes = local.size, cross.size
    snapshot("start", buf, at_round=0)

    # 1. reduce-scatter inside the node: afterwards I hold my node's sum of block local.rank
    local_bounds = block_bounds(buf.size, q)
    with phase("within node", after_round=0):
        ring_reduce_scatter_blocks(buf, local, op, local_bounds)

    # 2. allreduce that block across the nodes, with the rank that holds the same block on every node
    #    (the ring works on buf in place; its blocks are pieces of my block)
    lo, hi = local_bounds[local.rank], local_bounds[local.rank + 1]
    my_block_cut_over_nodes = [lo + b for b in block_bounds(hi - lo, nodes)]
    with phase("across nodes", after_round=q - 1):
        ring_allreduce(buf, cross, op, my_block_cut_over_nodes)

    # 3. allgather inside the node: every rank gets every finished block
    with phase("within node", after_round=q - 1 + 2 * (nodes - 1)):
        ring_allgather_blocks(buf, local, local_bounds)
    return buf


def leader_allreduce(buf, comm, op, local, cross):
    """Uneven nodes: reduce to each node's first rank, allreduce among those leaders, broadcast back."""
    ranks_on_each_node = Counter(comm.node_ids()).values()
    reduce_rounds = (max(ranks_on_each_node) - 1).bit_length()  # ceil(lg q) on the fullest node
    leader_rounds = 2 * (len(ranks_on_each_node) - 1)
    snapshot("start", buf, at_round=0)

    with phase("within node", after_round=0):
        binomial_reduce(buf, local, op, root=0)
    if local.rank == 0:  # the leaders: local index 0, so their cross communicator is all the leaders
        with phase("across nodes", after_round=reduce_rounds):
            ring_allreduce(buf, cross, op, block_bounds(buf.size, cross.size))
    with phase("within node", after_round=reduce_rounds + leader_rounds):
        binomial_broadcast(buf, local, root=0)
    return buf
