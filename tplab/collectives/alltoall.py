"""All-to-all by pairwise exchange: every rank sends a different block to every other rank.

The input is p blocks, ``x[j]`` meant for rank j; the output is p blocks, ``out[j]`` the one rank j
meant for me. (A transpose of a p x p matrix of blocks spread over the ranks by rows.) In step
k = 1 .. p-1 every rank sends to the rank k ahead of it and receives from the rank k behind it, so
every rank is busy in every step and each pair of ranks meets exactly once:

    step k:   rank r  --x[r+k]-->  rank r+k        rank r  <--x'[r]--  rank r-k        (mod p)

Cost, n = the bytes of one rank's whole input (p blocks):

    (p-1) α + (p-1)/p · n β          each rank sends p-1 blocks of n/p bytes (its own block stays home)

This is what MPICH and Open MPI run for large all-to-alls (MPICH "pairwise exchange"; for p a power of two
they use partner r XOR k, which meets each pair once as well). DeepSpeed Ulysses uses four of these per
attention layer to turn sequence-sharded Q, K, V into head-sharded ones and back (tplab/sequence/ulysses.py).

``algorithm="bruck"`` runs Bruck's algorithm instead (bruck.py): ⌈lg p⌉ messages, more bytes, for small
blocks. Variable counts per destination: alltoallv.py.

Buffers pass through as they are: numpy arrays, CPU torch tensors, or whatever the Communicator's
``sendrecv`` accepts (GPU tensors on a GPU transport); the output is of the input's kind.
"""

from __future__ import annotations

import numpy as np

from tplab.collectives.bruck import bruck_alltoall
from tplab.collectives.checks import CollectiveArgumentError
from tplab.toolkit.arrays import is_torch

ALGORITHMS = ("pairwise", "bruck")


def _check(x, comm, algorithm) -> None:
    """Every rank passes p blocks of one shape and dtype, and names one algorithm; otherwise the same error
    on every rank."""
    everyone = comm.allgather_object((tuple(x.shape), str(x.dtype), algorithm))
    problems = [f"rank {r} passed shape {shape}: the first dimension must be the number of ranks "
                f"{comm.size} (one block per destination)"
                for r, (shape, _, _) in enumerate(everyone) if len(shape) == 0 or shape[0] != comm.size]
    if len(set(everyone)) > 1:
        listed = ", ".join(f"rank {r} {m}" for r, m in enumerate(everyone))
        problems.append(f"ranks disagree on (shape, dtype, algorithm): {listed}")
    if problems:
        raise CollectiveArgumentError("alltoall: " + "; ".join(problems))


def alltoall(x, comm, *, algorithm: str = "pairwise", check: bool = True):
    """x: (p, ...) with x[j] for rank j  ->  out: (p, ...) with out[j] from rank j."""
    if check:
        _check(x, comm, algorithm)
    if algorithm not in ALGORITHMS:  # (after the agreement: then every rank raises it)
        raise CollectiveArgumentError(f"alltoall: unknown algorithm {algorithm!r}; choose one of {list(ALGORITHMS)}")
    if not check and x.shape[0] != comm.size:
        raise CollectiveArgumentError(f"alltoall: first dimension {x.shape[0]} != number of ranks {comm.size}")
    p, r = comm.size, comm.rank
    x = x.contiguous() if is_torch(x) else np.ascontiguousarray(x)
    if algorithm == "bruck":
        return bruck_alltoall(x, comm)
    out = x.new_empty(x.shape) if is_torch(x) else np.empty_like(x)
    out[r] = x[r]  # my own block stays here (a local copy, not a message)
    for step in range(1, p):
        to, frm = (r + step) % p, (r - step) % p
        comm.sendrecv(x[to], to, out[frm], frm, tag=step)
    return out
