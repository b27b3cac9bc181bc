"""Chunked pipelining for attention, and for a whole transformer block across its two halves.

Attention (tensor parallel, heads split): Q, K, V are projected for the whole sequence (every query
needs every earlier key), then the *queries* are cut into k blocks. Query block i's attention and output
projection give rows i of this rank's partial output, whose all-reduce runs while block i+1 is computed:

    compute  [QKV][attn+proj q-block 0][q-block 1][q-block 2][q-block 3]
    comm                               [ar 0]     [ar 1]     [ar 2]     [ar 3]

(causal: query block i attends to keys 0..end of block i, so later blocks cost more.)

A block (x + attention(norm1(x)), then + mlp(norm2(x))) pipelines across its halves: the MLP works token
by token, so the MLP of rows i may start as soon as rows i of the attention output have been reduced --
while attention block i+1 is computed. Then only the MLP's last all-reduce is left exposed:

    compute  [attn 0][attn 1][mlp 0][attn 2][mlp 1][attn 3][mlp 2][mlp 3]
    comm             [ar a0] [ar a1][ar m0] [ar a2][ar m1] [ar a3][ar m2][ar m3]

This is "overlap across layers where the math allows": the data dependence is per token, so it allows.
``tail=t`` cuts the last chunk's MLP into t pieces of tokens (an MLP works token by token), each piece's
all-reduce starting while the next piece is computed: what is left waiting at the end shrinks from 1/k of
the MLP's all-reduce to 1/(k·t).
Generation with a KV cache (one new token: nothing to cut) runs the wrapped layer unchanged.

``overlapped(block, k, split="batch")`` cuts the batch instead (k micro-batches, like a pipeline's): they
share nothing but weights, so even the QKV projection is per micro-batch and nothing runs for the whole
batch before the first all-reduce can start; the price is k smaller GEMMs instead of one (and k <= batch).
That is micro_batches.py's MicroBatchPipeline, which also pipelines micro-batches through a stack of blocks.
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
from tplab.overlap.pipeline import InFlight, arrived, chunk_bounds, count, identity, start_mlp


def _tensor_parallel_only(attention, what):
    if attention.sequence_parallel:
        raise NotImplementedError(f"{what}: overlap for sequence-parallel attention is not implemented (the "
                                  "reduce-scatter of a query block does not give each rank its own slice); "
                                  "use the tensor-parallel layer, or OverlappedMLP for the sequence-parallel MLP")


class OverlappedAttention(nn.Module):
    """A (tensor-parallel) ParallelAttention whose output all-reduce is pipelined over query blocks."""

    def __init__(self, attention, chunks: int = 4):
        super().__init__()
        _tensor_parallel_only(attention, "OverlappedAttention")
        self.attention, self.chunks = attention, chunks

    @property
    def comm(self):
        return self.attention.comm

    def forward(self, x, cache=None):  # x: (b, s, h), the same on every rank
        a = self.attention
        if cache is not None:
            return a(x, cache)
        x = copy_to_tensor_parallel_region(x, a.comm, a.algorithm)  # f
        with trace.span("QKV projection"):
            blocks = QueryBlocks(a, x)
        handles, partials = [], []
        for i, (start, end) in enumerate(chunk_bounds(x.shape[1], self.chunks)):
            with trace.span(f"attention q-block {i}"):
                partial = blocks.partial(start, end)  # (b, s_i, h)
            count("allreduce")
            handles.append(iallreduce(partial.detach(), a.comm, algorithm=a.algorithm, check=mappings.check_arguments))
            partials.append(partial)
        y = torch.cat([arrived(p, h.wait(), identity) for p, h in zip(partials, handles)], dim=1)  # (b, s, h)
        return y + a.o_bias if a.o_bias is not None else y


class OverlappedBlock(nn.Module):
    """A tensor-parallel transformer block (tplab.models' ParallelBlock, or its four parts) pipelined over
    ``chunks`` blocks of the sequence, attention's all-reduces overlapping attention, the MLP's the MLP."""

    def __init__(self, norm1, attention, norm2, mlp, chunks: int = 4, tail: int = 1):
        super().__init__()
        _tensor_parallel_only(attention, "OverlappedBlock")
        if mlp.sequence_parallel:
            raise NotImplementedError("OverlappedBlock: tensor-parallel blocks only")
        if isinstance(tail, bool) or not isinstance(tail, int) or tail < 1:
            raise ValueError(f"tail must be a positive integer, not {tail!r}")
        self.norm1, self.attention, self.norm2, self.mlp, self.chunks = norm1, attention, norm2, mlp, chunks
        self.tail = tail
        self._mlp = OverlappedMLP(mlp)

    @classmethod
    def from_block(cls, block, chunks: int = 4, tail: int = 1) -> "OverlappedBlock":
        return cls(block.norm1, block.attention, block.norm2, block.mlp, chunks, tail)

    @property
    def comm(self):
        return self.attention.comm

    def forward(self, x, cache=None):  # x: (b, s, h), the same on every rank
        a, mlp = self.attention, self.mlp
        if cache is not None:  # one token at a time: nothing to pipeline
            x = x + a(self.norm1(x), cache)
            return x + mlp(self.norm2(x))
        check = mappings.check_arguments
        xa = copy_to_tensor_parallel_region(self.norm1(x), a.comm, a.algorithm)  # f of attention
        bounds = chunk_bounds(x.shape[1], self.chunks)
        with trace.span("QKV projection"):
            blocks = QueryBlocks(a, xa)                    # every query block needs every key
        attn, mlp_out = [], []  # per chunk: rows in flight after its attention, after its MLP

        def rows(t, i):  # (b, s_i, h)
            return t[:, bounds[i][0]:bounds[i][1]]

        def attention_chunk(i):
            with trace.span(f"attention q-block {i}"):
                partial = blocks.partial(*bounds[i])  # (b, s_i, h)
            count("allreduce")
            handle = iallreduce(partial.detach(), a.comm, algorithm=a.algorithm, check=check)
            attn.append(InFlight(rows(x, i), [(partial, handle)], a.o_bias))

        def mlp_chunk(i):  # needs chunk i's attention all-reduce: started one attention chunk ago
            # The last chunk's all-reduce is the one nothing overlaps: cut its MLP into `tail` pieces of
            # tokens, so that only the last piece's all-reduce is left waiting at the end.
            pieces = self.tail if i == len(bounds) - 1 else 1
            mlp_out.append(start_mlp(self._mlp, self.norm2, attn[i].landed(), pieces, f"MLP chunk {i}"))

        for i in range(len(bounds)):
            attention_chunk(i)
            if i > 0:
                mlp_chunk(i - 1)
        mlp_chunk(len(bounds) - 1)
        # Chunk by chunk, in order: the residual adds of the early chunks run while the last all-reduce does.
        # Without autograd they write straight into the output (no concatenation at the end: one pass fewer
        # over the whole activation).
        if torch.is_grad_enabled():
            return torch.cat([flight.landed() for flight in mlp_out], dim=1)  # (b, s, h)
        out = torch.empty_like(x)
        for i, flight in enumerate(mlp_out):
            flight.landed(out=rows(out, i))
        return out
