"""Ring algorithms: reduce-scatter, allgather, and allreduce = reduce-scatter + allgather.

The p ranks stand in a ring; each step every rank sends one block to its right neighbour and receives
one from its left neighbour, so every link is busy every step and no rank sends more than its share:

    reduce-scatter   p-1 steps, each moves n/p bytes and reduces them     (p-1) a + (p-1)/p n (b + g)
    allgather        p-1 steps, each moves n/p bytes                      (p-1) a + (p-1)/p n b
    allreduce        both                                                 2(p-1) a + 2(p-1)/p n b + (p-1)/p n g

Bandwidth-optimal (no algorithm can send less than 2(p-1)/p n per rank), but the 2(p-1) latency terms
make it slow for small messages on many ranks.

Blocks: the flat vector is cut into p blocks as ``numpy.array_split`` would (``bounds[i]:bounds[i+1]``).

No copy of the input: with ``source`` given (the caller's read-only vector), the first send of a block
reads it from ``source`` and the first reduction into a block writes ``buf``, so every block of ``buf``
is written before it is read. (Copying the input first would cost a pass over n bytes, which at
64 KiB - 1 MiB is a good part of an allreduce.)
"""

from __future__ import annotations

from tplab.toolkit.arrays import array_module
from tplab.collectives.scratch import scratch
from tplab.collectives.snapshots import snapshot


def ring_reduce_scatter_blocks(buf, comm, op, bounds, source=None) -> None:
    """Afterwards block ``rank`` of ``buf`` holds the reduction of that block over all ranks (other
    blocks hold partial sums or nothing: scratch). This rank's contribution is read from ``source``
    (default: ``buf`` itself, in place)."""
    p, r = comm.size, comm.rank
    source = buf if source is None else source
    right, left = (r + 1) % p, (r - 1) % p
    largest_block = max(bounds[i + 1] - bounds[i] for i in range(p))
    incoming = scratch("ring incoming", largest_block, buf.dtype, like=buf)

    def block(array, i):
        i %= p
        return array[bounds[i] : bounds[i + 1]]

    for step in range(p - 1):
        # Block b travels b+1 -> b+2 -> ... -> b, picking up one contribution per hop, so it
        # arrives complete at rank b after p-1 hops.
        send = block(source if step == 0 else buf, r - step - 1)  # (at step 0: my own contribution)
        got = incoming[: bounds[(r - step - 2) % p + 1] - bounds[(r - step - 2) % p]]
        comm.sendrecv(send, right, got, left)
        # partial sum so far (got) op my contribution -> buf
        op.combine(got, block(source, r - step - 2), out=block(buf, r - step - 2))
        snapshot(f"reduce-scatter step {step + 1}", buf, at_round=step + 1)


def ring_allgather_blocks(buf, comm, bounds, first_round=1) -> None:
    """In place: block ``rank`` of ``buf`` is this rank's; afterwards every block is everyone's."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p

    def block(i):
        i %= p
        return buf[bounds[i] : bounds[i + 1]]

    for step in range(p - 1):
        # pass along the block received in the previous step (at step 0: our own)
        comm.sendrecv(block(r - step), right, block(r - step - 1), left)
        snapshot(f"allgather step {step + 1}", buf, at_round=first_round + step)


def ring_allreduce(buf, comm, op, bounds, source=None):
    snapshot("start", buf if source is None else source, at_round=0)
    ring_reduce_scatter_blocks(buf, comm, op, bounds, source)
    ring_allgather_blocks(buf, comm, bounds, first_round=comm.size)
    return buf


def ring_reduce_scatter(buf, comm, op, bounds):
    snapshot("start", buf, at_round=0)
    ring_reduce_scatter_blocks(buf, comm, op, bounds)
    return buf[bounds[comm.rank] : bounds[comm.rank + 1]].copy()


def ring_allgather(mine, comm, bounds):
    """``bounds`` are the offsets of every rank's contribution in the gathered vector."""
    out = array_module(mine).zeros(bounds[-1], dtype=mine.dtype)  # zeros: snapshots show "nothing yet"
    out[bounds[comm.rank] : bounds[comm.rank + 1]] = mine
    snapshot("start", out, at_round=0)
    ring_allgather_blocks(out, comm, bounds)
    return out
