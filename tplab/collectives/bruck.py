"""All-to-all by Bruck's algorithm: ⌈lg p⌉ messages instead of p-1, for small blocks.

Pairwise exchange (alltoall.py) sends p-1 messages of one block each: at a few tokens per destination
the α term dominates. Bruck et al. (1997, "Efficient algorithms for all-to-all communications in
multiport message-passing systems") trade bytes for messages: every block travels in hops of 1, 2, 4, ...
ranks, so after ⌈lg p⌉ rounds it has gone the whole distance (its index, written in binary):

    1. rotate:  tmp[i] = x[(r + i) mod p]            block i is now meant for the rank i ahead of me
    2. round k = 1, 2, 4, ... < p:  send every tmp[i] with bit k of i set to rank r + k, receive the
       same positions from rank r - k (those blocks have now moved k ranks further)
    3. undo:    out[j] = tmp[(r - j) mod p]          the block at i came from the rank i behind me

Cost, n = the bytes of one rank's whole input (p blocks of n/p):

    ⌈lg p⌉ α + Σ_k |{i < p : i & k}| · n/p · β      ≈ lg p α + (n/2) lg p β  for p a power of two

so it wins where α dominates, small blocks, and loses where β does (tplab.cost.alltoall has both formulas
and the crossover). Works for any p, powers of two or not. Every block lands bitwise unchanged.
"""

from __future__ import annotations


def rounds(p: int) -> list[int]:
    """The distances k = 1, 2, 4, ... < p of Bruck's rounds (⌈lg p⌉ of them)."""
    out, k = [], 1
    while k < p:
        out.append(k)
        k <<= 1
    return out


def moved_blocks(p: int, k: int) -> list[int]:
    """Positions i < p with bit k set: the blocks that travel in the round of distance k."""
    return [i for i in range(p) if i & k]


def bruck_alltoall(x, comm):
    """x: (p, ...) contiguous, x[j] for rank j (numpy or torch)  ->  (p, ...), out[j] from rank j."""
    p, r = comm.size, comm.rank
    block = x[0].numel() if hasattr(x, "numel") else x[0].size  # elements per block
    tmp = x.reshape(p, block)[[(r + i) % p for i in range(p)]]  # a copy: blocks rotated up by r
    for k in rounds(p):
        moving = moved_blocks(p, k)
        outgoing = tmp[moving].reshape(-1)  # packed into one contiguous 1-D message
        incoming = tmp[moving].reshape(-1)  # (a buffer of the right size; overwritten)
        comm.sendrecv(outgoing, (r + k) % p, incoming, (r - k) % p, tag=k)
        tmp[moving] = incoming.reshape(len(moving), block)
    return tmp[[(r - j) % p for j in range(p)]].reshape(x.shape)
