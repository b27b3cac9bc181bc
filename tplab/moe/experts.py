"""The experts: E small feed-forward networks of the same shape (SwiGLU as in Mixtral and LLaMA-4, or GELU as
in GPT-2 and the Switch Transformer), and running each on the rows routed to it.

An expert is an ordinary MLP, h -> ffn -> h; a mixture-of-experts layer has E of them where a dense model has
one, so its parameters grow E-fold while each token still pays for only k of them (its *active* parameters).
"""

from __future__ import annotations

import torch
from torch import nn

ACTIVATIONS = ("swiglu", "gelu")


class Expert(nn.Module):
    def __init__(self, hidden: int, ffn: int, activation: str = "swiglu", *, bias: bool = False,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"expert activation {activation!r}: one of {ACTIVATIONS}")
        self.activation = activation
        self.up = nn.Linear(hidden, ffn, bias=bias, dtype=dtype)
        self.gate = nn.Linear(hidden, ffn, bias=bias, dtype=dtype) if activation == "swiglu" else None
        self.down = nn.Linear(ffn, hidden, bias=bias, dtype=dtype)

    def forward(self, x):  # (rows, h)
        if self.gate is None:
            return self.down(nn.functional.gelu(self.up(x)))
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


def run_experts(experts, rows, counts):
    """``rows`` grouped by expert (``counts[i]`` rows for ``experts[i]``, in order) -> each expert's output
    for its rows, in the same order. An expert with no rows is not called."""
    counts = [int(c) for c in counts]
    if sum(counts) != rows.shape[0]:
        raise ValueError(f"{rows.shape[0]} rows but the counts add up to {sum(counts)}")
    pieces = torch.split(rows, counts)
    outputs = [expert(piece) if len(piece) else piece for expert, piece in zip(experts, pieces)]
    return torch.cat(outputs) if outputs else rows
