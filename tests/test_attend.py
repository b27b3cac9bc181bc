"""tplab.layers.attend: the one attention, against attention written out by hand and torch's own biases."""

import math

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

from tplab.layers.attend import attend, extend_cache, past_length


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def by_hand(q, k, v, visible=None):
    """softmax(q kᵀ / √d) v with the scores of invisible (False) pairs set to -inf; k, v with q's heads."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (b, n, s_q, s_k)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores.softmax(dim=-1) @ v


@pytest.mark.parametrize("s_q, s_k", [(5, 5), (3, 7), (1, 6)])
def test_causal_means_the_queries_are_the_last_positions_of_the_keys(s_q, s_k):
    q, k, v = randn(2, 3, s_q, 4, seed=0), randn(2, 3, s_k, 4, seed=1), randn(2, 3, s_k, 4, seed=2)
    lower_right = torch.ones(s_q, s_k, dtype=torch.bool).tril(diagonal=s_k - s_q)  # query i sees keys <= s_k-s_q+i
    out = attend(q, k, v, causal=True)
    torch.testing.assert_close(out, by_hand(q, k, v, lower_right), rtol=0, atol=1e-12)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(s_q, s_k)._materialize()), rtol=0, atol=1e-12)
    if s_q == s_k:
        assert torch.equal(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_not_causal_sees_every_key():
    q, k, v = randn(1, 2, 3, 4, seed=0), randn(1, 2, 6, 4, seed=1), randn(1, 2, 6, 4, seed=2)
    torch.testing.assert_close(attend(q, k, v, causal=False), by_hand(q, k, v), rtol=0, atol=1e-12)


def test_a_kv_cache_fed_token_by_token_gives_the_rows_of_the_whole_sequence():
    q, k, v = randn(1, 2, 6, 4, seed=0), randn(1, 2, 6, 4, seed=1), randn(1, 2, 6, 4, seed=2)
    whole, cache, rows = attend(q, k, v, causal=True), {}, []
    for t in range(6):
        assert past_length(cache) == t
        k_all, v_all = extend_cache(cache, k[:, :, t:t + 1], v[:, :, t:t + 1])  # (b, n, t + 1, d)
        rows.append(attend(q[:, :, t:t + 1], k_all, v_all, causal=True))
    torch.testing.assert_close(torch.cat(rows, dim=2), whole, rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_gqa_repeats_each_kv_head_for_its_group_of_query_heads(causal):
    n, n_kv = 6, 2
    q, k, v = randn(2, n, 5, 4, seed=0), randn(2, n_kv, 5, 4, seed=1), randn(2, n_kv, 5, 4, seed=2)
    out = attend(q, k, v, causal=causal)  # (b, n, s, d)
    for head in range(n):
        kv = head // (n // n_kv)  # query heads 0, 1, 2 share KV head 0; 3, 4, 5 KV head 1
        expected = attend(q[:, head:head + 1], k[:, kv:kv + 1], v[:, kv:kv + 1], causal=causal)
        torch.testing.assert_close(out[:, head:head + 1], expected, rtol=0, atol=1e-12)
    repeated = attend(q, k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1), causal=causal)
    assert torch.equal(out, repeated)  # already repeated K, V pass as they are


def test_an_explicit_mask_boolean_or_additive_applies_together_with_causal():
    q, k, v = randn(1, 2, 5, 4, seed=0), randn(1, 2, 5, 4, seed=1), randn(1, 2, 5, 4, seed=2)
    owner = torch.tensor([0, 0, 0, 1, 1])  # two packed sequences, lengths 3 and 2
    same_sequence = owner[:, None] == owner[None, :]  # (5, 5): not causal by itself
    visible = same_sequence & torch.ones(5, 5, dtype=torch.bool).tril()
    expected = by_hand(q, k, v, visible)
    torch.testing.assert_close(attend(q, k, v, causal=True, mask=same_sequence), expected, rtol=0, atol=1e-12)
    additive = torch.zeros(5, 5, dtype=torch.float64).masked_fill(~same_sequence, float("-inf"))
    torch.testing.assert_close(attend(q, k, v, causal=True, mask=additive), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(attend(q, k, v, causal=False, mask=visible), expected, rtol=0, atol=1e-12)
    # packed, each sequence is what it would be alone
    torch.testing.assert_close(expected[:, :, 3:], attend(q[:, :, 3:], k[:, :, 3:], v[:, :, 3:], causal=True),
                               rtol=0, atol=1e-12)
