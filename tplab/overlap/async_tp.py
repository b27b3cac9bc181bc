"""Async tensor parallelism: a transformer block whose collectives move shard by shard under its GEMMs.

A tensor-parallel block under sequence parallelism communicates twice per half-block: an all-gather of
the token shards before the column-parallel GEMMs (QKV, the MLP's up-projection) and a reduce-scatter
after the row-parallel ones (the output projection, the down-projection) -- the same bytes as the plain
block's two all-reduces. Here neither is a step of its own. Each is cut into its p shards (the
"collective matmul" decomposition of Wang et al., ASPLOS 2023; PyTorch's async-TP), and every shard
moves while the GEMM of another shard runs (tplab.comm.shard_exchange moves them):

    attention half, rank r of p (rows of q = the tokens rank q holds between layers):
      QKV of my rows               | shards of r+1, r+2, ... arriving
      QKV of rows r+1, r+2, ...    |   (in that order, each GEMM waiting only for its own shard)
      attention of every query (one call; or cut by query rows, below)
      out-proj of r+1's rows  -> push partial to r+1
      out-proj of r+2's rows  -> push partial to r+2   | r+1's partial moving
      ...      my own rows last                 | the last push moving
      my rows = sum of the p partials of my rows   (my own partial starts from the residual and the bias:
                                                    the sum is the block's output, no additions after it)

    MLP half: up-projection of my rows first; then for each peer's rows in turn: up, activation,
    down -> push; my own down-projection last, so the last push has a GEMM to hide behind.

What is left exposed: a shard's transfer where its GEMM is shorter (the output projection's at p >= 4),
the reduction of the received partials, and the wait for the slowest rank at each scatter's barrier.
By default the attention is one call over every query, and only the output projection is cut: its pushes
hide behind the other rows' output projections. With ``attention="by_query_rows"`` the attention is cut too
(a block of queries sees every key up to its own end: ``attend``'s lower-right causal mask), so that every
push has a block of attention to hide behind. That cut costs more than it hides on Hopper GPUs: one whole
causal attention runs the fused kernel that a block of queries cannot use (cuDNN's; a block's lower-right
mask goes to FlashAttention's). For the reference layer's shapes on an H100 the whole attention takes 0.69 /
0.42 ms at p = 2 / 4, the blocks 1.15 / 0.94 (scripts/gpu_attention_blocks.py); the layer was faster whole on
2 H200s (9.59-9.89 ms against 9.84-10.33) and on 4 (4.96-5.03 against 5.29-5.33), hence the default.

    block = ParallelBlock(...)                       # tplab.models; or any block with norm1, attention
    fast = AsyncTPBlock(block, exchange)             # (ParallelAttention), norm2, mlp (ParallelMLP)
    with torch.no_grad():
        y = fast(x_shard)                            # x_shard: (s/p, b, h), my rows; y the same rows of
                                                     # block(x) for the whole x (b, s, h), to rounding

Inference only (no backward), no KV cache: a prefill. The block's weights are used as they are (whatever
its layers' own ``sequence_parallel`` says). A layer cut into p shards is many launches, and a host that
queues them more slowly than the GPU runs them leaves the GPU waiting: capture the block into a CUDA graph
(tplab.overlap.metrics.captured) after one eager call, and replay it on the stream the eager calls use.
"""

from __future__ import annotations

import torch
from torch import nn

from tplab.layers.attend import attend


class AsyncTPBlock(nn.Module):
    """A pre-norm block (x + attention(norm1(x)), then + mlp(norm2(x))) on sequence shards, with its
    all-gathers and reduce-scatters overlapped with its GEMMs shard by shard (module docstring)."""

    def __init__(self, block, exchange, *, attention: str = "whole"):
        super().__init__()
        if attention not in ("whole", "by_query_rows"):
            raise ValueError(f"AsyncTPBlock: attention must be 'whole' or 'by_query_rows', not {attention!r}")
        self.block, self.exchange, self.attention = block, exchange, attention
        a, m = block.attention, block.mlp
        if not all(hasattr(a, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "local_heads")):
            raise TypeError("AsyncTPBlock: the block's attention must be a tplab ParallelAttention")
        if not all(hasattr(m, name) for name in ("up", "down", "hidden")):
            raise TypeError("AsyncTPBlock: the block's MLP must be a tplab ParallelMLP (not a mixture of experts)")
        if a.comm.size != exchange.size or a.comm.rank != exchange.rank:
            raise ValueError(f"AsyncTPBlock: the block is split {a.comm.size} ways (rank {a.comm.rank}), the "
                             f"exchange has {exchange.size} ranks (rank {exchange.rank})")

    def forward(self, x, cache=None, mask=None):  # x: (s/p, b, h), my rows of the sequence
        problem = ""
        if cache is not None or mask is not None:
            problem = "it runs a whole sequence at once (prefill): no KV cache or mask"
        elif torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.parameters())):
            problem = ("it is forward only (its backward is not written): call it under torch.no_grad() or "
                       "torch.inference_mode()")
        elif x.dim() != 3:
            problem = f"x must be my rows of the sequence, (s/p, b, h), not {tuple(x.shape)}"
        if problem:                                   # (agreed: every rank raises, none waits for a shard)
            self.exchange.refuse("AsyncTPBlock", problem, like=x)
        try:
            x = self._attention(self.block.norm1(x), residual=x)
            return self._mlp(self.block.norm2(x), residual=x)
        except BaseException:
            self.exchange.abandon()                   # (messages already posted complete; nothing stays open)
            raise

    # ---- the attention half ---------------------------------------------------------------------------------
    def _attention(self, x, residual):  # (s/p, b, h) -> residual + attention(x), (s/p, b, h)
        a, p, r = self.block.attention, self.exchange.size, self.exchange.rank
        rows, b, _ = x.shape
        s, d = p * rows, a.head_dim
        gathered = self.exchange.start_gather(x)        # (first: my shard's publishing waits for nothing after it)
        weight, bias = self._qkv_weights()              # (q + 2 kv heads per rank)·d rows: one GEMM per shard
        qkv = x.new_empty(s, b, weight.shape[0])         # (s, b, (n + 2k)/p·d)
        for q in gathered.order:                         # my rows first, then the peers' as they land
            linear_into(gathered.shard(q), weight, qkv[q * rows:(q + 1) * rows], bias=bias)
        gathered.done()
        heads = (a.local_heads, a.local_kv_heads, a.local_kv_heads)
        parts = qkv.split([n * d for n in heads], dim=-1)
        query, key, value = (t.view(s, b, n, d).permute(1, 2, 0, 3) for t, n in zip(parts, heads))  # (b, n, s, d)
        if a.rotary is not None:
            query, key = a.rotary(query, key, first_position=0)
        scatter = self.exchange.start_scatter(x)
        whole = attend(query, key, value, causal=a.causal) if self.attention == "whole" else None  # (b, n, s, d)
        for q in [*gathered.order[1:], r]:              # the peers' queries first, mine last
            end = (q + 1) * rows if a.causal else s     # (causal: a block of queries sees keys up to its end)
            out = (whole[:, :, q * rows:(q + 1) * rows] if whole is not None else
                   attend(query[:, :, q * rows:(q + 1) * rows], key[:, :, :end], value[:, :, :end], causal=a.causal))
            out = out.permute(2, 0, 1, 3).reshape(rows, b, a.local_heads * d)  # (rows, b, n/p·d)
            if q != r:
                linear_into(out, a.o_proj.weight, scatter.out_for(q))
                scatter.send(q)
            else:                                       # my own partial starts from the residual and the bias
                linear_into(out, a.o_proj.weight, scatter.out_for(r), start=(residual, a.o_bias))
        return scatter.finish()

    def _qkv_weights(self):
        """The Q, K and V projections stacked into one weight (and bias), for one GEMM per shard instead of
        three: fewer launches for the host to queue, a wider GEMM for the GPU. Stacked again at every call (a
        copy the size of the three, tens of microseconds on a GPU), not cached: a cache would miss weights
        changed in place where PyTorch keeps no version (inference tensors, ``.data``, writes by other
        libraries)."""
        projections = (self.block.attention.q_proj, self.block.attention.k_proj, self.block.attention.v_proj)
        weight = torch.cat([proj.weight for proj in projections])
        if all(proj.bias is None for proj in projections):
            return weight, None
        return weight, torch.cat([proj.weight.new_zeros(proj.out_features) if proj.bias is None else proj.bias
                                  for proj in projections])

    # ---- the MLP half ---------------------------------------------------------------------------------------
    def _mlp(self, x, residual):  # (s/p, b, h) -> residual + mlp(x), (s/p, b, h)
        m, r = self.block.mlp, self.exchange.rank
        gathered = self.exchange.start_gather(x)
        scatter = self.exchange.start_scatter(x)
        mine = m.hidden(gathered.shard(r))              # (s/p, b, ffn/p): mine first, it is here already
        for q in gathered.order[1:]:                     # each peer's rows in turn: up, act, down, push
            linear_into(m.hidden(gathered.shard(q)), m.down.weight, scatter.out_for(q))
            scatter.send(q)
        gathered.done()
        linear_into(mine, m.down.weight, scatter.out_for(r), start=(residual, m.down.bias))  # mine last
        return scatter.finish()


def linear_into(x, weight, out, *, bias=None, start=None) -> None:
    """out = x Wᵀ (+ bias), written into ``out`` (a contiguous block of a larger tensor): one GEMM, no copy.
    ``start=(residual, bias)``: out = residual (+ bias) + x Wᵀ instead -- one elementwise kernel writes
    residual + bias into ``out``, and the GEMM adds its product to it as it writes (beta = 1)."""
    x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
    if start is not None:
        residual, start_bias = start
        # an elementwise kernel (torch.add), not a copy: a copy would queue for the copy engines, behind shards
        torch.add(residual, start_bias if start_bias is not None else 0, out=out)
        torch.addmm(out2, x2, weight.t(), out=out2)
    elif bias is None:
        torch.mm(x2, weight.t(), out=out2)
    else:
        torch.addmm(bias, x2, weight.t(), out=out2)


def my_rows(x, rank: int, size: int):
    """My rows of a whole sequence under sequence parallelism: x (b, s, h) -> (s/p, b, h) (a copy)."""
    s = x.shape[1]
    if s % size:
        raise ValueError(f"a sequence of {s} positions does not split into {size} equal shards")
    rows = s // size
    return x.transpose(0, 1)[rank * rows:(rank + 1) * rows].contiguous()
