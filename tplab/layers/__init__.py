"""tplab.layers — Megatron-style tensor-parallel layers on tplab's own collectives.

    mappings.py   the f / g conjugate ops and their sequence-parallel versions, as autograd functions
    linear.py     ColumnParallelLinear, RowParallelLinear (from_linear shards an nn.Linear)
"""

from tplab.layers.linear import ColumnParallelLinear, RowParallelLinear
from tplab.layers.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
]
