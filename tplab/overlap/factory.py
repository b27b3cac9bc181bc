"""overlapped(layer, k): the overlapped version of any tplab layer, block or stack of blocks."""

from __future__ import annotations

from torch import nn

from tplab.layers import ParallelAttention, ParallelMLP, RowParallelLinear
from tplab.overlap.chunked_attention import OverlappedAttention, OverlappedBlock
from tplab.overlap.chunked_mlp import OverlappedMLP, OverlappedRowParallelLinear
from tplab.overlap.micro_batches import MicroBatchPipeline


def overlapped(module, chunks: int = 4, split: str = "sequence", tail: int = 1):
    """The overlapped version of a tplab layer: ParallelMLP, RowParallelLinear, ParallelAttention, or a
    ParallelBlock (tplab.models); a block -- or a list of blocks, applied in turn -- may also be cut into
    micro-batches (``split="batch"``, MicroBatchPipeline), and its last chunk's MLP into ``tail`` pieces
    (the last all-reduce, which nothing else overlaps, shrinks)."""
    if isinstance(module, ParallelMLP):
        return OverlappedMLP(module, chunks)
    if isinstance(module, RowParallelLinear):
        return OverlappedRowParallelLinear(module, chunks)
    if isinstance(module, ParallelAttention):
        return OverlappedAttention(module, chunks)
    if split not in ("sequence", "batch"):
        raise ValueError(f"split must be 'sequence' or 'batch', not {split!r}")
    if isinstance(module, (list, tuple, nn.ModuleList, nn.Sequential)):  # a stack of blocks: micro-batches across layers
        if split != "batch":
            raise ValueError("a stack of blocks is pipelined in micro-batches: pass split='batch'")
        return MicroBatchPipeline(list(module), chunks, tail)
    if all(hasattr(module, name) for name in ("norm1", "attention", "norm2", "mlp")):
        if split == "batch":
                return MicroBatchPipeline([module], chunks, tail)
        return OverlappedBlock.from_block(module, chunks, tail)
    raise TypeError(f"no overlapped version of {type(module).__name__}: ParallelMLP, RowParallelLinear, "
                    "ParallelAttention or a ParallelBlock")
