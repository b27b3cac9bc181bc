"""Column- and row-parallel linear layers (Megatron-LM's split of Y = X A + b over p ranks).

    ColumnParallelLinear   A = [A_0 | A_1 | ... ]  (split by output columns)   Y_i = f(X) A_i + b_i
                           X is replicated; each rank computes its slice of the output features.
                           gather_output=True all-gathers the slices (else the next layer takes them).
    RowParallelLinear      A = [A_0; A_1; ...]     (split by input rows)       Y = g(sum_i X_i A_i) + b
                           X arrives split (input_is_parallel) from a column-parallel layer; the partial
                           products are all-reduced (g), and the bias is added once, after the reduce.

Column then row (an MLP, attention's QKV then output projection) costs one all-reduce in the forward pass
(g) and one in the backward pass (f). ``from_linear`` shards an existing ``torch.nn.Linear`` so a sharded
model computes exactly what the unsharded one does.
"""

from __future__ import annotations

import torch
from torch import nn

from tplab.layers.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    scatter_to_tensor_parallel_region,
)


def _shard_size(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} = {total} is not divisible by the tensor-parallel size {parts}")
    return total // parts


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, comm, bias=True, gather_output=False, algorithm="auto",
                 dtype=None):
        super().__init__()
        self.comm, self.gather_output, self.algorithm = comm, gather_output, algorithm
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = _shard_size(out_features, comm.size, "out_features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, dtype=dtype))  # (out/p, in)
        self.bias = nn.Parameter(torch.zeros(self.out_per_rank, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm, **kwargs) -> "ColumnParallelLinear":
        layer = cls(linear.in_features, linear.out_features, comm, bias=linear.bias is not None,
                    dtype=linear.weight.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(comm.size, dim=0)[comm.rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias.chunk(comm.size, dim=0)[comm.rank])
        return layer

    def local(self, x):
        """This rank's output features, no communication (the caller handles f)."""
        return nn.functional.linear(x, self.weight, self.bias)  # (..., out/p)

    def forward(self, x):  # x: (..., in) replicated on every rank
        x = copy_to_tensor_parallel_region(x, self.comm, self.algorithm)  # f: backward all-reduces dX
        y = nn.functional.linear(x, self.weight, self.bias)  # (..., out/p)
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.comm, self.algorithm)  # (..., out)
        return y


class RowParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, comm, bias=True, input_is_parallel=True, algorithm="auto",
                 dtype=None):
        super().__init__()
        self.comm, self.input_is_parallel, self.algorithm = comm, input_is_parallel, algorithm
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = _shard_size(in_features, comm.size, "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, dtype=dtype))  # (out, in/p)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    @classmethod
    def from_linear(cls, linear: nn.Linear, comm, **kwargs) -> "RowParallelLinear":
        layer = cls(linear.in_features, linear.out_features, comm, bias=linear.bias is not None,
                    dtype=linear.weight.dtype, **kwargs)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(comm.size, dim=1)[comm.rank])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def local(self, x):
        """This rank's partial product, no communication and no bias (the caller reduces, then adds it)."""
        return nn.functional.linear(x, self.weight)

    def forward(self, x):  # x: (..., in/p) if input_is_parallel, else (..., in) replicated
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.comm, self.algorithm)  # (..., in/p)
        partial = nn.functional.linear(x, self.weight)  # (..., out): this rank's share of the sum
        y = reduce_from_tensor_parallel_region(partial, self.comm, self.algorithm)  # g
        return y + self.bias if self.bias is not None else y  # the bias once, after the reduce
