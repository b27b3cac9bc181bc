"""Binomial trees: broadcast, reduce, and the "tree" allreduce (reduce to rank 0, then broadcast).

Ranks are renumbered relative to the root (rel = (rank - root) mod p). In a binomial tree the rank with
relative number ``rel`` has parent ``rel`` minus its lowest set bit, and children ``rel + mask`` for
every power of two ``mask`` below that bit. lg p rounds, each carrying the whole vector:

    broadcast        lg p a + lg p n b
    reduce           lg p a + lg p n (b + g)
    tree allreduce   2 lg p a + 2 lg p n b + lg p n g

Works for any p (a missing child is simply skipped).
"""

from __future__ import annotations

from tplab.collectives.recursive import combine_in_rank_order
from tplab.collectives.scratch import scratch
from tplab.collectives.snapshots import snapshot


def binomial_reduce(buf, comm, op, root):
    """In place on the way up; the full reduction ends on ``root`` (other ranks' ``buf`` is scratch)."""
    p = comm.size
    rel = (comm.rank - root) % p
    snapshot("start", buf, at_round=0)
    theirs = scratch("binomial reduce", buf.size, buf.dtype, like=buf)
    mask = 1
    while mask < p:
        if rel & mask:  # my subtree is complete: pass it to my parent and stop
            comm.send(buf, (rel - mask + root) % p)
            break
        child = rel + mask
        if child < p:
            comm.recv(theirs, (child + root) % p)
            combine_in_rank_order(op, buf, theirs, rel, child)  # keep relative rank order: lower first
        snapshot(f"reduce round {mask.bit_length()}", buf, at_round=mask.bit_length())
        mask *= 2
    return buf


def binomial_broadcast(buf, comm, root, first_round=1):
    p = comm.size
    rel = (comm.rank - root) % p
    rounds = (p - 1).bit_length()  # ceil(lg p)
    if rel == 0 and first_round == 1:  # (after a reduce, its last round already shows this state)
        snapshot("start", buf, at_round=0)
    # receive from the parent (the root has none) ...
    mask = 1
    while mask < p:
        if rel & mask:
            comm.recv(buf, (rel - mask + root) % p)
            k = rounds - mask.bit_length() + 1  # the root serves its farthest child first
            snapshot(f"broadcast round {k}", buf, at_round=first_round - 1 + k)
            break
        mask *= 2
    # ... then send to the children, farthest first
    mask //= 2
    while mask:
        if rel + mask < p:
            comm.send(buf, (rel + mask + root) % p)
        mask //= 2
    return buf


def tree_allreduce(buf, comm, op):
    binomial_reduce(buf, comm, op, root=0)
    return binomial_broadcast(buf, comm, root=0, first_round=(comm.size - 1).bit_length() + 1)
