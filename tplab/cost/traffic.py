"""What each algorithm sends, by formula: to put next to the counters of a real run.

``traffic(collective, algorithm, p, n)`` gives the messages and bytes sent for one collective on ``p``
ranks, with n as nccl-tests counts it (allreduce: bytes per rank; reduce_scatter: the full input vector;
allgather: the gathered total; broadcast/reduce: the message). Ranks do not all send the same (the root
of the naive algorithm sends p-1 copies; folded ranks of a non-power-of-two sit out), so it reports both
the busiest rank (``max_messages``, ``max_bytes``: each maximised on its own) and the total over ranks.
Exact when the vector is made of whole blocks (n/p, and n/p' for Rabenseifner, whole elements);
otherwise blocks round by at most one element.

    collective / algorithm          busiest rank: messages   bytes             (p a power of two)
    allreduce   naive               p - 1                    (p-1) n           the root sends p-1 copies
                ring                2 (p-1)                  2 (p-1)/p n
                recursive_doubling  lg p                     n lg p
                rabenseifner        2 lg p                   2 (p-1)/p n
                tree                ⌈lg p⌉                   ⌈lg p⌉ n          the root in the broadcast
                hierarchical        2(q-1) + 2(N-1)          2(q-1)/q n + 2(N-1)/p n   N nodes of q ranks
    reduce_scatter ring             p - 1                    (p-1)/p n
                recursive_halving   lg p                     (p-1)/p n
    allgather   ring                p - 1                    (p-1)/p n
                recursive_doubling  lg p                     (p-1)/p n
    broadcast   binomial            ⌈lg p⌉                   ⌈lg p⌉ n          the root
    reduce      binomial            1                        n                 everyone but the root, once

With p = p' + r and r > 0 (p' = 2^⌊lg p⌋) the even ranks among the first 2r hand their data to their odd
neighbour and the odd ones hand the result back (Thakur, Rabenseifner & Gropp 2005; fold.py): one more message
each way. Totals add up over ranks; e.g. a folded recursive-doubling allreduce sends p' lg p' messages
in the exchange plus r in and r out.
"""

from __future__ import annotations

from tplab.collectives.fold import largest_power_of_two_at_most
from tplab.cost.formulas import ceil_lg, check_size, halving_distances, lg, unknown


def _fold_windows(p: int) -> int:
    """Σ over distances m = 1, 2, ..., p'/2 of (m + min(m, r)): real blocks in the busiest folded
    rank's windows (see formulas._folded_windows); p'-1 when p is a power of two."""
    r = p - largest_power_of_two_at_most(p)
    return sum(m + min(m, r) for m in halving_distances(p))


def _allreduce(algorithm, p, n, P, k, r):
    if algorithm == "naive":
        return (p - 1, (p - 1) * n), (2 * (p - 1), 2 * (p - 1) * n)
    if algorithm == "ring":
        return (2 * (p - 1), 2 * (p - 1) * n / p), (2 * p * (p - 1), 2 * (p - 1) * n)
    if algorithm == "recursive_doubling":
        hops = k + (1 if r else 0)  # a folding odd rank also returns the result
        messages = P * k + 2 * r
        return (hops, hops * n), (messages, messages * n)
    if algorithm == "rabenseifner":
        exchange = 2 * (P - 1) * n / P  # what each active rank sends in halving + doubling
        return ((2 * k + (1 if r else 0), exchange + (n if r else 0)),
                (P * 2 * k + 2 * r, P * exchange + 2 * r * n))
    if algorithm == "tree":
        rounds = ceil_lg(p)
        return (rounds, rounds * n), (2 * (p - 1), 2 * (p - 1) * n)
    return None


def _reduce_scatter(algorithm, p, n, P, k, r):
    if algorithm == "ring":
        return (p - 1, (p - 1) * n / p), (p * (p - 1), (p - 1) * n)
    if algorithm == "recursive_halving":
        # An active rank gives away everything but its own blocks: (p-1)/p n, or (p-2)/p n + its even
        # neighbour's block n/p if it stands for two. A folded even rank sends the whole vector: n.
        return ((k + (1 if r else 0), n if r else (p - 1) * n / p),
                (P * k + 2 * r, (P - 1) * n + r * n + r * n / p))
    return None


def _allgather(algorithm, p, n, P, k, r):
    if algorithm == "ring":
        return (p - 1, (p - 1) * n / p), (p * (p - 1), (p - 1) * n)
    if algorithm == "recursive_doubling":
        # Distance m: each active rank sends the window of m active ranks it has gathered; the busiest is
        # odd rank 1 (active rank 0), whose windows hold the most doubled-up ranks, and which also sends
        # the whole result back to rank 0. Per step the windows add up to m·p blocks: m·n in all.
        busiest = (_fold_windows(p) * n / p + n) if r else (p - 1) * n / p
        return ((k + (1 if r else 0), busiest), (P * k + 2 * r, r * n / p + (P - 1) * n + r * n))
    return None


def _rooted(collective, algorithm, p, n):
    if algorithm != "binomial":
        return None
    if collective == "broadcast":  # the root sends to its ⌈lg p⌉ children, every other rank receives once
        return (ceil_lg(p), ceil_lg(p) * n), (p - 1, (p - 1) * n)
    return (1, n), (p - 1, (p - 1) * n)  # reduce: every rank but the root sends its partial result once


def _hierarchical(p, n, ranks_per_node):
    """Even nodes (N of q ranks): ring reduce-scatter and allgather inside the node (q-1 messages of n/q
    each), ring allreduce of the node's n/q block across the N nodes (2(N-1) messages of n/p). Uneven
    nodes: tplab falls back to leaders (binomial reduce in the node, ring allreduce of the whole vector
    among the N leaders, binomial broadcast in the node): the leader of the fullest node is busiest."""
    if ranks_per_node is None:
        raise ValueError("allreduce 'hierarchical' needs ranks_per_node (how many ranks share a node)")
    q = min(ranks_per_node, p)
    nodes = -(-p // q)  # ⌈p/q⌉
    if p % q == 0:
        messages, sent = 2 * (q - 1) + 2 * (nodes - 1), 2 * (q - 1) * n / q + 2 * (nodes - 1) * n / p
        return (messages, sent), (p * messages, p * sent)
    leader_messages = 2 * (nodes - 1) + ceil_lg(q)  # the ring among leaders, then the node's broadcast
    leader_bytes = 2 * (nodes - 1) * n / nodes + ceil_lg(q) * n
    in_nodes = p - nodes  # non-leaders: each sends once up the reduce tree and is sent to once in broadcast
    return ((leader_messages, leader_bytes),
            (2 * in_nodes + 2 * nodes * (nodes - 1), 2 * in_nodes * n + 2 * (nodes - 1) * n))


def traffic(collective: str, algorithm: str, p: int, n: float, *, ranks_per_node: int | None = None) -> dict:
    """Messages and bytes sent for one ``collective`` by ``algorithm`` on ``p`` ranks with n bytes:
    ``{"max_messages", "max_bytes", "total_messages", "total_bytes"}``. The hierarchical allreduce also
    needs ``ranks_per_node`` (nodes of consecutive ranks)."""
    check_size(p, n)
    P, k, r = largest_power_of_two_at_most(p), lg(p), p - largest_power_of_two_at_most(p)
    if (collective, algorithm) == ("allreduce", "hierarchical"):
        found = _hierarchical(p, n, ranks_per_node)
    elif collective == "allreduce":
        found = _allreduce(algorithm, p, n, P, k, r)
    elif collective == "reduce_scatter":
        found = _reduce_scatter(algorithm, p, n, P, k, r)
    elif collective == "allgather":
        found = _allgather(algorithm, p, n, P, k, r)
    elif collective in ("broadcast", "reduce"):
        found = _rooted(collective, algorithm, p, n)
    else:
        found = None
    if found is None:
        raise unknown(collective, algorithm, KNOWN)
    if p == 1:
        return {"max_messages": 0, "max_bytes": 0.0, "total_messages": 0, "total_bytes": 0.0}
    (busy_messages, busy_bytes), (all_messages, all_bytes) = found
    return {"max_messages": busy_messages, "max_bytes": float(busy_bytes),
            "total_messages": all_messages, "total_bytes": float(all_bytes)}


KNOWN = [("allreduce", a) for a in ("naive", "ring", "recursive_doubling", "rabenseifner", "tree")] + [
    ("reduce_scatter", "ring"), ("reduce_scatter", "recursive_halving"),
    ("allgather", "ring"), ("allgather", "recursive_doubling"),
    ("broadcast", "binomial"), ("reduce", "binomial")]


def allreduce_traffic(algorithm: str, p: int, n: float) -> dict:
    """Messages and bytes sent for one allreduce of ``n`` bytes per rank on ``p`` ranks."""
    return traffic("allreduce", algorithm, p, n)
