"""The online softmax's merge as one GPU kernel (Triton): two attention summaries in, one out.

    lse_new = log(exp(lse) + exp(lse_b))
    out_new = exp(lse - lse_new) · out + exp(lse_b - lse_new) · out_b        (per query row, over d)

Why a kernel of our own: the merge is memory-bound (it reads out and out_b once and writes out_new once),
and the ring folds a block every few hundred microseconds, so the *host's* cost per merge matters as much
as the GPU's: torch.compile's kernel moved the same bytes, but its call (guards, dispatch) took the host
120-210 µs per merge on 4x H100 hosts -- longer than the GPU needs for a block's attention, so the ring
became host-bound. A Triton launch costs the host a few tens of microseconds; less again when the kernel
Triton compiled for a kind of call is launched directly (``_launch``: 28 µs instead of 48 on an H100 host),
skipping the per-call work of Triton's dispatcher (binding and specializing 30 arguments).

Rows are (batch, head, query); each program takes ROWS rows of d values (any strides: the attention kernels
hand back views in their own layouts), sums in float32 and writes ``dtype``: float32 while blocks follow, the
queries' dtype for the last merge -- there into ``into`` if given, a view of any strides (the schemes hand the
output projection's (b, s, n, d) layout, which then needs no copy). Precondition (as for the formula): both
lse finite in every row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 16


@triton.jit
def _merge(out, lse, out_b, lse_b, new_out, new_lse, rows, heads, queries, d,
           o0, o1, o2, o3, l0, l1, l2, b0, b1, b2, b3, m0, m1, m2, n0, n1, n2, n3,
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
    tl.store(new_out + (b * n0 + h * n1 + q * n2)[:, None] + col[None, :] * n3, merged.to(new_out.dtype.element_ty),
             mask=both)
    tl.store(new_lse + row, new, mask=valid)


def merge(out, lse, out_b, lse_b, dtype, into=None):
    """(out_new, lse_new): out, out_b (b, n, sq, d), lse, lse_b (b, n, sq); out_new in ``dtype``, contiguous or
    ``into`` (a (b, n, sq, d) tensor of that dtype, any strides), lse_new in float32, on the current stream."""
    b, n, sq, d = out.shape
    new_out = torch.empty((b, n, sq, d), dtype=dtype, device=out.device) if into is None else into
    new_lse = torch.empty((b, n, sq), dtype=torch.float32, device=out.device)
    rows = b * n * sq
    if rows:
        _launch((triton.cdiv(rows, ROWS), 1, 1), (out, lse, out_b, lse_b, new_out, new_lse),
                (rows, n, sq, d, *out.stride(), *lse.stride(), *out_b.stride(), *lse_b.stride(), *new_out.stride()),
                triton.next_power_of_2(d))
    return new_out, new_lse


_compiled: dict = {}   # what Triton compiled, by what it specialized on: dtypes, integers, 16-byte alignment
direct = True           # False: every launch through Triton's dispatcher (after the direct launch failed once)


def _launch(grid, tensors, integers, width):
    """_merge on ``grid``. The first call of a kind goes through Triton's dispatcher, which compiles (or finds)
    the kernel for it and returns it; later calls of that kind launch it directly. A kind is everything the
    dispatcher specializes on, so the kernel found is the one it would pick: each tensor's dtype and whether
    its address is a multiple of 16, and the integers' values (a ring repeats a few kinds of call); and the GPU
    it was loaded on, and ROWS."""
    global direct
    key = (tensors[0].device, ROWS, tuple((t.dtype, t.data_ptr() % 16 == 0) for t in tensors), integers, width)
    kernel = _compiled.get(key) if direct else None
    if kernel is not None:
        try:
            kernel[grid](*tensors, *integers, ROWS, width)
            return
        except Exception:  # noqa: BLE001 - another Triton's compiled kernels launch otherwise: its dispatcher
            direct = False
    kernel = _merge[grid](*tensors, *integers, ROWS=ROWS, D=width, num_warps=4)
    if direct and kernel is not None:
        if len(_compiled) > 64:   # (kinds of call are few; a program of many shapes starts over)
            _compiled.clear()
        _compiled[key] = kernel
