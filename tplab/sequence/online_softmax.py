"""Attention over key blocks that arrive one at a time: the online softmax (FlashAttention's recurrence).

softmax(q Kᵀ) V needs, for each query row, the maximum and the sum over *all* keys. Ring attention sees
the keys one block at a time, so each query row keeps a running summary of the keys seen so far instead.
FlashAttention's form of it is three running quantities,

    m    the largest score seen so far                            (b, n, sq)
    l    sum over seen keys of exp(score - m)                     (b, n, sq)
    acc  sum over seen keys of exp(score - m) · v                 (b, n, sq, d)

and a new block of scores S (with values V) is folded in as

    m_new = max(m, rowmax(S));   c = exp(m - m_new)     how much the old sums shrink under the new maximum
    l     = c · l   + rowsum(exp(S - m_new))
    acc   = c · acc + exp(S - m_new) V;                 m = m_new

and after the last block out = acc / l is exactly softmax(q Kᵀ) V (up to rounding), in any block order.

The same summary, kept normalised, is two quantities: out = acc / l, the attention over the keys seen so
far, and lse = m + log l, the log-sum-exp of their scores. Attention over one block *alone* is such a
summary too, and one fused kernel returns it without writing the block's scores to memory
(``tplab.layers.attend.attend_with_lse``: cuDNN's or FlashAttention's kernel on a GPU). Two summaries combine as

    lse_new = log(exp(lse) + exp(lse_b))                  (logaddexp: no overflow)
    out     = exp(lse - lse_new) · out + exp(lse_b - lse_new) · out_b

(the two weights are the shares of the two key sets in the softmax's sum: they add up to 1). This class
keeps (out, lse) and folds each block in that way, as ring attention does on GPUs (ring-flash-attention);
the (m, l, acc) recurrence above is what happens *inside* the block's kernel, tile by tile.

Every block folded in must leave each query row at least one visible key (true for the blocks the
schemes fold in: a causal diagonal block always shows the query its own key), so lse stays finite and no
exp(-inf - -inf) appears. The running (out, lse) are float32 at least (bf16 inputs), as FlashAttention's
sums are; each block's out comes back in the inputs' dtype, as the kernel writes it.
"""

from __future__ import annotations

import warnings

import torch

from tplab.layers.attend import attend_with_lse


class OnlineSoftmax:
    # True: on a GPU, each merge is one kernel that torch.compile makes of the formula (reads out and out_b
    # once, writes out once) instead of two in-place passes over out (and three small ones over lse): the
    # course project's bf16 layer on 4 GPUs, ring 6.78 -> 6.50 ms. Compiled once per shape (seconds, at the
    # first call); where torch.compile fails (no Triton, no compiler), the eager passes, with a warning.
    compiled_merge = True

    def __init__(self, q: torch.Tensor):  # q: (b, n, sq, d), the queries whose outputs we accumulate
        self.out_dtype = q.dtype
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        b, n, sq, d = q.shape
        self.out = torch.zeros((b, n, sq, d), dtype=acc_dtype, device=q.device)  # attention over keys seen so far
        self.lse = torch.full((b, n, sq), float("-inf"), dtype=acc_dtype, device=q.device)  # their log-sum-exp
        self.empty = True  # no key seen yet

    def update(self, q, k, v, causal_diagonal: bool = False) -> None:
        """Fold in keys k and values v (b, n, sk, d). ``causal_diagonal``: q and k cover the same
        positions, so query i may only see keys 0..i of this block."""
        self.merge(*attend_with_lse(q, k, v, causal=causal_diagonal))

    def merge(self, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
        """Fold in the attention over another set of keys: out_b (b, n, sq, d) with its lse_b (b, n, sq)."""
        lse_b = lse_b.to(self.lse.dtype)
        if self.empty:  # the first block is the summary (the formula gives the same, with two more passes)
            self.out, self.lse, self.empty = out_b.to(self.out.dtype), lse_b, False
            return
        if self.out.is_cuda and OnlineSoftmax.compiled_merge:
            try:
                with _more_graphs():
                    self.out, self.lse = _compiled_merge()(self.out, self.lse, out_b, lse_b)
                return
            except Exception as e:  # noqa: BLE001 - any compiler failure: the same formula, eagerly
                OnlineSoftmax.compiled_merge = False
                warnings.warn(f"OnlineSoftmax: torch.compile of the merge failed ({type(e).__name__}: {e}); "
                              "merging eagerly from now on", RuntimeWarning, stacklevel=2)
        lse = torch.logaddexp(self.lse, lse_b)
        # in place, one pass each: out = exp(lse_old - lse)·out, then += exp(lse_b - lse)·out_b
        self.out.mul_(torch.exp(self.lse - lse).unsqueeze(-1)).addcmul_(out_b, torch.exp(lse_b - lse).unsqueeze(-1))
        self.lse = lse

    def result(self) -> torch.Tensor:
        return self.out.to(self.out_dtype)  # (b, n, sq, d)


def _merge(out, lse, out_b, lse_b):
    new = torch.logaddexp(lse, lse_b)
    return out * torch.exp(lse - new).unsqueeze(-1) + out_b * torch.exp(lse_b - new).unsqueeze(-1), new


_compiled = None


def _compiled_merge():
    global _compiled
    if _compiled is None:
        # static shapes: a kernel per shape (measured: dynamic shapes made the merge slower than the eager
        # passes); a run of many layouts and sizes may then need more graphs than Dynamo's default limit,
        # after which it would run the formula eagerly without a word, so the limit is raised for this call
        _compiled = torch.compile(_merge, dynamic=False)
    return _compiled


def _more_graphs():
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    return config.patch(**{name: max(64, getattr(config, name))})
