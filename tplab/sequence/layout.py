"""Which tokens each rank holds: contiguous chunks, or zig-zag chunks that balance causal attention.

The sequence of s tokens is cut into equal chunks and the chunks are dealt out to p ranks:

    contiguous   p chunks of s/p tokens; rank i holds chunk i
                 s = 8, p = 2:   rank 0: 0 1 2 3          rank 1: 4 5 6 7
    zigzag       2p chunks of s/(2p) tokens; rank i holds chunks i and 2p-1-i
                 s = 8, p = 2:   rank 0: 0 1 | 6 7        rank 1: 2 3 | 4 5

Why zig-zag: with a causal mask a query at position t looks at keys 0..t only. Under the contiguous
layout rank 0's queries see just their own chunk while rank p-1's see the whole sequence: rank p-1 does
2p-1 times the work of rank 0 and everyone waits for it. Pairing an early chunk with a late one gives
every rank the same amount of work (cost/sequence_parallel.py: ``causal_work``).

A rank's local tensor holds its chunks one after the other, in the order ``my_chunks`` lists them.
"""

from __future__ import annotations

import torch

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: choose one of {list(LAYOUTS)}")


def num_chunks(p: int, layout: str) -> int:
    check_layout(layout)
    return p if layout == "contiguous" else 2 * p


def my_chunks(rank: int, p: int, layout: str) -> list[int]:
    """The chunk indices rank ``rank`` holds, in the order they sit in its local tensor."""
    check_layout(layout)
    return [rank] if layout == "contiguous" else [rank, 2 * p - 1 - rank]


def chunk_length(seq_len: int, p: int, layout: str) -> int:
    """Tokens per chunk; a clear error when the sequence does not cut into equal chunks."""
    chunks = num_chunks(p, layout)
    if seq_len % chunks:
        raise ValueError(f"a sequence of {seq_len} tokens cannot be cut into {chunks} equal chunks "
                         f"({layout} layout on {p} ranks): use a length divisible by {chunks}")
    return seq_len // chunks


def positions(seq_len: int, p: int, rank: int, layout: str) -> torch.Tensor:
    """Global positions of this rank's tokens, in local order (int64, on the CPU)."""
    length = chunk_length(seq_len, p, layout)
    return torch.cat([torch.arange(c * length, (c + 1) * length) for c in my_chunks(rank, p, layout)])


def gathered_positions(seq_len: int, p: int, layout: str) -> torch.Tensor:
    """Global positions of the tokens of an all-gather (rank 0's local tokens, then rank 1's, ...)."""
    return torch.cat([positions(seq_len, p, r, layout) for r in range(p)])


def shard(x: torch.Tensor, rank: int, p: int, layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """This rank's tokens of the full tensor ``x`` (sequence along ``dim``), as a contiguous copy."""
    index = positions(x.shape[dim], p, rank, layout).to(x.device)
    return x.index_select(dim, index).contiguous()


def to_global_order(gathered: torch.Tensor, p: int, layout: str, dim: int) -> torch.Tensor:
    """Reorder an all-gathered tensor (rank-by-rank order along ``dim``) into sequence order."""
    if layout == "contiguous" or p == 1:
        return gathered  # rank order is sequence order
    order = gathered_positions(gathered.shape[dim], p, layout)
    return gathered.index_select(dim, torch.argsort(order).to(gathered.device))


def from_global_order(full: torch.Tensor, p: int, layout: str, dim: int) -> torch.Tensor:
    """The inverse of ``to_global_order``: sequence order -> rank-by-rank order."""
    if layout == "contiguous" or p == 1:
        return full
    return full.index_select(dim, gathered_positions(full.shape[dim], p, layout).to(full.device))
