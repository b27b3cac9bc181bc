"""Micro-batches pipelined through a stack of tensor-parallel blocks: overlap across layers.

Cut the batch into k micro-batches. They share nothing but the weights, so while micro-batch i's
all-reduce runs, another micro-batch can compute -- in this block or in the next one. Each micro-batch
goes through the same steps (attention of block 0, MLP of block 0, attention of block 1, ...). A step
takes the micro-batch's last all-reduce (its residual add), computes this rank's partial output of the
next half-block, and starts that all-reduce. Issued round-robin over the micro-batches (k = 2):

    compute  [attn0 mb0][attn0 mb1][mlp0 mb0][mlp0 mb1][attn1 mb0][attn1 mb1] ... [mlpL mb1]
    comm                [ar       ][ar       ][ar       ][ar       ][ar       ] ...          [ar]

every all-reduce runs while the other micro-batch computes, across block boundaries too. Only the very
last one is left waiting: 1/(2·L·k) of the stack's communication, where a single block left 1/(2k).
With k = 2 this is the "two-batch overlap" of inference servers. ``tail=t`` cuts that last step into t
pieces of tokens (the MLP works token by token), so that only 1/t of it waits.

    pipeline = MicroBatchPipeline(blocks, chunks=2)   # blocks: tplab.models ParallelBlocks (tensor parallel)
    y = pipeline(x)                                   # = the blocks applied in turn, to rounding

The all-reduces are tplab.overlap's nonblocking ones: a progress thread on CPU ranks, a side stream
with events on GPUs. Autograd flows through (backward is not overlapped). Each micro-batch gets the plain
block's arithmetic on its rows, so the result equals the blocks applied in turn to rounding (smaller GEMMs
may round differently; on CPU ranks it is usually bit for bit).
"""

from __future__ import annotations

import torch
from torch import nn

from tplab.layers import mappings
from tplab.layers.mappings import copy_to_tensor_parallel_region
from tplab.overlap import trace
from tplab.overlap.chunked_mlp import OverlappedMLP
from tplab.overlap.nonblocking import iallreduce
from tplab.overlap.query_blocks import QueryBlocks
from tplab.overlap.pipeline import InFlight, chunk_bounds, count, start_mlp


class MicroBatchPipeline(nn.Module):
    """Tensor-parallel transformer blocks (``norm1, attention, norm2, mlp`` each, pre-norm) applied in turn
    to ``chunks`` micro-batches, each all-reduce overlapping other micro-batches' compute."""

    def __init__(self, blocks, chunks: int = 2, tail: int = 1):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        for block in self.blocks:
            if block.attention.sequence_parallel or block.mlp.sequence_parallel:
                raise NotImplementedError("MicroBatchPipeline: tensor-parallel blocks only")
        chunk_bounds(1, chunks)  # (validates chunks)
        if isinstance(tail, bool) or not isinstance(tail, int) or tail < 1:
            raise ValueError(f"tail must be a positive integer, not {tail!r}")
        self.chunks, self.tail = chunks, tail
        self._mlps = [OverlappedMLP(block.mlp) for block in self.blocks]

    @property
    def comm(self):
        return self.blocks[0].attention.comm

    def forward(self, x, cache=None):  # x: (b, s, h), the same on every rank
        if cache is not None:  # generation with KV caches (one dict per block): run the blocks as they are
            caches = [cache] if isinstance(cache, dict) and len(self.blocks) == 1 else cache
            if isinstance(caches, dict) or len(caches) != len(self.blocks):
                raise ValueError(f"MicroBatchPipeline of {len(self.blocks)} blocks: pass one cache dict per block "
                                 "(a list), as ParallelGPT keeps them")
            for block, block_cache in zip(self.blocks, caches):
                x = x + block.attention(block.norm1(x), block_cache)
                x = x + block.mlp(block.norm2(x))
            return x
        bounds = chunk_bounds(x.shape[0], self.chunks)
        flights = [InFlight(x[a:b]) for a, b in bounds]  # (b_i, s, h) each: micro-batches share no rows
        steps = [(block, half) for block in range(len(self.blocks)) for half in ("attention", "mlp")]
        for n, (block, half) in enumerate(steps):
            for i, flight in enumerate(flights):
                last = n == len(steps) - 1 and i == len(flights) - 1
                flights[i] = self._step(block, half, i, flight.landed(), self.tail if last else 1)
        if torch.is_grad_enabled():
            return torch.cat([flight.landed() for flight in flights])  # (b, s, h)
        out = torch.empty_like(x)  # without autograd: each micro-batch's last residual add writes its rows
        for (a, b), flight in zip(bounds, flights):
            flight.landed(out=out[a:b])
        return out

    def _step(self, index, half, micro_batch, x, pieces):
        """Half-block ``half`` of block ``index`` on micro-batch x (b_i, s, h): its partial output, with its
        all-reduce started (in ``pieces`` pieces of tokens)."""
        block, check = self.blocks[index], mappings.check_arguments
        if half == "attention":
            a = block.attention
            xa = copy_to_tensor_parallel_region(block.norm1(x), a.comm, a.algorithm)  # f of attention
            with trace.span(f"block {index} attention, micro-batch {micro_batch}"):
                partial = QueryBlocks(a, xa).partial(0, x.shape[1])  # (b_i, s, h)
            count("allreduce")
            return InFlight(x, [(partial, iallreduce(partial.detach(), a.comm, algorithm=a.algorithm, check=check))],
                        a.o_bias)
        return start_mlp(self._mlps[index], block.norm2, x, pieces, f"block {index} MLP, micro-batch {micro_batch}")
