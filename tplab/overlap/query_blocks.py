"""Attention by blocks of queries: Q, K, V of this rank's heads computed once for the whole sequence, then
attention and the output projection for any range of query positions (the chunks that overlap their
all-reduce with the next chunk's compute: chunked_attention.py, micro_batches.py)."""

from __future__ import annotations

from tplab.layers.attend import attend


class QueryBlocks:
    """Q, K, V of this rank's heads for the whole sequence, and attention + output projection by query block."""

    def __init__(self, attention, x):  # x: (b, s, h), after f
        a, (b, s, _) = attention, x.shape
        d = a.head_dim
        q = a.q_proj(x).view(b, s, a.local_heads, d).transpose(1, 2)  # (b, n/p, s, d)
        k = a.k_proj(x).view(b, s, a.local_kv_heads, d).transpose(1, 2)  # (b, k/p, s, d)
        v = a.v_proj(x).view(b, s, a.local_kv_heads, d).transpose(1, 2)
        if a.rotary is not None:
            q, k = a.rotary(q, k, first_position=0)
        repeat = a.local_heads // a.local_kv_heads  # (grouped-query attention: K, V heads shared by `repeat`)
        if repeat > 1:  # repeated once here, not again in every block's attend
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        self.q, self.k, self.v = q, k, v
        self.attention, self.batch = a, b

    def partial(self, start, end):
        """This rank's share of the attention output for query positions start..end: (b, end - start, h)."""
        a, q = self.attention, self.q[:, :, start:end]
        if a.causal:  # the queries are the last positions of the keys 0..end (attend's lower-right mask)
            out = attend(q, self.k[:, :, :end], self.v[:, :, :end], causal=True)
        else:
            out = attend(q, self.k, self.v, causal=False)
        return a.o_proj(out.transpose(1, 2).reshape(self.batch, end - start, a.local_heads * a.head_dim))
