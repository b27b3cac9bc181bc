"""The pieces every overlapped layer is made of: chunk bounds, results of nonblocking collectives wired
into autograd, and rows in flight between two half-blocks (InFlight, start_mlp).

A nonblocking collective is started on a tensor that autograd knows (chunk i's partial product) and
finishes later, as a plain tensor autograd knows nothing about. ``arrived(x, result, conjugate)`` puts
it back in the graph: forward returns ``result`` unchanged (bit for bit), backward hands the gradient to
``x`` through ``conjugate``, the collective's partner from Megatron's table (tplab.layers.mappings):

    forward collective            conjugate in backward (blocking: backward is not overlapped here)
    all-reduce (g)                identity
    all-gather along the sequence reduce-scatter along the sequence
    reduce-scatter along the seq. all-gather along the sequence
"""

from __future__ import annotations

import torch

from tplab.toolkit.blocks import block_bounds
from tplab.layers import mappings


class _Arrived(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, result, conjugate):
        ctx.conjugate = conjugate
        return result

    @staticmethod
    def backward(ctx, grad):
        return ctx.conjugate(grad), None, None


def arrived(x, result, conjugate):
    """``result`` (the finished collective of ``x``), with gradients flowing to ``x`` via ``conjugate``."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return result
    return _Arrived.apply(x, result, conjugate)


def identity(grad):
    return grad


def chunk_bounds(length: int, chunks: int) -> list[tuple[int, int]]:
    """``chunks`` consecutive (start, end) ranges covering 0..length, cut like numpy.array_split (sizes
    differ by at most one); fewer when there are fewer than ``chunks`` items (no empty chunks)."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, not {chunks!r}")
    bounds = block_bounds(length, min(chunks, max(length, 1)))
    return list(zip(bounds[:-1], bounds[1:]))


def count(kind: str, n: int = 1) -> None:
    """Count collectives where tplab.layers counts them (``mappings.calls``)."""
    mappings.calls[kind] += n


class InFlight:
    """Rows between two steps of an overlapped block: their residual stream ``x`` and the started all-reduces
    of the partial output to be added to it (one, or one per piece of tokens), with the bias that follows the
    sum (the bias of the row-parallel layer that made the partial output)."""

    def __init__(self, x, started=(), bias=None):
        self.x, self.started, self.bias = x, list(started), bias

    def landed(self, out=None):
        """x + the reduced output (the residual stream after this half-block), written into ``out`` if given."""
        if not self.started:
            return self.x if out is None else out.copy_(self.x)
        ys = [arrived(part, handle.wait(), identity) for part, handle in self.started]
        y = (ys[0] if len(ys) == 1 else torch.cat(ys)).view(self.x.shape)
        y = y + self.bias if self.bias is not None else y
        return self.x + y if out is None else torch.add(self.x, y, out=out)


def start_mlp(overlapped_mlp, norm, x, pieces: int, name: str) -> InFlight:
    """The MLP half-block on rows x (..., h), the residual stream after attention: this rank's partial output
    of mlp(norm(x)), its all-reduce started -- in ``pieces`` pieces of tokens, each as soon as it is computed."""
    from tplab.layers.mappings import copy_to_tensor_parallel_region
    from tplab.overlap import trace
    from tplab.overlap.nonblocking import iallreduce

    mlp = overlapped_mlp.mlp
    hidden = copy_to_tensor_parallel_region(norm(x), mlp.comm, mlp.algorithm)  # f of the MLP
    tokens = hidden.reshape(-1, hidden.shape[-1])  # (n, h)
    bounds = chunk_bounds(tokens.shape[0], pieces)
    started = []
    for j, (start, end) in enumerate(bounds):
        with trace.span(name + (f" piece {j}" if len(bounds) > 1 else "")):
            part = overlapped_mlp.partial(tokens[start:end])  # (n_j, h): this rank's share of the sum
        count("allreduce")
        started.append((part, iallreduce(part.detach(), mlp.comm, algorithm=mlp.algorithm,
                                         check=mappings.check_arguments)))
    return InFlight(x, started, mlp.down.bias)
