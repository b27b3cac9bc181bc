"""Tensor-parallel self-attention: the heads are split across ranks.

    x (b, s, h) replicated -f-> Q_i, K_i, V_i   (column-parallel: my heads' columns of Wq, Wk, Wv)
                                attention of my heads, no communication (heads are independent)
                           -> out_i Wo_i      (row-parallel: my heads' rows of Wo) -g-> y (b, s, h)

One all-reduce forward (g), one backward (f). With num_heads = n and tp = p each rank computes n/p heads.

Grouped-query attention (Llama 2/3): n query heads share k < n key/value heads in groups of n/k. If
k >= p, the KV heads are split like the query heads (k/p per rank). If k < p there are not enough to go
round: the KV heads are *replicated*, each rank holding the one its query heads use (so p must be a
multiple of k). Replicated KV weights get only their own heads' share of the gradient on each rank; this
is what inference needs (training would sum those shares over the ranks that share a KV head).

Rotary position embeddings (``rotary=RotaryEmbedding(d)``, Llama) rotate each head's q and k on its own
rank: nothing to communicate. Sequence parallelism (``sequence_parallel=True``): the input arrives as
this rank's slice of the sequence, (s/p, b, h); f becomes an all-gather along the sequence (attention
needs every position), and g a reduce-scatter that leaves each rank its slice of the output, (s/p, b, h).
"""

from __future__ import annotations

import torch
from torch import nn

from tplab.layers.attend import attend, extend_cache, past_length
from tplab.layers.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


def heads_per_rank(num_heads: int, num_kv_heads: int, tp: int) -> tuple[int, int]:
    """(query heads, kv heads) each rank holds; a clear error when the heads cannot be split."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if num_heads % tp:
        raise ValueError(f"num_heads {num_heads} is not divisible by the tensor-parallel size {tp}")
    if num_kv_heads >= tp:
        if num_kv_heads % tp:
            raise ValueError(f"num_kv_heads {num_kv_heads} is not divisible by the tensor-parallel size {tp}")
        return num_heads // tp, num_kv_heads // tp
    if tp % num_kv_heads:
        raise ValueError(f"with fewer KV heads ({num_kv_heads}) than ranks ({tp}) the KV heads are replicated, "
                         "which needs the tensor-parallel size to be a multiple of num_kv_heads")
    return num_heads // tp, 1


class ParallelAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, comm, num_kv_heads=None, causal=True, bias=False,
                 algorithm="auto", dtype=None, rotary=None, sequence_parallel=False):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        self.comm, self.causal, self.algorithm = comm, causal, algorithm
        self.rotary, self.sequence_parallel = rotary, sequence_parallel
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, hidden_size // num_heads
        self.local_heads, self.local_kv_heads = heads_per_rank(num_heads, num_kv_heads, comm.size)
        d = self.head_dim
        self.q_proj = nn.Linear(hidden_size, self.local_heads * d, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(hidden_size, self.local_kv_heads * d, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(hidden_size, self.local_kv_heads * d, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(self.local_heads * d, hidden_size, bias=False, dtype=dtype)
        self.o_bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype)) if bias else None

    def my_heads(self) -> range:
        return range(self.comm.rank * self.local_heads, (self.comm.rank + 1) * self.local_heads)

    def my_kv_heads(self) -> range:
        group = self.num_heads // self.num_kv_heads  # query heads per KV head
        first = self.my_heads()[0] // group
        return range(first, first + self.local_kv_heads)

    @classmethod
    def from_dense(cls, q_proj: nn.Linear, k_proj: nn.Linear, v_proj: nn.Linear, o_proj: nn.Linear,
                   num_heads, comm, num_kv_heads=None, causal=True, algorithm="auto", rotary=None,
                   sequence_parallel=False) -> "ParallelAttention":
        """Shard unsplit projections (q: h -> n·d, k and v: h -> k·d, o: n·d -> h)."""
        bias = q_proj.bias is not None
        layer = cls(q_proj.in_features, num_heads, comm, num_kv_heads=num_kv_heads, causal=causal, bias=bias,
                    algorithm=algorithm, dtype=q_proj.weight.dtype, rotary=rotary,
                    sequence_parallel=sequence_parallel)
        d = layer.head_dim
        q_rows = slice(layer.my_heads()[0] * d, (layer.my_heads()[-1] + 1) * d)
        kv_rows = slice(layer.my_kv_heads()[0] * d, (layer.my_kv_heads()[-1] + 1) * d)
        with torch.no_grad():
            layer.q_proj.weight.copy_(q_proj.weight[q_rows])
            layer.k_proj.weight.copy_(k_proj.weight[kv_rows])
            layer.v_proj.weight.copy_(v_proj.weight[kv_rows])
            layer.o_proj.weight.copy_(o_proj.weight[:, q_rows])  # row-parallel: my heads' inputs
            if bias:
                layer.q_proj.bias.copy_(q_proj.bias[q_rows])
                layer.k_proj.bias.copy_(k_proj.bias[kv_rows])
                layer.v_proj.bias.copy_(v_proj.bias[kv_rows])
            if o_proj.bias is not None:
                layer.o_bias = nn.Parameter(o_proj.bias.detach().clone())
        return layer

    def forward(self, x, cache=None, mask=None):
        """x: (b, s, h), the same on every rank; under sequence parallelism (s/p, b, h), my slice of the
        sequence. cache: a dict holding my heads' past K and V (generation), or None. mask: an extra
        attention mask over the whole sequence (``attend``), e.g. packed sequences' block-diagonal one."""
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.comm, self.algorithm)  # (s, b, h), all of it
            x = x.transpose(0, 1).contiguous()  # (b, s, h): one copy, which the projections share
        else:
            x = copy_to_tensor_parallel_region(x, self.comm, self.algorithm)  # f
        b, s, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, s, self.local_heads, d).transpose(1, 2)  # (b, n/p, s, d)
        k = self.k_proj(x).view(b, s, self.local_kv_heads, d).transpose(1, 2)  # (b, k/p, s, d)
        v = self.v_proj(x).view(b, s, self.local_kv_heads, d).transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary(q, k, first_position=past_length(cache))
        k, v = extend_cache(cache, k, v)  # (b, k/p, past + s, d)
        out = attend(q, k, v, causal=self.causal, mask=mask)  # (b, n/p, s, d); each KV head serves n/k heads
        partial = self.o_proj(out.transpose(1, 2).reshape(b, s, self.local_heads * d))  # (b, s, h), partial
        if self.sequence_parallel:  # sum over ranks and keep my slice of the sequence: (s/p, b, h)
            y = reduce_scatter_to_sequence_parallel_region(partial.transpose(0, 1), self.comm, self.algorithm)
        else:
            y = reduce_from_tensor_parallel_region(partial, self.comm, self.algorithm)  # g
        return y + self.o_bias if self.o_bias is not None else y
