"""Recursive doubling and halving: the log p algorithms.

Rank n talks to rank n XOR mask; mask runs over 1, 2, 4, ... (doubling) or ..., 4, 2, 1 (halving).

    recursive doubling allreduce   whole vector every step          lg p a + lg p n (b + g)
    recursive halving reduce-scatter   halves what is exchanged     lg p a + (p-1)/p n (b + g)
    recursive doubling allgather       doubles what is exchanged    lg p a + (p-1)/p n b
    Rabenseifner allreduce = halving reduce-scatter + doubling allgather
                                                                    2 lg p a + 2(p-1)/p n b + (p-1)/p n g

Few steps (good for small messages); Rabenseifner also moves the minimum number of bytes (good for big
ones). All of them need 2**k ranks: other rank counts are folded first (``fold.py``).

Windows: after the halving step with distance ``mask`` a rank is responsible for a window of ``mask``
consecutive new ranks (the one it belongs to); ``span(a, b)`` turns new ranks a..b-1 into the element
range they own in the vector, which is how the same loops serve allreduce, reduce-scatter and allgather.
"""

from __future__ import annotations

from tplab.toolkit.arrays import array_module
from tplab.toolkit.blocks import block_bounds
from tplab.collectives.fold import PowerOfTwoFold
from tplab.collectives.scratch import scratch
from tplab.collectives.snapshots import snapshot


def combine_in_rank_order(op, mine, theirs, my_rank, their_rank, out=None) -> None:
    """out (default: mine) = (lower rank's data) op (higher rank's data): both partners do the very
    same arithmetic."""
    out = mine if out is None else out
    if their_rank < my_rank:
        op.combine(theirs, mine, out=out)
    else:
        op.combine(mine, theirs, out=out)


def fold_in_by_reducing(buf, comm, op, fold: PowerOfTwoFold, source=None):
    """Returns the array that now holds this rank's data: ``source`` (default ``buf``), or ``buf`` for
    a rank that absorbed its neighbour's vector into it (None for a rank that sat out)."""
    source = buf if source is None else source
    if fold.sits_out:
        comm.send(source, fold.rank + 1)
        return None
    if fold.absorbs_neighbour:
        theirs = comm.recv(scratch("fold in", buf.size, buf.dtype, like=buf), fold.rank - 1)
        combine_in_rank_order(op, source, theirs, fold.rank, fold.rank - 1, out=buf)
        snapshot("fold in", buf, at_round=1)
        return buf
    return source


def fold_out(buf, comm, fold: PowerOfTwoFold, at_round) -> None:
    """Odd ranks of the folded pairs return the finished vector to their even neighbours."""
    if fold.absorbs_neighbour:
        comm.send(buf, fold.rank - 1)
    elif fold.sits_out:
        comm.recv(buf, fold.rank + 1)
        snapshot("fold out", buf, at_round=at_round)


def halving_reduce_scatter(buf, comm, op, fold: PowerOfTwoFold, span, first_round=2, source=None) -> None:
    """Recursive halving over the 2**k active ranks: afterwards ``buf`` holds the full reduction of the
    elements ``span(newrank, newrank + 1)``. The first step reads this rank's data from ``source``
    (default ``buf``); every later step reads what the step before wrote to ``buf``."""
    n, lo, hi = fold.newrank, 0, fold.pof2
    mine = buf if source is None else source
    room = scratch("halving", buf.size, buf.dtype, like=buf)  # (the first half kept is the largest piece)
    mask, step = fold.pof2 // 2, 0
    while mask:
        partner = fold.real_rank(n ^ mask)
        mid = lo + mask
        keep, give = ((lo, mid), (mid, hi)) if n < mid else ((mid, hi), (lo, mid))
        k0, k1 = span(*keep)
        g0, g1 = span(*give)
        theirs = room[: k1 - k0]
        comm.sendrecv(mine[g0:g1], partner, theirs, partner)
        combine_in_rank_order(op, mine[k0:k1], theirs, comm.rank, partner, out=buf[k0:k1])
        mine = buf
        lo, hi = keep
        mask //= 2
        snapshot(f"halving step (distance {hi - lo})", buf, at_round=first_round + step)
        step += 1


def doubling_allgather(buf, comm, fold: PowerOfTwoFold, span, first_round=2) -> None:
    """Recursive doubling over the 2**k active ranks: each step swaps the windows gathered so far."""
    n, mask = fold.newrank, 1
    while mask < fold.pof2:
        partner_new = n ^ mask
        mine_lo, theirs_lo = n - n % mask, partner_new - partner_new % mask
        m0, m1 = span(mine_lo, mine_lo + mask)
        t0, t1 = span(theirs_lo, theirs_lo + mask)
        comm.sendrecv(buf[m0:m1], fold.real_rank(partner_new), buf[t0:t1], fold.real_rank(partner_new))
        snapshot(f"doubling step (distance {mask})", buf, at_round=first_round + mask.bit_length() - 1)
        mask *= 2


# ---- the four algorithms ----------------------------------------------------------------------------------
def recursive_doubling_allreduce(buf, comm, op, source=None):
    """``source``: this rank's read-only input (default: ``buf``, in place); no copy of it is made."""
    fold = PowerOfTwoFold(comm.size, comm.rank)
    snapshot("start", buf if source is None else source, at_round=0)
    mine = fold_in_by_reducing(buf, comm, op, fold, source)
    if not fold.sits_out:
        # Each step receives into one buffer and adds into that same buffer: never into the one just
        # sent, which would make this core wait for the peer's reads of it (cache lines). buf and a
        # scratch buffer take turns, arranged so that the last sum lands in buf.
        spare = scratch("recursive doubling", buf.size, buf.dtype, like=buf)
        steps = fold.pof2.bit_length() - 1
        target = buf if steps % 2 == 1 and mine is not buf else spare
        mask = 1
        while mask < fold.pof2:
            partner = fold.real_rank(fold.newrank ^ mask)
            theirs = comm.sendrecv(mine, partner, target, partner)  # the whole vector, every step
            combine_in_rank_order(op, mine, theirs, comm.rank, partner, out=theirs)
            mine, target = theirs, (spare if theirs is buf else buf)
            snapshot(f"step (distance {mask})", mine, at_round=2 + mask.bit_length() - 1)
            mask *= 2
        if mine is not buf:
            array_module(buf).copyto(buf, mine)
    fold_out(buf, comm, fold, at_round=2 + fold.pof2.bit_length() - 1)
    return buf


def rabenseifner_allreduce(buf, comm, op, source=None):
    """``source``: this rank's read-only input (default: ``buf``, in place); no copy of it is made."""
    fold = PowerOfTwoFold(comm.size, comm.rank)
    bounds = block_bounds(buf.size, fold.pof2)  # one block per active rank

    def span(a, b):
        return bounds[a], bounds[b]

    lg = fold.pof2.bit_length() - 1
    snapshot("start", buf if source is None else source, at_round=0)
    mine = fold_in_by_reducing(buf, comm, op, fold, source)
    if not fold.sits_out:
        halving_reduce_scatter(buf, comm, op, fold, span, first_round=2, source=mine)
        doubling_allgather(buf, comm, fold, span, first_round=2 + lg)
    fold_out(buf, comm, fold, at_round=2 + 2 * lg)
    return buf


def recursive_halving_reduce_scatter(buf, comm, op, bounds):
    """``bounds``: rank i's result block is ``buf[bounds[i]:bounds[i+1]]``."""
    fold = PowerOfTwoFold(comm.size, comm.rank)

    def span(a, b):  # a new rank owns the blocks of the real ranks it stands for
        return bounds[fold.real_ranks_of(a)[0]], bounds[fold.real_ranks_of(b - 1)[-1] + 1]

    snapshot("start", buf, at_round=0)
    fold_in_by_reducing(buf, comm, op, fold)
    r = comm.rank
    if not fold.sits_out:
        halving_reduce_scatter(buf, comm, op, fold, span)
    if fold.absorbs_neighbour:  # hand the even neighbour its block
        comm.send(buf[bounds[r - 1] : bounds[r]], r - 1)
    elif fold.sits_out:
        comm.recv(buf[bounds[r] : bounds[r + 1]], r + 1)
        snapshot("fold out", buf, at_round=2 + fold.pof2.bit_length() - 1)
    return buf[bounds[r] : bounds[r + 1]].copy()


def recursive_doubling_allgather(mine, comm, bounds):
    """``bounds``: offsets of every rank's contribution in the gathered vector."""
    fold = PowerOfTwoFold(comm.size, comm.rank)
    r = comm.rank

    def span(a, b):
        return bounds[fold.real_ranks_of(a)[0]], bounds[fold.real_ranks_of(b - 1)[-1] + 1]

    out = array_module(mine).zeros(bounds[-1], dtype=mine.dtype)  # zeros: snapshots show "nothing yet"
    out[bounds[r] : bounds[r + 1]] = mine
    snapshot("start", out, at_round=0)
    if fold.sits_out:
        comm.send(mine, r + 1)
    elif fold.absorbs_neighbour:
        comm.recv(out[bounds[r - 1] : bounds[r]], r - 1)
        snapshot("fold in", out, at_round=1)
    if not fold.sits_out:
        doubling_allgather(out, comm, fold, span)
    fold_out(out, comm, fold, at_round=2 + fold.pof2.bit_length() - 1)
    return out
