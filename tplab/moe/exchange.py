"""All-to-all-v as an autograd function: the backward pass of an exchange is the exchange the other way.

Dispatch sends ``send_counts[j]`` token rows to rank j and receives ``recv_counts[j]`` from it; the gradient
of what was received must go back to where the rows came from: the same exchange with the counts swapped.
Combine is the mirror image. (tplab.collectives.alltoallv, pairwise exchange, does the moving.)
"""

from __future__ import annotations

import torch

from tplab.collectives.alltoallv import alltoallv


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, comm, check):
        ctx.send_counts, ctx.recv_counts, ctx.comm = send_counts, recv_counts, comm
        return alltoallv(x.detach(), send_counts, comm, recv_counts, check=check)

    @staticmethod
    def backward(ctx, grad):
        back = alltoallv(grad.contiguous(), ctx.recv_counts, ctx.comm, ctx.send_counts, check=False)
        return back, None, None, None, None


def exchange(x, send_counts, recv_counts, comm, check: bool = True):
    """Differentiable all-to-all-v of the rows of ``x`` (counts as lists of p ints, known on both sides)."""
    return _AllToAllV.apply(x, list(send_counts), list(recv_counts), comm, check)
