"""The pieces every overlapped layer is made of: chunk bounds, and results of nonblocking collectives
wired into autograd.

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

from tplab.blocks import block_bounds
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
