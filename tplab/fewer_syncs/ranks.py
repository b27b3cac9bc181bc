"""Who computes which shard: p simulated ranks in one process, or one shard per real MPI rank.

A tensor-parallel block splits its heads and MLP columns into p shards. Two ways to run them:

    SimulatedRanks(p)    this process computes all p shards, one after another (the student project's way: one
                         GPU, no network); an all-reduce is a plain sum over the shards.
    RealRanks(comm)      this process is rank r of p and computes shard r only; an all-reduce is
                         tplab's own collective, through tplab.layers.mappings' f and g.

Both offer the same few things, so a block is written once and runs either way:

    size, local          p, and the shards this process computes ([r], or [0, 1, ..., p-1])
    view(i)              a (rank, size) stand-in for shard i, to build ColumnParallelLinear & co. with
    copy_in(x)           f: x, replicated -> one tensor per local shard     backward: all-reduce of dX
    reduce_out(parts)    g: the local shards' partial results -> their sum over all p shards
                                                                             backward: identity
    shared(*weights)     replicated weights (norms, biases) that each shard applies to its own input:
                         identity forward; backward: their gradients summed over the shards
    sum_over_ranks(t)    for the optimizer (the global gradient norm)

Every all-reduce that f and g run adds one to ``tplab.layers.mappings.calls["allreduce"]`` in both modes
(the simulated sum counts as the all-reduce it stands for): that is how syncs per forward are counted.
``RealRanks(comm, timing=True)`` also clocks the time spent inside them (``comm_seconds``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import tplab
from tplab.layers import mappings
from tplab.layers.mappings import copy_to_tensor_parallel_region, reduce_from_tensor_parallel_region


@dataclass(frozen=True)
class ShardView:
    """What a layer needs to know to build shard ``rank`` of ``size`` (its slice of the weights)."""
    rank: int
    size: int


# ---- simulated ranks: f and g as in the student project (copies forward / sum backward, sum forward / copies back)
class _SimulatedCopy(torch.autograd.Function):
    """f over simulated ranks: every shard reads the same x; autograd adds up the p shards' gradients
    (that sum *is* the all-reduce of the backward pass), and we count it."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        mappings.calls["allreduce"] += 1
        return grad


class _SimulatedSum(torch.autograd.Function):
    """g over simulated ranks: the sum of the p partial results; backward hands each shard the gradient."""

    @staticmethod
    def forward(ctx, *parts):
        mappings.calls["allreduce"] += 1
        ctx.n = len(parts)
        total = parts[0].clone()
        for part in parts[1:]:  # shard 0 + shard 1 + ..., in rank order
            total += part
        return total

    @staticmethod
    def backward(ctx, grad):
        return (grad,) * ctx.n


class _SharedWeights(torch.autograd.Function):
    """Identity on replicated weights (norms, biases) that every shard applies to its *own* input. Each
    rank then holds only its shard's part of their gradient; the true gradient is the sum over shards,
    so the backward pass all-reduces them, all in one flat message (``ranks._sum_weight_grads``).
    Megatron does the same for LayerNorm weights under sequence parallelism. Counted apart from the
    activations' syncs, as calls["weight_grad_allreduce"]."""

    @staticmethod
    def forward(ctx, ranks, *weights):
        ctx.ranks, ctx.like = ranks, [torch.empty_like(w, device="meta") for w in weights]
        return tuple(w.view_as(w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        mappings.calls["weight_grad_allreduce"] += 1
        grads = [torch.zeros(m.shape, dtype=m.dtype, device=_device_of(grads)) if g is None else g
                 for g, m in zip(grads, ctx.like)]  # a weight this rank did not use: no gradient
        return (None, *ctx.ranks._sum_weight_grads(grads))


def _device_of(grads):
    return next(g.device for g in grads if g is not None)


def shared_weights(ranks, tensors):
    """``tensors`` (None allowed) through _SharedWeights, when they take part in autograd."""
    present = [t for t in tensors if t is not None]
    if not present or not torch.is_grad_enabled() or not any(t.requires_grad for t in present):
        return tensors
    passed = iter(_SharedWeights.apply(ranks, *present))
    return tuple(None if t is None else next(passed) for t in tensors)


class _Ranks:
    """What both kinds share: the stopwatch's totals, and replicated weights through _SharedWeights."""

    def reset_clock(self):
        self.comm_seconds = dict(forward=0.0, backward=0.0, weights=0.0, optimizer=0.0)

    def shared(self, *tensors):
        return shared_weights(self, tensors)


class SimulatedRanks(_Ranks):
    """p tensor-parallel ranks simulated in this process (no communication; sums stand in for it)."""

    def __init__(self, p: int):
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"the number of simulated ranks must be a positive integer, not {p!r}")
        self.size = p
        self.local = list(range(p))
        self.reset_clock()

    def view(self, shard: int) -> ShardView:
        return ShardView(shard, self.size)

    def copy_in(self, x):  # (b, s, h) -> [(b, s, h)] * p
        return [_SimulatedCopy.apply(x)] * self.size

    def reduce_out(self, parts):  # p x (b, s, h) -> (b, s, h)
        return _SimulatedSum.apply(*parts)

    def _sum_weight_grads(self, grads):
        return grads  # autograd has already added up the p shards' uses of each weight

    def sum_over_ranks(self, t):
        return t  # every shard is here: sums over shards are already complete

    def __repr__(self):
        return f"<SimulatedRanks p={self.size}>"


# ---- real ranks: tplab's f and g, with an optional stopwatch around each collective ----------------------
def clock(device=None) -> float:
    """time.perf_counter(), after the GPU's queued work is done when ``device`` is a CUDA device (kernels
    run asynchronously: without the wait a stopwatch times only their launch)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class _Clock(torch.autograd.Function):
    """Identity. Its backward starts the clock (``start=True``: placed so that it runs just before f's
    backward all-reduce) or stops it (just after), adding the time to ``comm_seconds["backward"]``."""

    @staticmethod
    def forward(ctx, x, ranks, start):
        ctx.ranks, ctx.start = ranks, start
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ranks = ctx.ranks
        if ctx.start:
            ranks._started = clock(ranks.device)
        else:
            ranks.comm_seconds["backward"] += clock(ranks.device) - ranks._started
        return grad, None, None


class RealRanks(_Ranks):
    """This MPI rank computes shard ``comm.rank`` of ``comm.size``; f and g are tplab.layers.mappings'.
    ``device``: where the tensors live, so the stopwatch waits for a GPU's queued work (None: CPU)."""

    def __init__(self, comm, algorithm="auto", timing: bool = False, device=None):
        self.comm, self.algorithm, self.timing, self.device = comm, algorithm, timing, device
        self.size = comm.size
        self.local = [comm.rank]
        self.reset_clock()

    def view(self, shard: int):
        assert shard == self.comm.rank, "a real rank holds its own shard only"
        return self.comm

    def _allreduce(self, x):
        """Sum over the ranks, not counted as a sync of activations (weights' gradients, the norm)."""
        return tplab.allreduce(x.detach().contiguous(), self.comm, algorithm=self.algorithm)

    def copy_in(self, x):
        if not (self.timing and x.requires_grad):
            return [copy_to_tensor_parallel_region(x, self.comm, self.algorithm)]
        x = _Clock.apply(x, self, False)
        y = copy_to_tensor_parallel_region(x, self.comm, self.algorithm)  # backward: all-reduce of dX
        return [_Clock.apply(y, self, True)]

    def reduce_out(self, parts):
        (part,) = parts
        started = clock(self.device)
        total = reduce_from_tensor_parallel_region(part, self.comm, self.algorithm)
        self.comm_seconds["forward"] += clock(self.device) - started
        return total

    def _sum_weight_grads(self, grads):
        started = clock(self.device)
        flat = torch.cat([g.reshape(-1) for g in grads])  # one message for all of them
        total = self._allreduce(flat)
        self.comm_seconds["weights"] += clock(self.device) - started
        return [part.view_as(g) for part, g in zip(total.split([g.numel() for g in grads]), grads)]

    def sum_over_ranks(self, t):
        started = clock(self.device)
        total = self._allreduce(t)
        self.comm_seconds["optimizer"] += clock(self.device) - started
        return total

    def __repr__(self):
        return f"<RealRanks rank {self.comm.rank} of {self.size}>"
