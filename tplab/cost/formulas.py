"""How long a collective takes: the alpha-beta-gamma (Hockney) model, for the algorithms tplab has.

A Machine is three numbers:

    alpha   seconds per message     (latency: software, the NIC, the first byte's trip)
    beta    seconds per byte sent   (1 / bandwidth of one link)
    gamma   seconds per byte reduced (1 / speed of the local a += b)

and an algorithm's time is what lies on its critical path, the longest chain of steps a rank waits for:

    time = messages * alpha + bytes * beta + bytes_reduced * gamma

In one *step* every busy rank sends one message and receives one (``sendrecv``), all at once; links are
full-duplex, so a step costs alpha + m*beta for the largest message m of the step. The table, with n as
nccl-tests counts it, p ranks, p a power of two (Thakur, Rabenseifner & Gropp 2005; ``formula_text`` prints these):

    allreduce  naive               2(p-1)α + 2(p-1)·nβ + (p-1)·nγ       root receives, then sends, p-1 times
               ring                2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ
               recursive_doubling  lg p·α + lg p·nβ + lg p·nγ
               rabenseifner        2 lg p·α + 2(p-1)/p·nβ + (p-1)/p·nγ
               tree                2⌈lg p⌉α + 2⌈lg p⌉·nβ + ⌈lg p⌉·nγ   binomial reduce + broadcast
    reduce_scatter ring            (p-1)α + (p-1)/p·n(β+γ)              n = the full input vector
               recursive_halving   lg p·α + (p-1)/p·n(β+γ)
    allgather  ring                (p-1)α + (p-1)/p·nβ                  n = the gathered total
               recursive_doubling  lg p·α + (p-1)/p·nβ
    broadcast  binomial            ⌈lg p⌉·(α + nβ)
    reduce     binomial            ⌈lg p⌉·(α + nβ + nγ)

What tplab's code really does beyond the table:

- **p not a power of two** (fold.py): with p = p' + r, p' = 2^⌊lg p⌋, the first 2r ranks pair up. Fold in:
  the even rank sends its data (the full vector, or for allgather its own block) and the odd one reduces it;
  fold out: the odd rank sends the result back (the full vector; for reduce-scatter only the even rank's
  block). The p' active ranks run the power-of-two algorithm. Rabenseifner cuts the vector into p' blocks
  (so its terms have p', not p); recursive halving / doubling of reduce-scatter / allgather keep p real
  blocks, and an active rank standing for two real ranks carries two blocks: the step with distance m
  moves up to m + min(m, r) blocks instead of m.
- **Uneven blocks**: the vector is cut into whole elements like ``numpy.array_split`` (the first blocks are
  one element larger). Every step waits for its largest message, so ring steps move ⌈n/p⌉, not n/p.
  ``itemsize`` says how big an element is (1 by default: blocks of whole bytes).

Measured through tplab's Python, a call also pays an entry cost before its first message (argument
handling, the working copy of the input), ``Machine.entry`` + n·``Machine.entry_per_byte``, and each step
some bookkeeping besides the message, ``Machine.step``: all 0 unless fitted (fit.py).

A TwoLevelMachine (two_level.py: fast links inside a node, slow ones between nodes) is accepted by
``predict`` as well.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tplab.collectives.fold import largest_power_of_two_at_most


@dataclass(frozen=True)
class Machine:
    """The alpha-beta-gamma parameters of one kind of link, in seconds (per message, per byte, per byte).

    Two costs of tplab's Python that the lecture model does not have (0 by default; fit.py measures them):
    ``entry`` + n·``entry_per_byte``, what a collective costs before its first message (argument handling,
    the fresh working copy of the n bytes every algorithm starts from, so the caller's array stays
    unchanged), and ``step``, the algorithm's own bookkeeping around each message (slicing out blocks,
    calling numpy), paid once per step on the critical path like α."""

    alpha: float
    beta: float
    gamma: float
    name: str = ""
    entry: float = 0.0
    entry_per_byte: float = 0.0
    step: float = 0.0
    # MPI libraries send small messages eagerly and large ones by a rendezvous (a handshake first), so
    # a real link is two lines: α, β up to ``switch_bytes`` per message, α_large, β_large above it.
    # (Default: one line, the lecture model.) fit.py finds the switch where the measurements bend.
    switch_bytes: float = math.inf
    alpha_large: float | None = None
    beta_large: float | None = None

    def entry_time(self, n: float) -> float:
        return self.entry + n * self.entry_per_byte

    def link(self, message_bytes: float) -> tuple[float, float]:
        """(α, β) for messages of this size."""
        if message_bytes > self.switch_bytes:
            return (self.alpha if self.alpha_large is None else self.alpha_large,
                    self.beta if self.beta_large is None else self.beta_large)
        return self.alpha, self.beta

    def __str__(self) -> str:
        text = (f"{self.name or 'Machine'}: α = {self.alpha * 1e6:.3g} µs, "
                f"1/β = {1 / self.beta / 1e9 if self.beta else math.inf:.3g} GB/s, "
                f"1/γ = {1 / self.gamma / 1e9 if self.gamma else math.inf:.3g} GB/s")
        if self.entry or self.entry_per_byte:
            per_byte = 1 / self.entry_per_byte / 1e9 if self.entry_per_byte else math.inf
            text += f"; entry = {self.entry * 1e6:.3g} µs + n / {per_byte:.3g} GB/s"
        if self.step:
            text += f"; step = {self.step * 1e6:.3g} µs"
        return text


@dataclass(frozen=True)
class CriticalPath:
    """What lies on an algorithm's critical path: the three counts the model multiplies by α, β, γ."""

    messages: float
    wire_bytes: float
    reduced_bytes: float

    def time(self, machine: Machine) -> float:
        # the messages of one algorithm are about the same size: their mean picks the protocol
        alpha, beta = machine.link(self.wire_bytes / self.messages if self.messages else 0.0)
        return (self.messages * (alpha + machine.step)  # step: 0 in the lecture model
                + self.wire_bytes * beta + self.reduced_bytes * machine.gamma)


# ---- how the vector is cut ---------------------------------------------------------------------------------
class Blocks:
    """n bytes cut into ``parts`` blocks of whole elements, the way ``numpy.array_split`` cuts: the first
    ``n/itemsize mod parts`` blocks hold one element more. ``first(k)`` = bytes in the first k blocks,
    the k largest: what the busiest message of a step carries. (An n that is not a whole number of
    elements, say a point on a smooth plot, is cut evenly: first(k) = k n / parts.)"""

    def __init__(self, n: float, parts: int, itemsize: int = 1):
        self.n, self.parts, self.itemsize = n, parts, itemsize
        count = n / itemsize
        self.whole = float(count).is_integer()
        if self.whole:
            self.base, self.extra = divmod(int(count), parts)

    def first(self, k: int) -> float:
        if not self.whole:
            return k * self.n / self.parts
        return (k * self.base + min(k, self.extra)) * self.itemsize

    @property
    def largest(self) -> float:  # ⌈n/p⌉ in whole elements
        return self.first(1)


def lg(p: int) -> int:
    """⌊lg p⌋: the steps of recursive doubling / halving on the p' = 2^⌊lg p⌋ active ranks."""
    return largest_power_of_two_at_most(p).bit_length() - 1


def ceil_lg(p: int) -> int:
    """⌈lg p⌉: the rounds of a binomial tree on p ranks."""
    return (p - 1).bit_length()


def halving_distances(p: int) -> list[int]:
    """Distances m = p'/2, ..., 2, 1 of the recursive halving steps (doubling: the same, reversed)."""
    pof2 = largest_power_of_two_at_most(p)
    return [1 << i for i in reversed(range(pof2.bit_length() - 1))]


# ---- the algorithms: what lies on the critical path ----------------------------------------------------------
def _allreduce_naive(p, n, itemsize):
    return CriticalPath(2 * (p - 1), 2 * (p - 1) * n, (p - 1) * n)


def _allreduce_ring(p, n, itemsize):
    b = Blocks(n, p, itemsize).largest  # each of the 2(p-1) steps waits for the largest block
    return CriticalPath(2 * (p - 1), 2 * (p - 1) * b, (p - 1) * b)


def _allreduce_recursive_doubling(p, n, itemsize):
    fold = 1 if p != largest_power_of_two_at_most(p) else 0  # 1 when ranks must fold in and out
    steps = lg(p)
    return CriticalPath(steps + 2 * fold, (steps + 2 * fold) * n, (steps + fold) * n)


def _allreduce_rabenseifner(p, n, itemsize):
    pof2 = largest_power_of_two_at_most(p)
    fold = 1 if p != pof2 else 0
    blocks = Blocks(n, pof2, itemsize)  # one block per *active* rank: p' blocks
    halves = sum(blocks.first(m) for m in halving_distances(p))  # n/2 + n/4 + ... = (p'-1)/p'·n
    return CriticalPath(2 * lg(p) + 2 * fold, 2 * halves + 2 * fold * n, halves + fold * n)


def _allreduce_tree(p, n, itemsize):
    rounds = ceil_lg(p)
    return CriticalPath(2 * rounds, 2 * rounds * n, rounds * n)


def _reduce_scatter_ring(p, n, itemsize):
    b = Blocks(n, p, itemsize).largest
    return CriticalPath(p - 1, (p - 1) * b, (p - 1) * b)


def _folded_windows(p, n, itemsize) -> float:
    """Bytes of the largest message, summed over the halving (or doubling) steps of reduce-scatter
    (allgather) on p real blocks: distance m carries m active ranks' blocks, and an active rank that
    stands for two real ranks carries two, so m + min(m, r) blocks at most. For p' = p: (p-1)/p·n."""
    r = p - largest_power_of_two_at_most(p)
    blocks = Blocks(n, p, itemsize)
    return sum(blocks.first(m + min(m, r)) for m in halving_distances(p))


def _reduce_scatter_recursive_halving(p, n, itemsize):
    fold = 1 if p != largest_power_of_two_at_most(p) else 0
    exchanged = _folded_windows(p, n, itemsize)
    back = Blocks(n, p, itemsize).largest  # fold out: the even rank gets only its own block
    return CriticalPath(lg(p) + 2 * fold, fold * n + exchanged + fold * back, fold * n + exchanged)


def _allgather_ring(p, n, itemsize):
    b = Blocks(n, p, itemsize).largest
    return CriticalPath(p - 1, (p - 1) * b, 0)


def _allgather_recursive_doubling(p, n, itemsize):
    fold = 1 if p != largest_power_of_two_at_most(p) else 0
    exchanged = _folded_windows(p, n, itemsize)
    own = Blocks(n, p, itemsize).largest  # fold in: the even rank hands over its own block ...
    return CriticalPath(lg(p) + 2 * fold, fold * own + exchanged + fold * n, 0)  # ... fold out: everything


def _broadcast_binomial(p, n, itemsize):
    rounds = ceil_lg(p)
    return CriticalPath(rounds, rounds * n, 0)


def _reduce_binomial(p, n, itemsize):
    rounds = ceil_lg(p)
    return CriticalPath(rounds, rounds * n, rounds * n)


PATHS = {
    ("allreduce", "naive"): _allreduce_naive,
    ("allreduce", "ring"): _allreduce_ring,
    ("allreduce", "recursive_doubling"): _allreduce_recursive_doubling,
    ("allreduce", "rabenseifner"): _allreduce_rabenseifner,
    ("allreduce", "tree"): _allreduce_tree,
    ("reduce_scatter", "ring"): _reduce_scatter_ring,
    ("reduce_scatter", "recursive_halving"): _reduce_scatter_recursive_halving,
    ("allgather", "ring"): _allgather_ring,
    ("allgather", "recursive_doubling"): _allgather_recursive_doubling,
    ("broadcast", "binomial"): _broadcast_binomial,
    ("reduce", "binomial"): _reduce_binomial,
}
TWO_LEVEL_ONLY = {("allreduce", "hierarchical")}  # needs to know which ranks share a node


def check_size(p, n) -> None:
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"p must be a positive int (the number of ranks), got {p!r}")
    if not n >= 0:  # also catches NaN
        raise ValueError(f"n must be a non-negative number of bytes, got {n!r}")


def unknown(collective, algorithm, known) -> ValueError:
    choices = ", ".join(f"{c}/{a}" for c, a in sorted(known))
    return ValueError(f"no cost formula for {collective!r} with algorithm {algorithm!r}; known: {choices}")


def critical_path(collective: str, algorithm: str, p: int, n: float, *, itemsize: int = 1) -> CriticalPath:
    """Messages, bytes and bytes reduced on the critical path of one collective (one-level machine)."""
    check_size(p, n)
    if (collective, algorithm) in TWO_LEVEL_ONLY:
        raise ValueError(f"{collective} {algorithm!r} needs a TwoLevelMachine (which ranks share a node); "
                         "for a single kind of link use TwoLevelMachine(m, m, ranks_per_node)")
    if (collective, algorithm) not in PATHS:
        raise unknown(collective, algorithm, set(PATHS) | TWO_LEVEL_ONLY)
    return PATHS[collective, algorithm](p, n, itemsize)


# ---- the formulas as a student reads them -------------------------------------------------------------------
FORMULAS = {  # p a power of two; n as in nccl-tests (see the module docstring)
    ("allreduce", "naive"): "2(p-1)α + 2(p-1)·nβ + (p-1)·nγ",
    ("allreduce", "ring"): "2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ",
    ("allreduce", "recursive_doubling"): "lg p·α + lg p·nβ + lg p·nγ",
    ("allreduce", "rabenseifner"): "2 lg p·α + 2(p-1)/p·nβ + (p-1)/p·nγ",
    ("allreduce", "tree"): "2⌈lg p⌉α + 2⌈lg p⌉·nβ + ⌈lg p⌉·nγ",
    ("allreduce", "hierarchical"): ("2(q-1)α₁ + 2(q-1)/q·nβ₁ + 2(N-1)α₂ + 2(N-1)/p·nβ₂ + (p-1)/p·nγ"
                                     "   (q ranks per node, N = p/q nodes; 1 = intra, 2 = inter)"),
    ("reduce_scatter", "ring"): "(p-1)α + (p-1)/p·n(β+γ)",
    ("reduce_scatter", "recursive_halving"): "lg p·α + (p-1)/p·n(β+γ)",
    ("allgather", "ring"): "(p-1)α + (p-1)/p·nβ",
    ("allgather", "recursive_doubling"): "lg p·α + (p-1)/p·nβ",
    ("broadcast", "binomial"): "⌈lg p⌉(α + nβ)",
    ("reduce", "binomial"): "⌈lg p⌉(α + nβ + nγ)",
}
FOLDED_FORMULAS = {  # p = p' + r, 0 < r < p' = 2^⌊lg p⌋; R = Σ min(m, r) over m = 1, 2, 4, ..., p'/2
    ("allreduce", "recursive_doubling"): "(lg p' + 2)α + (lg p' + 2)·nβ + (lg p' + 1)·nγ",
    ("allreduce", "rabenseifner"): "(2 lg p' + 2)α + (2(p'-1)/p' + 2)·nβ + (1 + (p'-1)/p')·nγ",
    ("reduce_scatter", "recursive_halving"): "(lg p' + 2)α + (1 + (p'-1+R)/p)·n(β+γ) + n/p·β",
    ("allgather", "recursive_doubling"): "(lg p' + 2)α + (1 + (p'+R)/p)·nβ",
}


def formula_text(collective: str, algorithm: str, power_of_two: bool = True) -> str:
    """The cost formula as a string, e.g. formula_text("allreduce", "ring") ->
    "2(p-1)α + 2(p-1)/p·nβ + (p-1)/p·nγ". ``power_of_two=False``: the folded form, where it differs."""
    if (collective, algorithm) not in FORMULAS:
        raise unknown(collective, algorithm, FORMULAS)
    if not power_of_two:
        return FOLDED_FORMULAS.get((collective, algorithm), FORMULAS[collective, algorithm])
    return FORMULAS[collective, algorithm]
