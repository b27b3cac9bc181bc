"""DeepSpeed Ulysses (Jacobs et al., arXiv 2309.14509): trade the sequence split for a head split.

Attention heads are independent of each other, and each head needs the whole sequence. So instead of
moving K and V to the queries, Ulysses re-deals the data: an all-to-all turns "my tokens, all heads"
into "all tokens, my heads", each rank runs ordinary attention for n/p heads, and a second all-to-all
turns the output back:

    q, k, v  (b, n, s/p, d)   my tokens, every head
      --all-to-all-->  (b, n/p, s, d)   every token, my heads       (3 all-to-alls: q, k, v)
    out = attention(q, k, v)            plain full attention, no communication
      --all-to-all-->  (b, n, s/p, d)   back to my tokens            (1 all-to-all)

Bytes sent per rank (pairwise all-to-all: (p-1)/p of each rank's tensor): (p-1)/p · b·(s/p)·(2h + 2h_kv)·
bytes, about 4·N·h/p for N = b·s tokens and h_kv = h (tplab.cost.sequence_parallel): the volume per rank *falls* as
1/p, while the all-gather's 2(p-1)/p·N·h_kv grows towards 2·N·h_kv. The price: the heads (query and
key/value heads) must divide by p — a clear error otherwise — and p is capped by the head count.

Causal needs no balancing here: every rank runs the whole sequence for its heads. The all-to-all's
backward is the all-to-all that sends the blocks back, so Ulysses is differentiable.
"""

from __future__ import annotations

import torch

from tplab.collectives.alltoall import alltoall
from tplab.layers.attend import attend
from tplab.sequence.checks import check_attention_inputs
from tplab.sequence.layout import from_global_order, to_global_order


class _AllToAll(torch.autograd.Function):
    """(p, ...) blocks, block j for rank j -> (p, ...) blocks, block j from rank j; its own adjoint."""

    @staticmethod
    def forward(ctx, blocks, comm, check):
        ctx.comm = comm
        return alltoall(blocks.detach(), comm, check=check)

    @staticmethod
    def backward(ctx, grad):
        return alltoall(grad.contiguous(), ctx.comm, check=False), None, None


def sequence_to_heads(x: torch.Tensor, comm, check: bool = False) -> torch.Tensor:
    """(b, n, s/p, d) my tokens of all heads -> (b, n/p, s, d) all tokens (rank by rank) of my heads."""
    b, n, s_local, d = x.shape
    p = comm.size
    blocks = x.reshape(b, p, n // p, s_local, d).transpose(0, 1)  # (p, b, n/p, s/p, d): head group j -> rank j
    received = _AllToAll.apply(blocks.contiguous(), comm, check)  # (p, b, n/p, s/p, d): rank j's tokens
    return received.permute(1, 2, 0, 3, 4).reshape(b, n // p, p * s_local, d)


def heads_to_sequence(x: torch.Tensor, comm, check: bool = False) -> torch.Tensor:
    """(b, n/p, s, d) all tokens (rank by rank) of my heads -> (b, n, s/p, d) my tokens of all heads."""
    b, n_mine, s, d = x.shape
    p = comm.size
    blocks = x.reshape(b, n_mine, p, s // p, d).permute(2, 0, 1, 3, 4)  # (p, b, n/p, s/p, d): rank j's tokens
    received = _AllToAll.apply(blocks.contiguous(), comm, check)  # (p, b, n/p, s/p, d): head group j
    return received.transpose(0, 1).reshape(b, p * n_mine, s // p, d)


def ulysses_attention(q, k, v, comm, *, causal: bool = True, layout: str = "contiguous",
                      check: bool = True) -> torch.Tensor:
    """q (b, n, s/p, d), k, v (b, n_kv, s/p, d): this rank's tokens  ->  (b, n, s/p, d)."""
    if check:
        check_attention_inputs(q, k, v, comm, layout, heads_divisible=True)
    p = comm.size
    q_h, k_h, v_h = (sequence_to_heads(t, comm) for t in (q, k, v))  # (b, n/p or n_kv/p, s, d)
    q_h, k_h, v_h = (to_global_order(t, p, layout, dim=2) for t in (q_h, k_h, v_h))  # sequence order
    out = attend(q_h, k_h, v_h, causal=causal)  # (b, n/p, s, d); attend repeats the K/V heads (GQA)
    return heads_to_sequence(from_global_order(out, p, layout, dim=2), comm)  # (b, n, s/p, d)
