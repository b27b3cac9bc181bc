"""What one sequence costs: attention grows with the square of its length, everything else linearly.

Per transformer layer, for one sequence of s tokens with hidden size h (Megatron-LM; Korthikanti et al.
2022; the same count as ``tplab.cost.tensor_parallel.layer_model``):

    24·s·h²      the four h x h projections and the h x 4h MLP     (linear in s)
     4·s²·h      QK^T and attention x V                             (quadratic in s)

so a 1000-token sequence costs far more than ten 100-token ones once s is comparable to 6h. A scheduler
needs a number per work item; two sources for it:

    SequenceCost.from_flops(config, flops_per_second)    the formula (any machine, no measurement)
    SequenceCost.fit(lengths, seconds)                   a + b·s + c·s², fitted to timings on the machine
                                                         at hand (a = the fixed cost of a call, which the
                                                         FLOP count misses and which dominates short
                                                         sequences on a CPU)

A batch of several sequences is priced by what the kernel computes: padded to the longest (b·L tokens,
b·L² attention), or packed into one row of T = sum(s) tokens with a block-diagonal mask. The dense
masked kernel used here still computes all T² scores; a variable-length kernel (FlashAttention's varlen)
computes only sum(s²) -- ``varlen=True`` prices that.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tplab.cost.tensor_parallel import layer_model
from tplab.toolkit.timing import time_calls


def sequence_flops(length: int, hidden_size: int, num_layers: int, vocab_size: int = 0, tp: int = 1) -> float:
    """Forward FLOPs of one sequence through ``num_layers`` layers (+ the LM head, 2·s·h·V), per TP rank."""
    if length == 0:
        return 0.0
    layer = layer_model(hidden_size, int(length), 1, tp)["flops_per_rank"]
    return float(num_layers * layer + 2 * length * hidden_size * vocab_size / tp)


@dataclass(frozen=True)
class SequenceCost:
    """seconds(s) = overhead + per_token·s + per_token_squared·s² for one forward pass of s tokens."""

    overhead: float = 0.0
    per_token: float = 1.0
    per_token_squared: float = 0.0

    def seconds(self, length) -> np.ndarray | float:
        s = np.asarray(length, dtype=float)
        out = self.overhead * (s > 0) + self.per_token * s + self.per_token_squared * s**2
        return float(out) if out.ndim == 0 else out

    __call__ = seconds

    def batch_seconds(self, lengths, mode: str = "single", varlen: bool = False) -> float:
        """One forward pass over several sequences: "single" (each alone: the sum), "pad" (b x longest),
        "pack" (one row of sum(s) tokens; attention over T² unless ``varlen``)."""
        lengths = np.asarray(lengths, dtype=float)
        if lengths.size == 0:
            return 0.0
        if mode == "single":
            return float(np.sum(self.seconds(lengths)))
        if mode == "pad":
            b, longest = lengths.size, lengths.max()
            return float(self.overhead + b * (self.per_token * longest + self.per_token_squared * longest**2))
        if mode == "pack":
            total = lengths.sum()
            quadratic = np.sum(lengths**2) if varlen else total**2
            return float(self.overhead + self.per_token * total + self.per_token_squared * quadratic)
        raise ValueError(f"mode must be 'single', 'pad' or 'pack', not {mode!r}")

    @classmethod
    def from_flops(cls, config, flops_per_second: float = 1e10, overhead: float = 0.0, tp: int = 1) -> "SequenceCost":
        """The FLOP formula for a GPTConfig, at an assumed speed (default 10 GFLOP/s: one CPU core)."""
        h, layers = config.n_embd, config.n_layer
        per_token = (layers * 24 * h * h + 2 * h * config.vocab_size) / tp / flops_per_second
        return cls(overhead, per_token, layers * 4 * h / tp / flops_per_second)

    @classmethod
    def fit(cls, lengths, seconds) -> "SequenceCost":
        """Least squares a + b·s + c·s² with a, b, c >= 0 (a coefficient that comes out negative is noise:
        it is dropped and the rest refitted)."""
        s, t = np.asarray(lengths, dtype=float), np.asarray(seconds, dtype=float)
        if s.size < 3 or np.unique(s).size < 3:
            raise ValueError("fitting a + b·s + c·s² needs timings at 3 or more different lengths")
        columns = [np.ones_like(s), s, s**2]
        keep = [0, 1, 2]
        while True:
            coef, *_ = np.linalg.lstsq(np.stack([columns[k] for k in keep], axis=1), t, rcond=None)
            if (coef >= 0).all() or len(keep) == 1:
                break
            keep.pop(int(np.argmin(coef)))
        full = [0.0, 0.0, 0.0]
        for k, c in zip(keep, coef):
            full[k] = max(float(c), 0.0)
        return cls(*full)


def time_sequences(model, lengths, vocab_size: int, repeats: int = 3) -> list[float]:
    """Median seconds of ``model`` on one random sequence of each length (after one warm-up): the
    timings ``SequenceCost.fit`` wants. Runs on whatever ranks call it (a TP model: all of its group)."""
    import torch

    out = []
    with torch.no_grad():
        for length in lengths:
            generator = torch.Generator().manual_seed(int(length))
            tokens = torch.randint(0, vocab_size, (1, int(length)), generator=generator)
            out.append(float(np.median(time_calls(lambda: model(tokens), iters=repeats, warmup=1))))
    return out
