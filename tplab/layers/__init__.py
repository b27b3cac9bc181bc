"""tplab.layers — Megatron-style tensor-parallel layers on tplab's own collectives.

    mappings.py   the f / g conjugate ops and their sequence-parallel versions, as autograd functions
                  (``mappings.calls`` counts the collectives they ran)
    attend.py     attend(q, k, v, causal=..., mask=...): the one attention every model and layer computes
                  (causal lower-right, GQA, an extra mask); the KV cache's extend_cache and past_length
    linear.py     ColumnParallelLinear, RowParallelLinear (from_linear shards an nn.Linear)
    mlp.py        ParallelMLP: GELU or SwiGLU, tensor- or sequence-parallel (from_dense)
    attention.py  ParallelAttention: heads split over ranks, MHA and GQA (KV heads replicated when
                  there are fewer than ranks), rotary positions, tensor- or sequence-parallel (from_dense)
    embedding.py  VocabParallelEmbedding, ParallelLMHead (the vocabulary split over ranks)
    norms.py      RMSNorm as Llama computes it (in float32); LayerNorm is torch's
    rotary.py     RotaryEmbedding (RoPE), computed as Hugging Face and Meta do
"""

from tplab.layers.attend import attend
from tplab.layers.attention import ParallelAttention
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
from tplab.layers.mlp import ParallelMLP
from tplab.layers.norms import RMSNorm
from tplab.layers.rotary import RotaryEmbedding

__all__ = [
    "ColumnParallelLinear",
    "ParallelAttention",
    "ParallelMLP",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "attend",
    "copy_to_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
]
