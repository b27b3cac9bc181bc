"""The online softmax's merge as one GPU kernel (Triton): two attention summaries in, one out.

    lse_new = log(exp(lse) + exp(lse_b))
    out_new = exp(lse - lse_new) · out + exp(lse_b - lse_new) · out_b        (per query row, over d)

Why a kernel of our own: the merge is memory-bound (it reads out and out_b once and writes out_new once),
and the ring folds a block every few hundred microseconds, so the *host's* cost per merge matters as much
as the GPU's: torch.compile's kernel moved the same bytes, but its call (guards, dispatch) took the host
120-210 µs per merge on 4x H100 hosts -- longer than the GPU needs for a block's attention, so the ring
became host-bound. A Triton launch costs the host a few tens of microseconds.

Rows are (batch, head, query); each program takes ROWS rows of d values (any strides: the attention kernels
hand back views in their own layouts), sums in float32 and writes ``dtype``: float32 while blocks follow, the
queries' dtype for the last merge. Precondition (as for the formula): both lse finite in every row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 16


@triton.jit
def _merge(out, lse, out_b, lse_b, new_out, new_lse, rows, heads, queries, d,
           o0, o1, o2, o3, l0, l1, l2, b0, b1, b2, b3, m0, m1, m2,
           ROWS: tl.constexpr, D: tl.constexpr):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    valid = row < rows
    q = row % queries                                   # (batch, head, query) of each row
    h = (row // queries) % heads
    b = row // (queries * heads)
    a_lse = tl.load(lse + b * l0 + h * l1 + q * l2, mask=valid, other=0.0).to(tl.float32)
    b_lse = tl.load(lse_b + b * m0 + h * m1 + q * m2, mask=valid, other=0.0).to(tl.float32)
    top = tl.maximum(a_lse, b_lse)
    new = top + tl.log(tl.exp(a_lse - top) + tl.exp(b_lse - top))
    col = tl.arange(0, D)
    both = valid[:, None] & (col[None, :] < d)
    a = tl.load(out + (b * o0 + h * o1 + q * o2)[:, None] + col[None, :] * o3, mask=both, other=0.0)
    c = tl.load(out_b + (b * b0 + h * b1 + q * b2)[:, None] + col[None, :] * b3, mask=both, other=0.0)
    merged = a.to(tl.float32) * tl.exp(a_lse - new)[:, None] + c.to(tl.float32) * tl.exp(b_lse - new)[:, None]
    tl.store(new_out + row[:, None] * d + col[None, :], merged.to(new_out.dtype.element_ty), mask=both)
    tl.store(new_lse + row, new, mask=valid)


def merge(out, lse, out_b, lse_b, dtype):
    """(out_new, lse_new): out, out_b (b, n, sq, d), lse, lse_b (b, n, sq); out_new contiguous in ``dtype``,
    lse_new in float32, on the current stream."""
    b, n, sq, d = out.shape
    new_out = torch.empty((b, n, sq, d), dtype=dtype, device=out.device)
    new_lse = torch.empty((b, n, sq), dtype=torch.float32, device=out.device)
    rows = b * n * sq
    if rows:
        _merge[(triton.cdiv(rows, ROWS),)](out, lse, out_b, lse_b, new_out, new_lse, rows, n, sq, d,
                                           *out.stride(), *lse.stride(), *out_b.stride(), *lse_b.stride(),
                                           ROWS=ROWS, D=triton.next_power_of_2(d), num_warps=4)
    return new_out, new_lse
