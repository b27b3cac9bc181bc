"""Rotary position embeddings (RoPE, Su et al. 2021; Llama): positions enter as rotations of q and k.

Each pair of dimensions (i, i + d/2) of a query or key at position m is rotated by the angle
m·θ^(-2i/d): the dot product q_m · k_n then depends only on m - n. Nothing is learned and nothing is
split across ranks by position: a head's rotation uses only that head's d dimensions, so tensor
parallelism (heads split over ranks) leaves RoPE untouched.

    q_rot = q·cos + rotate_half(q)·sin,   rotate_half([x1, x2]) = [-x2, x1]   (Hugging Face's layout)

The angles are computed in float32 whatever the model's dtype, as Hugging Face and Meta do, and cast to
the model's dtype: a float64 model then agrees with theirs to ~1e-15, not to float32's 1e-7.
"""

from __future__ import annotations

import torch
from torch import nn


def rotate_half(x):  # (..., d) -> (..., d): [x1, x2] -> [-x2, x1]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings rotate pairs of dimensions: head_dim {head_dim} is odd")
        self.head_dim, self.theta = head_dim, theta

    def angles(self, first_position: int, length: int, device) -> torch.Tensor:  # (length, d), float32
        # computed on the fly (d/2 numbers), never stored: a model.to(bfloat16) cannot round them
        even = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float)
        inv_freq = 1.0 / (self.theta ** (even / self.head_dim))  # (d/2,): θ^(-2i/d)
        positions = torch.arange(first_position, first_position + length, device=device).float()
        freqs = positions[:, None] * inv_freq[None, :]  # (length, d/2)
        return torch.cat((freqs, freqs), dim=-1)

    def cos_sin(self, first_position: int, length: int, like: torch.Tensor):  # two (length, d) in like's dtype
        angles = self.angles(first_position, length, like.device)
        return angles.cos().to(like.dtype), angles.sin().to(like.dtype)

    def forward(self, q, k, first_position: int = 0):  # q: (b, n, s, d), k: (b, kv, s, d)
        cos, sin = self.cos_sin(first_position, q.shape[2], q)  # (s, d): one pair for both (autograd keeps it once)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin

    def rotate(self, x, first_position: int = 0):  # (b, heads, s, d): queries or keys alone
        cos, sin = self.cos_sin(first_position, x.shape[2], x)
        return x * cos + rotate_half(x) * sin

    def extra_repr(self):
        return f"head_dim={self.head_dim}, theta={self.theta}"
