"""Expert parallelism inside a tensor-parallel model: TP for the attention, EP for the feed-forward layer.

After a TP attention block every rank holds *all* the tokens (the all-reduce replicated them). Sending every
token from every rank would do the experts' work p times; instead each rank takes its own slice of the
tokens (numpy.array_split of the b·s rows: with one token to decode, rank 0 has it and the others have none),
runs the expert-parallel layer on them (two all-to-all-v), and an all-gather puts the replicated
activations back together for the next TP block:

    (b, s, h) replicated --my rows--> EP layer --all-gather (variable lengths)--> (b, s, h) replicated

Backward, the two conjugates (as Megatron's f and g, here along the tokens): everything downstream is
computed alike on every rank, so the gradient of the gathered tensor is the same everywhere and this rank's
rows of it are the gradient of its slice; the slices' gradients are all-gathered into the gradient of the
replicated input, complete on every rank. The router's and a shared expert's weight gradients are this
rank's tokens' share (summed over ranks: the unsplit gradient), as under sequence parallelism.
"""

from __future__ import annotations

import torch
from torch import nn

from tplab.collectives import allgather
from tplab.toolkit.blocks import block_bounds


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mine, total, comm, check):
        ctx.bounds, ctx.rank = block_bounds(total, comm.size), comm.rank
        width = mine.shape[1]
        flat = allgather(mine.detach().contiguous().reshape(-1), comm, algorithm="ring", check=check)
        return flat.reshape(total, width)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.bounds[ctx.rank]:ctx.bounds[ctx.rank + 1]], None, None, None


class _ScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, check):  # x: (rows, h), the same on every rank -> my rows
        ctx.comm, ctx.check, ctx.total = comm, check, x.shape[0]
        bounds = block_bounds(x.shape[0], comm.size)
        return x[bounds[comm.rank]:bounds[comm.rank + 1]].clone()

    @staticmethod
    def backward(ctx, grad):
        width = grad.shape[1]
        flat = allgather(grad.contiguous().reshape(-1), ctx.comm, algorithm="ring", check=ctx.check)
        return flat.reshape(ctx.total, width), None, None


class ReplicatedTokensMoE(nn.Module):
    """An ExpertParallelMoE fed with this rank's slice of replicated tokens; returns replicated outputs."""

    def __init__(self, ep_layer, comm, *, check: bool = True, sequence_parallel: bool = False):
        super().__init__()
        self.ep, self.comm, self.check = ep_layer, comm, check
        self.sequence_parallel = sequence_parallel  # True: x is already this rank's tokens (its slice of the
        # sequence): no slicing, no gather (capacity is then decided in that order, not the unsplit one)

    def forward(self, x):  # (..., h), the same on every rank
        if self.sequence_parallel:
            return self.ep(x)
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        mine = self.ep(_ScatterRows.apply(rows, self.comm, self.check))
        return _GatherRows.apply(mine, rows.shape[0], self.comm, self.check).reshape(shape)
