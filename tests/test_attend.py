"""tplab.layers.attend: the one attention, against attention written out by hand and torch's own biases;
attend_with_lse against it, and two blocks of keys combined through their log-sum-exps."""

import math

import pytest
import torch
from torch.nn.attention.bias import causal_lower_right

from tplab.layers.attend import attend, attend_with_lse, extend_cache, past_length


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


@pytest.mark.parametrize("n_kv", [6, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("s_q, s_k", [(5, 5), (3, 7), (4, 9)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attend_with_lse_is_attend_and_the_log_sum_exp_of_the_visible_scores(causal, s_q, s_k, n_kv):
    q, k, v = randn(2, 6, s_q, 4, seed=0), randn(2, n_kv, s_k, 4, seed=1), randn(2, n_kv, s_k, 4, seed=2)
    out, lse = attend_with_lse(q, k, v, causal=causal)
    torch.testing.assert_close(out, attend(q, k, v, causal=causal), rtol=0, atol=1e-12)
    assert lse.shape == (2, 6, s_q) and lse.dtype == torch.float64
    k6 = k.repeat_interleave(6 // n_kv, dim=1)  # (b, n, s_k, d)
    scores = q @ k6.transpose(-2, -1) / math.sqrt(4)  # (b, n, s_q, s_k)
    if causal:
        scores = scores.masked_fill(~torch.ones(s_q, s_k, dtype=torch.bool).tril(diagonal=s_k - s_q), float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(dim=-1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_two_blocks_of_keys_combine_through_their_log_sum_exps(causal):
    """Keys 0..3 and 4..8 apart, then merged: the attention over all of them (the ring's update)."""
    q, k, v = randn(1, 2, 5, 4, seed=3), randn(1, 2, 9, 4, seed=4), randn(1, 2, 9, 4, seed=5)
    out_a, lse_a = attend_with_lse(q, k[:, :, :4], v[:, :, :4], causal=False)  # all in the queries' past
    out_b, lse_b = attend_with_lse(q, k[:, :, 4:], v[:, :, 4:], causal=causal)  # the queries' own block
    lse = torch.logaddexp(lse_a, lse_b)
    out = (lse_a - lse).exp()[..., None] * out_a + (lse_b - lse).exp()[..., None] * out_b
    torch.testing.assert_close(out, attend(q, k, v, causal=causal), rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, attend_with_lse(q, k, v, causal=causal)[1], rtol=0, atol=1e-12)


def test_attend_with_lse_a_query_that_sees_no_key_and_float32_bfloat16():
    q, k, v = randn(1, 2, 5, 4, seed=6), randn(1, 2, 3, 4, seed=7), randn(1, 2, 3, 4, seed=8)
    out, lse = attend_with_lse(q, k, v, causal=True)  # lower right: queries 0 and 1 see no key
    assert torch.equal(out[:, :, :2], torch.zeros(1, 2, 2, 4)) and torch.isneginf(lse[:, :, :2]).all()
    torch.testing.assert_close(out[:, :, 2:], attend(q[:, :, 2:], k, v, causal=True), rtol=0, atol=1e-12)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        out, lse = attend_with_lse(q.to(dtype), k.to(dtype), v.to(dtype), causal=False)
        assert out.dtype == dtype and lse.dtype == torch.float32  # the scores themselves in float32
        torch.testing.assert_close(out.double(), attend(q, k, v, causal=False), rtol=tol, atol=tol)
