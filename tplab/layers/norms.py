"""RMSNorm as Llama computes it (LayerNorm is torch's own ``nn.LayerNorm``).

    y = w * x / sqrt(mean(x^2) + eps)          over the last (hidden) dimension

Meta's reference and Hugging Face's ``LlamaRMSNorm`` normalise in float32 whatever the model's dtype
(``compute_dtype=torch.float32``): in bf16 that keeps the mean of squares accurate, and it is why a
float64 Llama matches Hugging Face's only if we round to float32 at the same place. The result is cast
back to the input's dtype *before* the weight multiplies it, as theirs is.

Norms are never split by tensor parallelism (they need whole rows of the hidden dimension): every rank
holds the full weight. Under sequence parallelism each rank normalises only its slice of the sequence.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, compute_dtype: torch.dtype | None = None, dtype=None):
        super().__init__()
        self.eps, self.compute_dtype = eps, compute_dtype
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward(self, x):  # (..., h)
        y = x.to(self.compute_dtype or x.dtype)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.eps}, compute_dtype={self.compute_dtype}"
