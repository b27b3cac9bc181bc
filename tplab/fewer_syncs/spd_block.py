"""The SPD block: the attention's all-reduce dropped, merged into the MLP's. 1 all-reduce forward.

The student project's SPD_Block (it cites arXiv 2210.09127 and 2502.20727, Sync-Point Drop). For rank i of p,
with its heads' share p_i = attn_i(LN1(x)) of the attention output (no bias) and b_a, b_m the output biases:

    y_i  = x + p_i + b_a                    the residual with *my* heads only: no sum, no sync here
    z_i  = p_i + mlp_i(LN2(y_i))            my share of the attention plus my share of the MLP
    out  = x + g(z_0 + ... + z_{p-1}) + b_a + b_m       one all-reduce for both

Compare the TP block, whose MLP reads h = x + (p_0 + ... + p_{p-1}) + b_a: here rank i's MLP sees the
residual stream with only its own heads' contribution. That is a *different function* (the model must
be trained as such), not an approximation of the TP block; at p = 1 the two coincide.

LN1, LN2 and b_a are replicated but each rank applies them to its own input, so each rank holds only
its share of their gradient: ``ranks.shared`` sums those shares in the backward pass (one small message).
"""

from __future__ import annotations

from tplab.fewer_syncs.shard import ShardedBlock, add, layer_norm


class SPDBlock(ShardedBlock):
    syncs_forward = 1  # the one g at the end

    def forward(self, x):  # (b, s, h), the same on every rank
        ranks = self.ranks
        w1, b1, w2, b2, attn_bias = ranks.shared(self.norm1.weight, self.norm1.bias, self.norm2.weight,
                                                 self.norm2.bias, self.attn_bias)
        z = []
        for shard, xi in zip(self.shards, ranks.copy_in(x)):  # f: once for the whole block
            pi = shard.attention(layer_norm(xi, self.norm1, w1, b1))  # (b, s, h), my heads only
            yi = add(xi + pi, attn_bias)  # residual with my heads' share: the dropped sync point
            z.append(pi + shard.mlp(layer_norm(yi, self.norm2, w2, b2)))
        out = x + ranks.reduce_out(z)  # g: the attention's and the MLP's all-reduce in one
        return add(add(out, self.mlp_bias), self.attn_bias)
