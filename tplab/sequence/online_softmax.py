"""Attention over key blocks that arrive one at a time: the online softmax (FlashAttention's recurrence).

softmax(q Kᵀ) V needs, for each query row, the maximum and the sum over *all* keys. Ring attention sees
the keys one block at a time, so each query row keeps three running quantities instead:

    m    the largest score seen so far                            (b, n, sq, 1)
    l    sum over seen keys of exp(score - m)                     (b, n, sq, 1)
    acc  sum over seen keys of exp(score - m) · v                 (b, n, sq, d)

and folds in a new block of scores S (with values V) as

    m_new = max(m, rowmax(S))
    c     = exp(m - m_new)                      how much the old sums shrink under the new maximum
    l     = c · l   + rowsum(exp(S - m_new))
    acc   = c · acc + exp(S - m_new) V
    m     = m_new

After the last block, out = acc / l is exactly softmax(q Kᵀ) V (up to rounding), in any block order.
Every block folded in must leave each query row at least one visible key (true for the blocks the
schemes fold in: a causal diagonal block always shows the query its own key), so m is finite and no
exp(-inf - -inf) appears. The sums run in float32 at least (bf16 inputs), as FlashAttention's do.
"""

from __future__ import annotations

import torch


class OnlineSoftmax:
    def __init__(self, q: torch.Tensor):  # q: (b, n, sq, d), the queries whose outputs we accumulate
        self.out_dtype = q.dtype
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        b, n, sq, d = q.shape
        self.scale = d**-0.5
        self.m = torch.full((b, n, sq, 1), float("-inf"), dtype=acc_dtype, device=q.device)
        self.l = torch.zeros((b, n, sq, 1), dtype=acc_dtype, device=q.device)
        self.acc = torch.zeros((b, n, sq, d), dtype=acc_dtype, device=q.device)

    def update(self, q, k, v, causal_diagonal: bool = False) -> None:
        """Fold in keys k and values v (b, n, sk, d). ``causal_diagonal``: q and k cover the same
        positions, so query i may only see keys 0..i of this block."""
        scores = (q @ k.transpose(-2, -1)).to(self.acc.dtype) * self.scale  # (b, n, sq, sk)
        if causal_diagonal:
            future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(diagonal=1)
            scores = scores.masked_fill(future, float("-inf"))
        m_new = torch.maximum(self.m, scores.amax(dim=-1, keepdim=True))
        shrink = torch.exp(self.m - m_new)  # (b, n, sq, 1); 0 on the first block (m = -inf)
        weights = torch.exp(scores - m_new)  # (b, n, sq, sk)
        self.l = shrink * self.l + weights.sum(dim=-1, keepdim=True)
        self.acc = shrink * self.acc + weights @ v.to(self.acc.dtype)
        self.m = m_new

    def result(self) -> torch.Tensor:
        return (self.acc / self.l).to(self.out_dtype)  # (b, n, sq, d)
