"""Parallel blocks (pattern entry 'parallel'): no sync at all inside a run of consecutive parallel blocks.

The student project's Parallel_Block, here ``UnsyncedBlock`` (tplab.models' ParallelBlock is Megatron's tensor-parallel
block, a different thing): attention and MLP one after the other, as in any GPT block, but each rank on
its own residual stream, with no sync. The first block of a run copies x to every rank (f), every rank
then carries *its own* residual stream x_i through the run, and the last block sums what the ranks added
(g):

    x_i = x                                   f at the start of the run (no data moves forward)
    for each block in the run, on every rank i, no communication:
        p_i  = attn_i(LN1(x_i))               my heads, on my stream
        z_i  = p_i + mlp_i(LN2(x_i + p_i))    (the SPD update, without the output biases)
        x_i  = x_i + z_i
    out = x + g(sum over i of (x_i - x))      g at the end: one all-reduce for the whole run

A run of one block is the project's first-and-last Parallel_Block: out = x + g(z_0 + ... + z_{p-1}), the
SPD block without b_a and b_m (the project gives Parallel_Block no output biases). For longer runs the project's
code leaves the middle blocks undefined; this is the reading its text gives ("middle blocks keep the
expanded [TP, B, T, C] tensor", "residuals inside each rank's forward_worker, so none is counted twice"):
the collapse adds each rank's *increment* x_i - x, never x itself p times.

Between the ends, rank i's stream sees only its own heads and MLP columns, for as many blocks as the run
is long: the ranks drift apart, and only training can make the model work that way.
"""

from __future__ import annotations

from torch import nn

from tplab.fewer_syncs.shard import ShardedBlock, layer_norm


class UnsyncedBlock(ShardedBlock):
    """One block of a run: each rank updates its own stream with its own heads and MLP columns."""

    keeps_output_biases = False

    def update(self, shard, xi, norms):
        """z_i: what rank i's shard adds to rank i's stream ``xi`` (b, s, h). No communication."""
        w1, b1, w2, b2 = norms
        pi = shard.attention(layer_norm(xi, self.norm1, w1, b1))
        return pi + shard.mlp(layer_norm(xi + pi, self.norm2, w2, b2))


class ParallelRun(nn.Module):
    """Consecutive parallel blocks (UnsyncedBlocks): f before the first, g after the last, nothing in between."""

    syncs_forward = 1

    def __init__(self, blocks, ranks):
        super().__init__()
        self.blocks, self.ranks = nn.ModuleList(blocks), ranks

    @classmethod
    def from_dense(cls, dense_blocks, ranks) -> "ParallelRun":
        return cls([UnsyncedBlock(block, ranks) for block in dense_blocks], ranks)

    def forward(self, x):  # (b, s, h), the same on every rank
        ranks = self.ranks
        streams = ranks.copy_in(x)  # f: from here on, one residual stream per rank
        added = [0.0] * len(streams)  # what each rank's blocks added to its stream: x_i - x
        for block in self.blocks:
            norms = ranks.shared(block.norm1.weight, block.norm1.bias, block.norm2.weight, block.norm2.bias)
            for j, shard in enumerate(block.shards):
                zi = block.update(shard, streams[j], norms)
                streams[j], added[j] = streams[j] + zi, added[j] + zi
        return x + ranks.reduce_out(added)  # g: the one all-reduce of the run
