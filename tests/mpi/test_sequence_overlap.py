"""Overlapped sequence parallelism equals the unsplit computation (float64, ~1e-12): the all-gather of K/V
in head groups (scheme and layer, forward and backward), ring attention's (out, lse) merges (the online
softmax in any block order, the layer; streamed K/V over a shard exchange); bad head_groups is the same ValueError on every rank."""

from functools import partial

import pytest
from mpitest import COMM, agree

torch = pytest.importorskip("torch")

from tplab.comm import world  # noqa: E402
from tplab.comm.shard_exchange import MessageExchange  # noqa: E402
from tplab.cost import attention_bytes, attention_messages  # noqa: E402
from tplab.layers.attend import attend  # noqa: E402
from tplab.models.gpt import Block, GPTConfig  # noqa: E402
from tplab.sequence import (  # noqa: E402
    LAYOUTS,
    SequenceParallelBlock,
    SequenceParallelError,
    allgather_kv_attention,
    exchange_allgather_first_dim,
    shard,
    unsplit_layer,
)
from tplab.sequence.online_softmax import OnlineSoftmax  # noqa: E402

P, RANK = COMM.size, COMM.rank
C = world(timeout=10)
TOL = {"rtol": 1e-12, "atol": 1e-12}
KV_HEADS = 4  # head groups of 1, 2 or 4 K/V heads; 8 query heads (GQA: two per K/V head)


def randn(*shape, seed):
    """The same random float64 tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def qkv(seed, kv_heads=KV_HEADS):
    b, s, d = 2, 2 * P * 3, 4  # zig-zag: s divisible by 2P
    return (randn(b, 8, s, d, seed=seed), randn(b, kv_heads, s, d, seed=seed + 1),
            randn(b, kv_heads, s, d, seed=seed + 2))


def mine(t, layout):
    return shard(t, RANK, P, layout, dim=2)


def differs(a, b) -> str:
    return f"differs by {(a - b).abs().max():.2e}"


@pytest.mark.parametrize("head_groups", [2, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_head_groups_give_full_attention_and_its_gradients_with_the_same_bytes(causal, layout, head_groups):
    q, k, v = (t.requires_grad_() for t in qkv(seed=0))
    full = attend(q, k, v, causal=causal)
    full.pow(2).sum().backward()
    parts = [mine(t.detach(), layout).requires_grad_() for t in (q, k, v)]
    C.reset_counters()
    out = allgather_kv_attention(*parts, C, causal=causal, layout=layout, head_groups=head_groups)
    agree(torch.allclose(out, mine(full, layout), **TOL), differs(out, mine(full, layout)))
    b, n, s, d = q.shape
    bytes_formula = attention_bytes("allgather_kv", b, s, n * d, P, kv_hidden=KV_HEADS * d, bytes_per_element=8)
    agree(C.bytes_sent == bytes_formula, f"sent {C.bytes_sent} B, formula {bytes_formula} B")
    agree(C.messages_sent == head_groups * attention_messages("allgather_kv", P),
          f"{C.messages_sent} messages for {head_groups} groups")  # the same bytes, in G times the messages
    out.pow(2).sum().backward()
    for name, whole, part in zip("qkv", (q, k, v), parts):
        want = mine(whole.grad, layout)
        agree(torch.allclose(part.grad, want, **TOL), f"d{name} " + differs(part.grad, want))


@pytest.mark.parametrize("head_groups, side_stream", [(1, None), (2, None), (1, True)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_groups_through_a_shard_exchange_give_full_attention_and_its_gradients(layout, head_groups,
                                                                                     side_stream):
    """The gather of a shard exchange (on GPUs: the copy engines'), every block landing in place: the same
    attention, the same bytes (counted on the exchange's communicator), gradients through the reduce-scatter."""
    exchange = MessageExchange(C, duplicate=False)  # (on C itself: its counters count the bytes)
    gather = partial(exchange_allgather_first_dim, exchange=exchange)
    q, k, v = (t.requires_grad_() for t in qkv(seed=5))
    full = attend(q, k, v, causal=True)
    full.pow(2).sum().backward()
    parts = [mine(t.detach(), layout).requires_grad_() for t in (q, k, v)]
    C.reset_counters()
    out = allgather_kv_attention(*parts, C, causal=True, layout=layout, head_groups=head_groups, gather=gather,
                                 side_stream=side_stream)
    agree(torch.allclose(out, mine(full, layout), **TOL), differs(out, mine(full, layout)))
    b, n, s, d = q.shape
    bytes_formula = attention_bytes("allgather_kv", b, s, n * d, P, kv_hidden=KV_HEADS * d, bytes_per_element=8)
    agree(C.bytes_sent == bytes_formula, f"sent {C.bytes_sent} B, formula {bytes_formula} B")
    out.pow(2).sum().backward()
    for name, whole, part in zip("qkv", (q, k, v), parts):
        want = mine(whole.grad, layout)
        agree(torch.allclose(part.grad, want, **TOL), f"d{name} " + differs(part.grad, want))


def test_start_gather_refuses_a_bad_out_on_every_rank():
    from tplab.collectives import CollectiveArgumentError

    exchange = MessageExchange(C)
    shard = torch.full((3, 2), float(RANK), dtype=torch.float64)
    bad = torch.empty((P, 3, 2), dtype=torch.float32 if RANK == 0 else torch.float64)  # rank 0's dtype is wrong
    with pytest.raises(CollectiveArgumentError, match="rank 0: out must be"):
        exchange.start_gather(shard, out=bad)
    good = torch.empty((P, 3, 2), dtype=torch.float64)
    exchange.start_gather(shard, out=good).done()  # (the exchange still works after a refused call)
    agree(all(bool((good[q] == q).all()) for q in range(P)), f"gathered {good[:, 0, 0].tolist()}")


def test_streamed_kv_goes_on_after_one_rank_failed_mid_call(monkeypatch):
    """Rank 0 fails while folding the blocks in: it abandons the call (the exchange keeps its receive
    buffers while MPI may still write into them), the other ranks finish theirs (rank 0's blocks left at
    the start). The next call takes a tag of its own on every rank and is exact."""
    from tplab.sequence import streamed_kv

    q, k, v = (mine(t, "contiguous") for t in qkv(seed=7))
    expected = mine(attend(*qkv(seed=7), causal=True), "contiguous")
    if RANK == 0:
        def failing(*args, **kwargs):
            raise RuntimeError("injected failure")

        monkeypatch.setattr(streamed_kv, "fold_block", failing)
        with pytest.raises(RuntimeError, match="injected failure"):
            streamed_kv.streamed_kv_attention(q, k, v, C, causal=True)
        monkeypatch.undo()
    else:
        streamed_kv.streamed_kv_attention(q, k, v, C, causal=True)
    again = streamed_kv.streamed_kv_attention(q, k, v, C, causal=True)
    agree(torch.allclose(again, expected, **TOL), differs(again, expected))


def test_the_ring_goes_on_after_one_rank_failed_mid_call(monkeypatch):
    """Rank 0's compute fails at the ring's second step: it passes on every block still owed, without computing,
    and raises; the other ranks' results are exact (no block they wait for is missing), and the next call is
    exact on every rank."""
    from tplab.sequence import ring

    q, k, v = (mine(t, "zigzag") for t in qkv(seed=8))
    expected = mine(attend(*qkv(seed=8), causal=True), "zigzag")
    fold, folds = ring.fold_block, []

    def failing_second(*args, **kwargs):
        folds.append(1)
        if len(folds) == 2:
            raise RuntimeError("injected failure")
        return fold(*args, **kwargs)

    if RANK == 0 and P > 1:
        monkeypatch.setattr(ring, "fold_block", failing_second)
        with pytest.raises(RuntimeError, match="injected failure"):
            ring.ring_attention(q, k, v, C, causal=True, layout="zigzag")
        monkeypatch.undo()
    else:
        got = ring.ring_attention(q, k, v, C, causal=True, layout="zigzag")
        assert torch.allclose(got, expected, **TOL), differs(got, expected)   # (this rank alone: not agree)
    again = ring.ring_attention(q, k, v, C, causal=True, layout="zigzag")
    agree(torch.allclose(again, expected, **TOL), differs(again, expected))


def test_null_exchange_fills_out_with_this_ranks_shard():
    from tplab.comm.shard_exchange import NullExchange

    shard = torch.arange(6.0).reshape(3, 2)
    out = torch.empty(4, 3, 2)
    NullExchange(1, 4).start_gather(shard, out=out).done()
    assert all(torch.equal(out[q], shard) for q in range(4))


def llama_block():
    """RoPE (rotations by global positions), GQA, SwiGLU, RMSNorm: every way the layer can be split wrong."""
    torch.manual_seed(1)  # the same weights on every rank
    return Block(GPTConfig(n_embd=32, n_head=8, n_kv_head=KV_HEADS, mlp="swiglu", norm="rmsnorm", position="rope",
                           bias=False, dtype=torch.float64))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_layer_with_head_groups_or_the_ring_equals_the_unsplit_layer(causal, layout):
    block = llama_block()
    x = randn(2, 4 * P, 32, seed=2)  # (b, s, h)
    with torch.no_grad():
        expected = shard(unsplit_layer(block, causal=causal)(x), RANK, P, layout)
        exchange = MessageExchange(C)  # (one exchange for several layers' calls, on a duplicate of C)
        for scheme, options in [("allgather_kv", {"head_groups": 2}), ("allgather_kv", {"head_groups": 4}),
                                ("ring", {}), ("streamed_kv", {}), ("streamed_kv", {"exchange": exchange})]:
            layer = SequenceParallelBlock(block, C, scheme=scheme, layout=layout, causal=causal, **options)
            for _ in range(2):  # (a second call through the same exchange)
                y = layer(shard(x, RANK, P, layout))
                agree(torch.allclose(y, expected, **TOL), f"{scheme} {options}: " + differs(y, expected))


def test_the_layers_weight_gradients_with_head_groups_sum_to_the_unsplit_ones():
    """Weights are replicated: each rank's weight gradient covers its tokens; their sum is the full one."""
    block = llama_block()
    x = randn(2, 4 * P, 32, seed=3).requires_grad_()
    block(x).pow(2).sum().backward()
    full = {name: w.grad.clone() for name, w in block.named_parameters()}
    block.zero_grad()
    x_mine = shard(x.detach(), RANK, P, "zigzag").requires_grad_()
    SequenceParallelBlock(block, C, layout="zigzag", head_groups=4)(x_mine).pow(2).sum().backward()
    agree(torch.allclose(x_mine.grad, shard(x.grad, RANK, P, "zigzag"), **TOL), "dx differs")
    for name, w in block.named_parameters():
        summed = torch.from_numpy(COMM.allreduce(w.grad.numpy()))
        agree(torch.allclose(summed, full[name], **TOL), f"{name}: summed gradient " + differs(summed, full[name]))


@pytest.mark.parametrize("head_groups", [0, -2, 3, 2.0, True])
def test_bad_head_groups_is_the_same_value_error_on_every_rank(head_groups):
    q, k, v = (mine(t, "contiguous") for t in qkv(seed=4))
    layer = SequenceParallelBlock(llama_block(), C, head_groups=head_groups)
    for attempt in (lambda: allgather_kv_attention(q, k, v, C, head_groups=head_groups),
                    lambda: layer(randn(1, 2, 32, seed=5))):
        with pytest.raises(ValueError, match=f"head_groups={head_groups!r}: the 4 key/value heads must split"):
            attempt()
    agree(issubclass(SequenceParallelError, ValueError))


@pytest.mark.parametrize("side_stream", ["yes", 1.0, 0])
def test_a_side_stream_that_is_not_true_false_or_none_is_the_same_value_error_on_every_rank(side_stream):
    q, k, v = (mine(t, "contiguous") for t in qkv(seed=4))
    with pytest.raises(ValueError, match=f"side_stream={side_stream!r}: True, False or None"):
        allgather_kv_attention(q, k, v, C, side_stream=side_stream)


def test_the_online_softmax_of_blocks_in_any_order_is_full_attention():
    """The teaching object on its own (no ranks): the keys in three blocks, folded in two orders."""
    q, k, v = qkv(seed=6, kv_heads=8)
    blocks = [(k[:, :, i:i + 4], v[:, :, i:i + 4]) for i in range(0, k.shape[2], 4)]
    full = attend(q, k, v, causal=False)
    for order in (blocks, blocks[::-1]):
        softmax = OnlineSoftmax(q)
        for k_block, v_block in order:
            softmax.update(q, k_block, v_block)
        agree(torch.allclose(softmax.result(), full, **TOL), differs(softmax.result(), full))


def test_the_online_softmax_writes_its_result_where_it_is_told():
    """``out``: the result lands in the given view (here laid out (b, s, n, d), as the schemes give it), the
    same values as without; a view of another shape or dtype is refused; no block at all gives zeros."""
    q, k, v = qkv(seed=7, kv_heads=8)
    full = attend(q, k, v, causal=False)
    b, n, s, d = q.shape
    out = torch.full((b, s, n, d), float("nan"), dtype=q.dtype).transpose(1, 2)
    softmax = OnlineSoftmax(q, out=out)
    for i in range(0, k.shape[2], 4):
        softmax.update(q, k[:, :, i:i + 4], v[:, :, i:i + 4], final=i + 4 >= k.shape[2])
    result = softmax.result()
    agree(result is out and torch.allclose(out, full, **TOL), differs(out, full))
    for bad in (torch.empty(b, n, s + 1, d, dtype=q.dtype), torch.empty(b, n, s, d, dtype=torch.float32)):
        with pytest.raises(ValueError, match="OnlineSoftmax: out must be"):
            OnlineSoftmax(q, out=bad)
    agree(bool((OnlineSoftmax(q).result() == 0).all()), "attention over no key is not zeros")


def test_the_layer_refuses_a_fused_kv_that_is_not_this_blocks_or_next_another_gather():
    """(FusedKV itself needs a GPU: tests/gpu/test_gpu_fused_kv.py. Here, the layer's checks of it, on every rank.)"""
    from types import SimpleNamespace

    block, other = (Block(GPTConfig(n_embd=16, n_head=4, dtype=torch.float64)) for _ in range(2))
    mine = SimpleNamespace(attention=block.attention, rank=C.rank, size=C.size)
    SequenceParallelBlock(block, C, scheme="allgather_kv", fused_kv=mine)   # this block's, the all-gather scheme
    for scheme, fused, options in [("allgather_kv", SimpleNamespace(attention=other.attention, rank=C.rank,
                                                                     size=C.size), {}),
                                   ("ring", mine, {}), ("allgather_kv", mine, {"head_groups": 2}),
                                   ("allgather_kv", mine, {"side_stream": True})]:
        with pytest.raises(ValueError, match="fused_kv: a FusedKV made from this block's attention"):
            SequenceParallelBlock(block, C, scheme=scheme, fused_kv=fused, **options)
