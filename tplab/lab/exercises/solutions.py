"""One solution to each exercise of notebooks 01-04 and 09 (try first!). A notebook runs them only with
``show_solutions = True``; the tests check that every one passes its checker.

    01  ring_allreduce, ring_reduce_scatter
    02  ring_allreduce_time, busiest_rank_bytes
    03  crossover, decide
    04  column_parallel_forward, row_parallel_forward
    09  dispatch_order, pairwise_alltoall
"""

from __future__ import annotations

import math

import numpy as np

from tplab.toolkit.blocks import block_bounds


# ---- 01: collectives from point-to-point messages -----------------------------------------------------------
def ring_allreduce(x, comm):
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    buf = x.copy()
    b = block_bounds(buf.size, p)
    block = lambda i: buf[b[i % p]:b[i % p + 1]]
    incoming = np.empty_like(buf)
    for s in range(p - 1):  # reduce-scatter: after it, rank r holds the whole sum of block r
        send, recv = block(r - s - 1), block(r - s - 2)
        recv += comm.sendrecv(send, right, incoming[:recv.size], left)
    for s in range(p - 1):  # allgather: pass the finished blocks around the ring
        comm.sendrecv(block(r - s), right, block(r - s - 1), left)
    return buf


def ring_reduce_scatter(x, comm):
    """Rank r returns block r of the sum. Step s sends the partial sum of block r-s-1 to the right and adds
    the incoming partial sum of block r-s-2: the last one it adds (s = p-2) is its own block r."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    buf = x.copy()
    b = block_bounds(buf.size, p)
    block = lambda i: buf[b[i % p]:b[i % p + 1]]
    incoming = np.empty_like(buf)
    for s in range(p - 1):
        send, recv = block(r - s - 1), block(r - s - 2)
        recv += comm.sendrecv(send, right, incoming[:recv.size], left)
    return block(r).copy()


# ---- 02: the cost model ---------------------------------------------------------------------------------------
def ring_allreduce_time(p, n, alpha, beta, gamma):
    """2(p-1) steps of n/p bytes; the reduce-scatter half also adds what it receives."""
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma


def busiest_rank_bytes(algorithm, p, n):
    """Bytes the busiest rank sends in one all-reduce of n bytes per rank (p a power of two)."""
    lg = int(math.log2(p))
    return {"naive": (p - 1) * n,                 # rank 0 sends the result to every other rank
            "ring": 2 * (p - 1) / p * n,          # 2(p-1) blocks of n/p
            "recursive_doubling": lg * n,         # the whole vector in each of lg p steps
            "tree": lg * n}[algorithm]            # the root sends the whole vector in each round


# ---- 03: reading measurements ----------------------------------------------------------------------------------
def crossover(df, small, large):
    """The smallest measured size from which ``large`` is faster than ``small`` at every larger size."""
    times = df.pivot_table(index="size", columns="algorithm", values="time_us").sort_index()
    answer = None
    for size in reversed(times.index):
        if times.loc[size, large] < times.loc[size, small]:
            answer = int(size)
        else:
            break
    return answer


def decide(df, nbytes):
    """The fastest correct hand-written algorithm at the measured size nearest to nbytes (log scale)."""
    candidates = df[~df.algorithm.isin(["builtin", "auto"]) & (df["wrong"] == 0)]
    sizes = sorted(candidates["size"].unique())
    nearest = min(sizes, key=lambda s: (abs(math.log2(s) - math.log2(max(nbytes, 1))), s))
    at = candidates[candidates["size"] == nearest]
    return at.loc[at["time_us"].idxmin(), "algorithm"]


# ---- 04: Megatron's column and row splits ----------------------------------------------------------------------
def column_parallel_forward(x, weight, bias, comm):
    """f (identity forward, all-reduce of the gradient backward), then this rank's output features."""
    from tplab.layers.mappings import copy_to_tensor_parallel_region

    x = copy_to_tensor_parallel_region(x, comm)
    return x @ weight.T + bias


def row_parallel_forward(x, weight, bias, comm):
    """This rank's partial product, g (all-reduce forward, identity backward), then the bias, once."""
    from tplab.layers.mappings import reduce_from_tensor_parallel_region

    return reduce_from_tensor_parallel_region(x @ weight.T, comm) + bias


# ---- 09: mixture of experts ---------------------------------------------------------------------------------------
def dispatch_order(experts, num_experts):
    """A stable sort of the flattened assignments by expert keeps token order inside each expert."""
    import torch

    flat = experts.reshape(-1)
    return torch.sort(flat, stable=True).indices, torch.bincount(flat, minlength=num_experts)


def pairwise_alltoall(x, comm):
    """Step k sends my block for rank r+k and receives rank r-k's block for me: each pair meets once."""
    p, r = comm.size, comm.rank
    out = np.empty_like(x)
    out[r] = x[r]
    for k in range(1, p):
        comm.sendrecv(np.ascontiguousarray(x[(r + k) % p]), (r + k) % p, out[(r - k) % p], (r - k) % p)
    return out
