"""One rank's share of a transformer block, and what the three block types have in common.

    BlockShard       shard i of p: heads [i n/p, (i+1) n/p) of the attention (Q, K, V column-parallel,
                     the output projection row-parallel) and columns [i f/p, (i+1) f/p) of the MLP
                     (up column-parallel, down row-parallel). It computes *partial* results: summed
                     over the p shards they give the unsplit attention / MLP output, less its bias.
    ShardedBlock     a block as the ranks hold it: the local shards, and the replicated pieces (two
                     LayerNorms, the two output biases). TPBlock, SPDBlock and UnsyncedBlock differ
                     only in where they sum the shards' partial results (their forward).

Weights come from an unsplit ``tplab.models.gpt.Block`` (``from_dense``), sliced with tplab's own
ColumnParallelLinear / RowParallelLinear ``from_linear``: simulated and real ranks that start from the
same unsplit block hold the same numbers.
"""

from __future__ import annotations

from torch import nn
from torch.nn import functional as F

from tplab.layers import ColumnParallelLinear, RowParallelLinear
from tplab.layers.attend import attend


def _row_without_bias(linear: nn.Linear, view) -> RowParallelLinear:
    layer = RowParallelLinear.from_linear(linear, view)
    layer.bias = None  # a row-parallel bias belongs after the sum over shards: the block adds it, once
    return layer


class BlockShard(nn.Module):
    def __init__(self, q, k, v, o, up, down, heads: int, head_dim: int, activation: str = "gelu"):
        super().__init__()
        self.q, self.k, self.v, self.o, self.up, self.down = q, k, v, o, up, down
        self.heads, self.head_dim = heads, head_dim  # this shard's heads
        self.approximate = "tanh" if activation == "gelu_tanh" else "none"

    @classmethod
    def from_dense(cls, block, view) -> "BlockShard":
        """Shard ``view.rank`` of ``view.size`` of an unsplit tplab.models.gpt.Block."""
        a, m = block.attention, block.mlp
        if a.n_kv_head != a.n_head:
            raise ValueError("the fewer-syncs blocks take multi-head attention (n_kv_head = n_head)")
        if m.gate is not None:
            raise ValueError("the fewer-syncs blocks take a GELU MLP, not SwiGLU")
        if a.n_head % view.size:
            raise ValueError(f"num_heads {a.n_head} is not divisible by the tensor-parallel size {view.size}")
        column = lambda linear: ColumnParallelLinear.from_linear(linear, view)  # noqa: E731
        return cls(column(a.q_proj), column(a.k_proj), column(a.v_proj), _row_without_bias(a.o_proj, view),
                   column(m.up), _row_without_bias(m.down, view), a.n_head // view.size, a.head_dim,
                   m.activation)

    def attention(self, x):  # x: (b, s, h), already normalised -> (b, s, h), this shard's partial sum
        b, s, _ = x.shape
        q = self.q.local(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)  # (b, n/p, s, d)
        k = self.k.local(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        v = self.v.local(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        y = attend(q, k, v, causal=True)  # (b, n/p, s, d): my heads, whole
        return self.o.local(y.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))

    def mlp(self, x):  # x: (b, s, h), already normalised -> (b, s, h), this shard's partial sum
        return self.down.local(F.gelu(self.up.local(x), approximate=self.approximate))


def _copy_norm(norm: nn.Module) -> nn.LayerNorm:
    if not isinstance(norm, nn.LayerNorm):
        raise ValueError(f"the fewer-syncs blocks take LayerNorm, not {type(norm).__name__}")
    copy = nn.LayerNorm(norm.normalized_shape, eps=norm.eps, elementwise_affine=True,
                        bias=norm.bias is not None, dtype=norm.weight.dtype)
    copy.load_state_dict(norm.state_dict())
    return copy


def layer_norm(x, norm: nn.LayerNorm, weight, bias):
    """``norm(x)`` with the given weight and bias tensors (the norm's own, passed through ranks.shared)."""
    return F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)


def _bias(linear: nn.Linear):
    return None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())


def add(x, bias):
    return x if bias is None else x + bias


class ShardedBlock(nn.Module):
    """The local shards of one block plus its replicated pieces; subclasses say where the sums go."""

    keeps_output_biases = True  # the parallel block drops them (the student project's Parallel_Block has none)

    def __init__(self, block, ranks):
        super().__init__()
        self.ranks = ranks
        self.norm1, self.norm2 = _copy_norm(block.norm1), _copy_norm(block.norm2)
        self.shards = nn.ModuleList(BlockShard.from_dense(block, ranks.view(i)) for i in ranks.local)
        keep = self.keeps_output_biases
        self.attn_bias = _bias(block.attention.o_proj) if keep else None  # (h,), added after the sum
        self.mlp_bias = _bias(block.mlp.down) if keep else None

    @classmethod
    def from_dense(cls, block, ranks):
        return cls(block, ranks)

    def forward(self, x):  # pragma: no cover - each block type has its own
        raise NotImplementedError
