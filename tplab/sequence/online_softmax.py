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
exp(-inf - -inf) appears. Merges are summed in float32 at least (bf16 inputs), as FlashAttention's sums
are, and the running (out, lse) kept so; each block's out comes back in the inputs' dtype, as the kernel
writes it. Bytes matter here (each merge reads and writes the whole output: at the course project's size a
merge is memory-bound), so the first block is kept as the kernel wrote it (the next merge widens it as it
reads it) and the last merge, told it is ``final``, writes the inputs' dtype at once -- into ``out`` when
the caller gives one (the schemes give a view of the output projection's (b, s, n, d) layout: no copy of the
result afterwards). Counted in bf16 outputs (O), p blocks then cost 5(p-1)-2 O of memory traffic instead of
5(p-1)+6 O (widening the first block, casting the sum at the end): at p = 4 and the course project's size
(O = 42 MB), 0.55 GB instead of 0.88.
"""

from __future__ import annotations

import warnings

import torch

from tplab.layers.attend import attend_with_lse


class OnlineSoftmax:
    # True: on a GPU, each merge is one Triton kernel (merge_kernel.py: reads out and out_b once, writes out
    # once, and costs the host little) instead of two in-place passes over out (and three small ones over lse).
    # Where Triton cannot run it (none installed, no compiler), the eager passes, with a warning.
    merge_kernel = True

    def __init__(self, q: torch.Tensor, out: torch.Tensor | None = None):
        """q: (b, n, sq, d), the queries whose outputs we accumulate. ``out``: where the result goes (q's shape
        and dtype, any strides), or None: a tensor of its own."""
        self.out_dtype = q.dtype
        self.acc_dtype = torch.promote_types(q.dtype, torch.float32)
        if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
            raise ValueError(f"OnlineSoftmax: out must be a {tuple(q.shape)} {q.dtype} tensor on {q.device}, "
                             f"got {tuple(out.shape)} {out.dtype} on {out.device}")
        self.destination, self.shape, self.device = out, q.shape, q.device
        # (out, lse): the attention over the keys seen so far and their log-sum-exp; None until the first block,
        # which becomes them as it is (no zeros written only to be replaced)
        self.out = self.lse = None

    @property
    def empty(self) -> bool:  # no key seen yet
        return self.out is None

    def update(self, q, k, v, causal_diagonal: bool = False, final: bool = False) -> None:
        """Fold in keys k and values v (b, n, sk, d). ``causal_diagonal``: q and k cover the same
        positions, so query i may only see keys 0..i of this block. ``final``: no block follows (see merge)."""
        self.merge(*attend_with_lse(q, k, v, causal=causal_diagonal), final=final)

    def merge(self, out_b: torch.Tensor, lse_b: torch.Tensor, final: bool = False) -> None:
        """Fold in the attention over another set of keys: out_b (b, n, sq, d) with its lse_b (b, n, sq).
        ``final``: no block follows, so the merge writes the result in the queries' dtype (bf16: half the
        bytes of a float32 sum, and no separate cast), into ``out`` if one was given. A block merged after
        it still works, rounded once more."""
        if lse_b.dtype != self.acc_dtype:
            lse_b = lse_b.to(self.acc_dtype)
        if self.empty:  # the first block is the summary (the formula gives the same, with two more passes); kept
            self.out, self.lse = out_b, lse_b  # in its dtype: the next merge widens it as it reads
            return
        into = self.destination if final else None
        if self.out.is_cuda and self.acc_dtype == torch.float32 and OnlineSoftmax.merge_kernel:
            try:
                self.out, self.lse = _merge_kernel()(self.out, self.lse, out_b, lse_b,
                                                     self.out_dtype if final else self.acc_dtype, into)
                return
            except Exception as e:  # noqa: BLE001 - any failure to build or launch it: the same formula, eagerly
                OnlineSoftmax.merge_kernel = False
                warnings.warn(f"OnlineSoftmax: the merge kernel failed ({type(e).__name__}: {e}); merging eagerly "
                              "from now on", RuntimeWarning, stacklevel=2)
        lse = torch.logaddexp(self.lse, lse_b)
        self.out = self.out.to(self.acc_dtype)  # (the first block's, widened once; a no-op after)
        # in place, one pass each: out = exp(lse_old - lse)·out, then += exp(lse_b - lse)·out_b
        self.out.mul_(torch.exp(self.lse - lse).unsqueeze(-1)).addcmul_(out_b, torch.exp(lse_b - lse).unsqueeze(-1))
        self.lse = lse

    def result(self) -> torch.Tensor:
        """The attention over every key folded in (b, n, sq, d), in the queries' dtype: ``out`` if one was
        given (the last merge wrote it there, or the result is copied in), else a tensor of its own."""
        if self.empty:  # (no key at all: attention over nothing, zeros by the convention of the exact path)
            result = torch.zeros(self.shape, dtype=self.out_dtype, device=self.device)
        else:
            result = self.out
        if self.destination is None:
            return result.to(self.out_dtype)
        return result if result is self.destination else self.destination.copy_(result)   # (copy_ casts)


_kernel = None


def _merge_kernel():
    """merge_kernel.merge, imported once (Triton is needed only on a GPU; its import raises where it is missing)."""
    global _kernel
    if _kernel is None:
        from tplab.sequence.merge_kernel import merge

        _kernel = merge
    return _kernel
