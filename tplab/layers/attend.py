"""The one scaled-dot-product attention of tplab, and the KV cache that feeds it.

Every model and layer (the GPT, the tensor-parallel attention, attention by query blocks, the fewer-syncs
shards, the sequence-parallel schemes that compute plain attention) calls ``attend``; the projections,
rotary embeddings and collectives around it are theirs.

    q = ...  (b, n, s_q, d)          k, v = extend_cache(cache, k, v)   (b, n_kv, past + s, d)
    y = attend(q, k, v, causal=True)  (b, n, s_q, d)
"""

from __future__ import annotations

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
        # PyTorch's fused kernels take this bias as it is (no (s_q, s_k) mask in memory); for s_q == s_k
        # it is plain is_causal=True, elsewhere on the CPU the materialised lower-right boolean mask
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(s_q, s_k))
    if causal:
        visible = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(diagonal=s_k - s_q)  # (s_q, s_k)
        mask = mask & visible if mask.dtype == torch.bool else mask.masked_fill(~visible, float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


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
