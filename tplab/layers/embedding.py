"""The vocabulary split across ranks: the input embedding and the LM head (output projection).

    VocabParallelEmbedding   rank i holds rows [i·V/p, (i+1)·V/p) of the table. Each rank looks up the
                             tokens that fall in its rows (zeros for the others) and an all-reduce (g)
                             adds the p partial results: every token's row comes from exactly one rank.
    ParallelLMHead           logits = h W^T with W split by vocabulary rows: column-parallel; each rank
                             computes V/p logits, gather_output=True all-gathers them (the full logits,
                             as `generate` needs them), else they stay split (for a parallel cross-entropy).

The vocabulary must split evenly (pad it, as Megatron does, if a model's does not).
"""

from __future__ import annotations

import torch
from torch import nn

from tplab.layers.linear import ColumnParallelLinear, _shard_size
from tplab.layers.mappings import reduce_from_tensor_parallel_region


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, comm, algorithm="auto", dtype=None):
        super().__init__()
        self.comm, self.algorithm = comm, algorithm
        self.rows = _shard_size(num_embeddings, comm.size, "vocabulary size")
        self.first = comm.rank * self.rows  # my rows: [first, first + rows)
        self.weight = nn.Parameter(torch.randn(self.rows, embedding_dim, dtype=dtype))

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, comm, **kwargs) -> "VocabParallelEmbedding":
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, comm, dtype=embedding.weight.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(embedding.weight[layer.first:layer.first + layer.rows])
        return layer

    def local(self, tokens):
        """This rank's share of the lookup, no communication: the rows it holds, zeros for the others.
        (Summed over ranks it is the full lookup: g all-reduces it; sequence parallelism reduce-scatters.)"""
        local = tokens - self.first
        outside = (local < 0) | (local >= self.rows)
        found = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)  # (..., h)
        return found.masked_fill(outside.unsqueeze(-1), 0.0)  # rows another rank holds: zero here

    def forward(self, tokens):  # tokens: (b, s) integers, the same on every rank
        return reduce_from_tensor_parallel_region(self.local(tokens), self.comm, self.algorithm)  # g


class ParallelLMHead(ColumnParallelLinear):
    """A column-parallel linear over the vocabulary, without bias; gathers the logits by default."""

    def __init__(self, hidden_size, vocab_size, comm, gather_output=True, algorithm="auto", dtype=None, bias=False):
        if bias:
            raise ValueError("an LM head has no bias")
        super().__init__(hidden_size, vocab_size, comm, bias=False, gather_output=gather_output,
                         algorithm=algorithm, dtype=dtype)
