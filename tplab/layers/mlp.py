"""The tensor-parallel MLP: column-parallel up-projection, activation, row-parallel down-projection.

    x (replicated) -f-> up_i (column, h -> ffn/p) -> act -> down_i (row, ffn/p -> h) -g-> y
    one all-reduce forward (g), one backward (f); the activation needs no communication because each
    rank holds whole columns of the hidden layer.

SwiGLU (Llama): act(x) = silu(x W_gate) * (x W_up), with W_gate and W_up both column-parallel.

Sequence parallelism (``sequence_parallel=True``, activations laid out (seq, batch, hidden) and split
along seq between layers): f becomes an all-gather along the sequence before the up-projection and g a
reduce-scatter after the down-projection — the same bytes as one all-reduce, and LayerNorm/dropout
outside the MLP then work on s/p tokens per rank.
"""

from __future__ import annotations

from torch import nn

from tplab.layers.linear import ColumnParallelLinear, RowParallelLinear
from tplab.layers.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


class ParallelMLP(nn.Module):
    def __init__(self, up: ColumnParallelLinear, down: RowParallelLinear, gate: ColumnParallelLinear | None = None,
                 activation: str = "gelu", sequence_parallel: bool = False):
        super().__init__()
        if activation not in ("gelu", "gelu_tanh", "swiglu"):
            raise ValueError(f"unknown activation {activation!r}: 'gelu', 'gelu_tanh' or 'swiglu'")
        if (activation == "swiglu") != (gate is not None):
            raise ValueError("swiglu needs a gate projection, gelu none")
        self.approximate = "tanh" if activation == "gelu_tanh" else "none"
        self.up, self.down, self.gate = up, down, gate
        self.activation, self.sequence_parallel = activation, sequence_parallel
        self.comm, self.algorithm = up.comm, up.algorithm

    @classmethod
    def from_dense(cls, up: nn.Linear, down: nn.Linear, comm, gate: nn.Linear | None = None,
                   activation: str = "gelu", sequence_parallel: bool = False, algorithm="auto") -> "ParallelMLP":
        """Shard an unsplit MLP (up: h -> ffn, down: ffn -> h, and gate: h -> ffn for SwiGLU)."""
        def column(linear):
            return ColumnParallelLinear.from_linear(linear, comm, algorithm=algorithm)

        return cls(column(up), RowParallelLinear.from_linear(down, comm, algorithm=algorithm),
                   column(gate) if gate is not None else None, activation=activation,
                   sequence_parallel=sequence_parallel)

    def hidden(self, x):  # (..., h) -> (..., ffn/p): whole columns of the hidden layer, no communication
        if self.gate is None:
            return nn.functional.gelu(self.up.local(x), approximate=self.approximate)
        return nn.functional.silu(self.gate.local(x)) * self.up.local(x)

    def forward(self, x):
        if self.sequence_parallel:  # x: (s/p, b, h), my slice of the sequence
            x = gather_from_sequence_parallel_region(x, self.comm, self.algorithm)  # (s, b, h)
        else:  # x: (..., h), the same on every rank
            x = copy_to_tensor_parallel_region(x, self.comm, self.algorithm)  # f
        partial = self.down.local(self.hidden(x))  # (..., h): this rank's share of the sum
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(partial, self.comm, self.algorithm)  # (s/p, b, h)
        else:
            y = reduce_from_tensor_parallel_region(partial, self.comm, self.algorithm)  # g
        return y + self.down.bias if self.down.bias is not None else y  # the bias once, after the sum
