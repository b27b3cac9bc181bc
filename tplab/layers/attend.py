"""The one scaled-dot-product attention of tplab, and the KV cache that feeds it.

Every model and layer (the GPT, the tensor-parallel attention, attention by query blocks, the fewer-syncs
shards, the sequence-parallel schemes that compute plain attention) calls ``attend``; the projections,
rotary embeddings and collectives around it are theirs.

    q = ...  (b, n, s_q, d)          k, v = extend_cache(cache, k, v)   (b, n_kv, past + s, d)
    y = attend(q, k, v, causal=True)  (b, n, s_q, d)

``attend_with_lse`` is the same attention that also returns each query row's log-sum-exp of its scores:
what it takes to combine the attention over one block of keys with the attention over another (ring
attention, tplab.sequence.online_softmax).
"""

from __future__ import annotations

import warnings

import torch
from torch.nn import functional as F
from torch.nn.attention.bias import causal_lower_right


def attend(q, k, v, *, causal: bool, mask=None):
    """softmax(q kᵀ / √d + mask) v for every batch row and head: q (b, n, s_q, d), k and v (b, n_kv, s_k, d)
    -> (b, n, s_q, d).

    causal: the queries are the *last* s_q positions of the keys (lower-right alignment, as
        ``torch.nn.attention.bias.causal_lower_right``): query i sees keys 0 .. s_k - s_q + i. For s_q == s_k
        this is the usual causal mask; with a KV cache the new tokens see everything before them, and a
        block of queries sees every key up to its own end.
    GQA: n_kv may be a divisor of n; each K/V head then serves n / n_kv consecutive query heads, repeated
        here (so a KV cache keeps n_kv heads). K and V already repeated to n heads pass as they are.
    mask: None, or a boolean (True: may attend) or additive (added to the scores) tensor broadcastable to
        (b, n, s_q, s_k), e.g. packed sequences' block-diagonal mask; with ``causal`` both apply.
    """
    group = q.shape[1] // k.shape[1]  # query heads per K/V head
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (b, n, s_k, d)
    s_q, s_k = q.shape[2], k.shape[2]
    if causal and mask is None:
        if s_q == s_k:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if _flash_directly(q, k, v) and s_q < s_k:
            try:  # the kernel the bias below dispatches to, without the dispatch (tens of us of host time a call)
                return torch.ops.aten._scaled_dot_product_flash_attention(
                    q, k, v, 0.0, True, False, scale=q.shape[-1] ** -0.5)[0]
            except RuntimeError:  # (a head dim or GPU FlashAttention does not take: the bias finds another)
                pass
        # PyTorch's fused kernels take this bias as it is (no (s_q, s_k) mask in memory); elsewhere on the
        # CPU the materialised lower-right boolean mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(s_q, s_k))
    if causal:
        visible = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(diagonal=s_k - s_q)  # (s_q, s_k)
        mask = mask & visible if mask.dtype == torch.bool else mask.masked_fill(~visible, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _flash_directly(q, k, v) -> bool:
    """May ``attend`` call FlashAttention's kernel itself, as the lower-right bias would? On a GPU in bf16 or
    fp16, with the flash backend allowed (``torch.backends.cuda.flash_sdp_enabled()``, which ``sdpa_kernel``
    sets) and nothing to differentiate (inference: the bias's own checks for a backward are not repeated)."""
    return (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and torch.backends.cuda.flash_sdp_enabled()
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)))


def attend_with_lse(q, k, v, *, causal: bool):
    """(out, lse): ``attend(q, k, v, causal=causal)`` and, for every query row, the log-sum-exp of its
    visible scores, lse = log Σ_j exp(q·k_j / √d)  ->  out (b, n, s_q, d) in q's dtype, lse (b, n, s_q) in
    float32 (float64 for float64 inputs).

    Why the lse: softmax over the keys of two blocks A and B together is a weighted mean of the two
    blocks' own attentions, out = exp(lse_A - lse)·out_A + exp(lse_B - lse)·out_B with
    lse = log(exp(lse_A) + exp(lse_B)); so attention over keys that arrive block by block never needs a
    block's score matrix after its kernel has returned.

    On a GPU it is one fused kernel (cuDNN's or FlashAttention's for bf16/fp16, the memory-efficient kernel
    for float32): the (s_q, s_k) scores never reach memory. Elsewhere (the CPU, float64) the scores are
    written out in float32 at least, exactly. ``causal`` and GQA as in ``attend``. A query row that sees
    no key (causal with s_q > s_k) has no attention: the exact path gives out = 0, lse = -inf, the fused
    kernels have conventions of their own (the schemes never ask for such a row). Forward only on a GPU.
    """
    group = q.shape[1] // k.shape[1]  # query heads per K/V head
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (b, n, s_k, d)
    if q.is_cuda and q.dtype != torch.float64:
        try:
            return _fused_attention_with_lse(q, k, v, causal)
        except (RuntimeError, TypeError) as e:  # a head dim, GPU or torch the kernel does not take: exact, slower
            warnings.warn(f"attend_with_lse: no fused kernel for these inputs ({e}); scores written out instead",
                          RuntimeWarning, stacklevel=2)
    return _exact_attention_with_lse(q, k, v, causal)


def _fused_attention_with_lse(q, k, v, causal: bool):
    """PyTorch's own kernels, called directly because F.scaled_dot_product_attention drops the lse.
    In bf16/fp16: cuDNN's fused attention where its settings and sizes allow (``_cudnn_attention_with_lse``)
    and its mask means the same (no mask, or a square causal one: cuDNN aligns a causal mask to the upper left),
    FlashAttention's otherwise (it aligns to the lower right, as ``attend``). On Hopper GPUs cuDNN's kernel
    is the faster: 1.6-1.9x for the sequence-parallel layer's blocks on an H200 and an H100 (1024 queries x
    1024-4096 keys, 40 heads of 128), the same lse to 2e-6. ``sdpa_kernel([SDPBackend.FLASH_ATTENTION])``
    (torch.nn.attention) turns cuDNN's off, as for F.scaled_dot_product_attention."""
    scale = q.shape[-1] ** -0.5
    if q.dtype in (torch.bfloat16, torch.float16):
        fused = _cudnn_attention_with_lse(q, k, v, causal, scale)
        if fused is not None:
            return fused
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse  # (b, n, s_q, d), (b, n, s_q) float32
    # float32: the memory-efficient kernel, on (b, s, n, d) views; mask type 2 = causal, lower right;
    # its lse is padded to a multiple of 32 query rows
    out, lse = torch.ops.aten._efficient_attention_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, None, None, None, 0.0,
        2 if causal else 0, True, scale=scale)[:2]
    return out.transpose(1, 2), lse[..., : q.shape[2]]


cudnn_with_lse = True   # False: FlashAttention's kernel for every bf16/fp16 block (how tplab ran them before)
_CUDNN_USABLE: dict = {}  # (shapes, dtype, causal, device) -> False once cuDNN's kernel failed on them
_CUDA_FAILURES = (torch.cuda.OutOfMemoryError,) + tuple(
    e for e in (getattr(torch, "AcceleratorError", None),) if e is not None)  # (not a refusal: raised as they are)


def _cudnn_attention_with_lse(q, k, v, causal: bool, scale: float):
    """(out, lse) from cuDNN's fused attention, or None where it is not to be used: turned off (cuDNN, its
    attention: ``torch.backends.cuda.cudnn_sdp_enabled()``, or here: ``cudnn_with_lse``), deterministic
    algorithms asked for, a causal rectangle, a cuDNN before 9.15 (PyTorch itself prefers its attention only from
    there on Hopper: a fix for sequences not a multiple of 128), inputs PyTorch's checks refuse by size (one key,
    a head dim not a multiple of 8 or above 256), or the kernel having failed on such inputs once (a warning; not
    tried again). PyTorch's dispatcher also checks the memory layout; the kernel takes strided views, and the
    sequence-parallel schemes' views ran exact and fast with it."""
    if (not cudnn_with_lse or not torch.backends.cuda.cudnn_sdp_enabled() or not torch.backends.cudnn.enabled
            or torch.are_deterministic_algorithms_enabled() or (causal and q.shape[2] != k.shape[2])
            or (torch.backends.cudnn.version() or 0) <= 91500):
        return None
    d = q.shape[-1]
    key = (q.shape, k.shape, q.dtype, causal, q.device)
    if k.shape[2] == 1 or d % 8 or d > 256 or not _CUDNN_USABLE.get(key, True):
        return None
    try:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention.default(   # (.default: no overload lookup)
            q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    except _CUDA_FAILURES:
        raise
    except (RuntimeError, TypeError, ValueError) as e:
        _CUDNN_USABLE[key] = False
        warnings.warn(f"attend_with_lse: cuDNN's attention failed on {tuple(q.shape)} {q.dtype} ({e}); "
                      "FlashAttention's kernel from now on", RuntimeWarning, stacklevel=4)
        return None
    return out, lse.reshape(lse.shape[:3])  # (b, n, s_q, d), (b, n, s_q, 1) -> (b, n, s_q) float32


def _exact_attention_with_lse(q, k, v, causal: bool):
    """The definition, with the scores in memory: float32 at least (float64 stays float64)."""
    wide = torch.promote_types(q.dtype, torch.float32)
    s_q, s_k = q.shape[2], k.shape[2]
    scores = (q.to(wide) @ k.to(wide).transpose(-2, -1)) * q.shape[-1] ** -0.5  # (b, n, s_q, s_k)
    if causal:
        visible = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(diagonal=s_k - s_q)
        scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)  # (b, n, s_q, 1); -inf for a row with no key
    weights = torch.exp(scores - lse.nan_to_num(neginf=0.0))  # softmax; 0 everywhere in a row with no key
    return (weights @ v.to(wide)).to(q.dtype), lse.squeeze(-1)


def past_length(cache) -> int:
    """How many positions the cache already holds (0 without one): the position of the first new token."""
    return cache["k"].shape[2] if cache and "k" in cache else 0


def extend_cache(cache, k, v):
    """Append this step's keys and values (b, kv, s, d) to the layer's cache; return all of them."""
    if cache is None:
        return k, v
    if "k" in cache:
        k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
    cache["k"], cache["v"] = k, v
    return k, v
