"""Two kinds of links: fast inside a node (NVLink, shared memory), slow between nodes (the network).

Ranks sit on nodes in blocks: ranks 0..q-1 on node 0, q..2q-1 on node 1, ... (q = ranks_per_node, as
``mpiexec`` places them by default). Every step of an algorithm is a set of messages in flight at once;
the step lasts as long as its **slowest link**:

    step time = max over its messages of (α + m·β) of the link it takes   (intra or inter)

That one rule is the whole model. What it says about the algorithms (p ranks, N = p/q nodes):

    ring                a ring over several nodes always has a link that crosses: every one of the
                        2(p-1) steps runs at network speed, 2(p-1)(α₂ + n/p·β₂) + ...
    recursive_doubling  steps with distance mask >= q cross: lg q fast steps, lg N slow ones, all with n
    rabenseifner        the first halving steps (largest mask) cross, with n/2, n/4, ...: the slow links
                        carry (p-q)/p·n each way, the fast ones (q-1)/p·n
    naive, tree         the root's messages to other nodes are slow, the ones inside its node fast
    hierarchical        ring reduce-scatter inside each node, ring allreduce across nodes on the node's
                        n/q block, ring allgather inside each node:
                          (q-1)(α₁ + n/q·β₁ + n/q·γ)                 reduce-scatter in the node
                        + 2(N-1)(α₂ + n/p·β₂) + (N-1) n/p·γ          allreduce across nodes
                        + (q-1)(α₁ + n/q·β₁)                         allgather in the node
                        only 2(N-1) steps touch the network, each carrying n/p. (Nodes of unequal size:
                        tplab reduces to one leader per node, allreduces among leaders, broadcasts back.)

Simplifications, said out loud: each rank has its own link to other nodes (q ranks crossing at once do
not share the node's network card: GPU nodes with a NIC per GPU) unless ``shared_link=True`` says the
node has one link for all its ranks (a CPU node with one NIC, or tplab.nodes' one interface per node):
then a step's messages leaving one node for others share its bandwidth, each m bytes costing k·m·β₂
when k of them leave the node together. Ring and leader steps have one such message per node, the
hierarchical step across nodes has q, recursive doubling's and Rabenseifner's crossing steps p/N. And
reductions run at one speed γ (the intra machine's: the sum is done in a node's memory whichever link
brought the data). With intra == inter every algorithm but the
hierarchical one costs exactly what the one-level model (formulas.py) says, which the tests check.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tplab.collectives.fold import PowerOfTwoFold, largest_power_of_two_at_most
from tplab.cost.formulas import Blocks, Machine, ceil_lg, check_size, halving_distances, unknown


@dataclass(frozen=True)
class TwoLevelMachine:
    """Nodes of ``ranks_per_node`` consecutive ranks: ``intra`` links inside a node, ``inter`` between."""

    intra: Machine  # links between ranks on the same node
    inter: Machine  # links between ranks on different nodes
    ranks_per_node: int
    name: str = ""
    shared_link: bool = False  # True: the q ranks of a node share one link to the other nodes

    def __post_init__(self):
        if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) \
                or self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive int, got {self.ranks_per_node!r}")

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def link(self, a: int, b: int) -> Machine:
        return self.intra if self.node_of(a) == self.node_of(b) else self.inter

    @property
    def gamma(self) -> float:
        return self.intra.gamma

    def step(self, messages) -> float:
        """One step: ``messages`` = (source, destination, bytes) all in flight together; the slowest sets
        the pace. (A sendrecv pair is one message each way over the same full-duplex link.) Plus the
        Python bookkeeping of a step (``Machine.step``, 0 in the lecture model), done on the node."""
        if not messages:
            return 0.0
        leaving = Counter(self.node_of(a) for a, b, _ in messages if self.node_of(a) != self.node_of(b))
        def cost(a, b, nbytes):
            link = self.link(a, b)
            share = leaving[self.node_of(a)] if self.shared_link and self.node_of(a) != self.node_of(b) else 1
            return link.alpha + share * nbytes * link.beta
        return self.intra.step + max(cost(a, b, nbytes) for a, b, nbytes in messages)


# ---- folding (fold.py): the first 2r ranks pair up -----------------------------------------------------------
def _fold_in_and_out(p, nbytes):
    """The messages of the fold step (even rank 2i <-> odd rank 2i+1, i < r), each of ``nbytes``."""
    r = p - largest_power_of_two_at_most(p)
    return [(2 * i, 2 * i + 1, nbytes) for i in range(r)]


def _pairs(p, mask, bytes_sent_by):
    """The messages of a recursive doubling/halving step with distance ``mask``: active rank i exchanges
    with i XOR mask; ``bytes_sent_by(i)`` says how much new rank i sends. Real ranks as fold.py maps them."""
    fold = PowerOfTwoFold(p, 0)
    return [(fold.real_rank(i), fold.real_rank(i ^ mask), bytes_sent_by(i)) for i in range(fold.pof2)]


# ---- the allreduce algorithms ---------------------------------------------------------------------------
def _ring(p, n, m: TwoLevelMachine, itemsize):
    link = m.inter if m.node_of(p - 1) > 0 else m.intra  # more than one node: some ring link crosses
    b = Blocks(n, p, itemsize).largest
    return 2 * (p - 1) * (link.alpha + m.intra.step + b * link.beta) + (p - 1) * b * m.gamma


def _recursive_doubling(p, n, m: TwoLevelMachine, itemsize):
    fold = _fold_in_and_out(p, n)
    t = 0.0
    if fold:
        t += m.step(fold) + n * m.gamma  # fold in: the odd rank adds its neighbour's vector
    for mask in reversed(halving_distances(p)):  # 1, 2, 4, ...: the whole vector every step
        t += m.step(_pairs(p, mask, lambda i: n)) + n * m.gamma
    if fold:
        t += m.step(fold)  # fold out: the result goes back
    return t


def _rabenseifner(p, n, m: TwoLevelMachine, itemsize):
    pof2 = largest_power_of_two_at_most(p)
    blocks = Blocks(n, pof2, itemsize)

    def window(lo, size):  # bytes of active ranks lo .. lo+size-1's blocks
        return blocks.first(lo + size) - blocks.first(lo)

    fold = _fold_in_and_out(p, n)
    t = m.step(fold) + n * m.gamma if fold else 0.0
    for mask in halving_distances(p):  # p'/2, ..., 1: give away the half of the window that is not mine
        messages = _pairs(p, mask, lambda i: window((i ^ mask) - (i ^ mask) % mask, mask))
        t += m.step(messages) + max(b for _, _, b in messages) * m.gamma
    for mask in reversed(halving_distances(p)):  # 1, ..., p'/2: send the window gathered so far
        t += m.step(_pairs(p, mask, lambda i: window(i - i % mask, mask)))
    return t + (m.step(fold) if fold else 0.0)


def _naive(p, n, m: TwoLevelMachine, itemsize):
    # the root takes the p-1 vectors one after another, then sends the result p-1 times
    inward = sum(m.step([(src, 0, n)]) + n * m.gamma for src in range(1, p))
    outward = sum(m.step([(0, dst, n)]) for dst in range(1, p))
    return inward + outward


def _tree(p, n, m: TwoLevelMachine, itemsize):
    t, rounds = 0.0, ceil_lg(p)
    for k in range(rounds):  # reduce: distance 1, 2, 4, ...; rank i + mask sends to i (i a multiple of 2 mask)
        mask = 1 << k
        t += m.step([(i + mask, i, n) for i in range(0, p - mask, 2 * mask)]) + n * m.gamma
    for k in reversed(range(rounds)):  # broadcast: the root serves its farthest child first
        mask = 1 << k
        t += m.step([(i, i + mask, n) for i in range(0, p - mask, 2 * mask)])
    return t


def _hierarchical(p, n, m: TwoLevelMachine, itemsize):
    q = min(m.ranks_per_node, p)
    if p % q:
        return _leaders(p, n, m, itemsize)
    nodes = p // q
    part = Blocks(n, q, itemsize).largest  # each rank's share after the intra-node reduce-scatter
    piece = Blocks(part, nodes, itemsize).largest  # the ring across nodes cuts that share N ways
    a1, b1, a2, b2, g = m.intra.alpha, m.intra.beta, m.inter.alpha, m.inter.beta, m.gamma
    a1, a2 = a1 + m.intra.step, a2 + m.intra.step  # Python's bookkeeping per step (0 in the lecture model)
    if m.shared_link:
        b2 = q * b2  # the q ranks of a node cross at once, through the node's one link
    reduce_scatter_in_node = (q - 1) * (a1 + part * b1 + part * g)
    allreduce_across_nodes = 2 * (nodes - 1) * (a2 + piece * b2) + (nodes - 1) * piece * g
    allgather_in_node = (q - 1) * (a1 + part * b1)
    return reduce_scatter_in_node + allreduce_across_nodes + allgather_in_node


def _leaders(p, n, m: TwoLevelMachine, itemsize):
    """Uneven nodes: tplab's fallback. Binomial reduce to each node's first rank, ring allreduce of the
    whole vector among the N leaders, binomial broadcast in the node; the fullest node sets the pace."""
    q, nodes = m.ranks_per_node, -(-p // m.ranks_per_node)
    rounds = ceil_lg(q)
    intra, inter = m.intra, m.inter
    piece = Blocks(n, nodes, itemsize).largest
    in_node = rounds * (intra.alpha + intra.step + n * intra.beta)  # one tree, up or down
    leaders = 2 * (nodes - 1) * (inter.alpha + intra.step + piece * inter.beta) + (nodes - 1) * piece * m.gamma
    return in_node + rounds * n * m.gamma + leaders + in_node


TWO_LEVEL = {
    ("allreduce", "naive"): _naive,
    ("allreduce", "ring"): _ring,
    ("allreduce", "recursive_doubling"): _recursive_doubling,
    ("allreduce", "rabenseifner"): _rabenseifner,
    ("allreduce", "tree"): _tree,
    ("allreduce", "hierarchical"): _hierarchical,
}


def predict_two_level(collective: str, algorithm: str, p: int, n: float, machine: TwoLevelMachine, *,
                      itemsize: int = 1) -> float:
    """Predicted seconds on a TwoLevelMachine (``formulas.predict`` sends TwoLevelMachines here)."""
    check_size(p, n)
    if (collective, algorithm) not in TWO_LEVEL:
        raise unknown(collective, algorithm, TWO_LEVEL)
    # the entry cost is the calling rank's own Python work: the node's, whatever the links (like step)
    return machine.intra.entry_time(n) + TWO_LEVEL[collective, algorithm](p, n, machine, itemsize)
