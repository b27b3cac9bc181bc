"""The TP block: Megatron-LM's tensor-parallel transformer block. 2 all-reduces forward, 2 backward.

    x ──LN1──f──▶ attention of my heads ──g──(+ bias)──▶ x + attn(LN1(x))          = h
    h ──LN2──f──▶ MLP columns of mine  ──g──(+ bias)──▶ h + mlp(LN2(h))            = output

f: identity forward, all-reduce backward. g: all-reduce forward, identity backward. Between the two
syncs every rank holds the same h, so this block computes *exactly* the unsplit block (the tests check
it to ~1e-12 in float64): splitting it changes where the arithmetic happens, not what it is.
"""

from __future__ import annotations

from tplab.fewer_syncs.shard import ShardedBlock, add


class TPBlock(ShardedBlock):
    syncs_forward = 2  # one g after the attention, one after the MLP

    def forward(self, x):  # (b, s, h), the same on every rank
        ranks = self.ranks
        parts = ranks.copy_in(self.norm1(x))  # f: one (b, s, h) per local shard
        attn = ranks.reduce_out([shard.attention(xi) for shard, xi in zip(self.shards, parts)])  # g
        x = x + add(attn, self.attn_bias)  # (b, s, h): every head's contribution, on every rank

        parts = ranks.copy_in(self.norm2(x))  # f
        mlp = ranks.reduce_out([shard.mlp(xi) for shard, xi in zip(self.shards, parts)])  # g
        return x + add(mlp, self.mlp_bias)
