"""Async tensor parallelism (tplab.overlap.async_tp) on CPU ranks: the block on sequence shards, its
collectives cut into shards that move under the GEMMs, equals the plain tensor-parallel block's rows
(float64, ~1e-12): causal and not, grouped-query attention (replicated and split KV heads) with rotary
positions, SwiGLU, batch 1, a stack; the message and null exchanges on their own; bad input on one rank
is an error on every rank; an error mid-block leaves the exchange usable; the scatter's send rules."""

import pytest
from mpitest import COMM, agree

torch = pytest.importorskip("torch")

from tplab.collectives import CollectiveArgumentError  # noqa: E402
from tplab.comm import world  # noqa: E402
from tplab.models import GPT, GPTConfig  # noqa: E402
from tplab.models.parallel import ParallelBlock  # noqa: E402
from tplab.overlap.async_tp import AsyncTPBlock, my_rows  # noqa: E402
from tplab.comm.shard_exchange import MessageExchange, NullExchange  # noqa: E402

P, R = COMM.size, COMM.rank
C = world(timeout=10)
EXCHANGE = MessageExchange(C)


def block(seed=0, **config):
    torch.manual_seed(seed)
    settings = dict(vocab_size=8, n_layer=1, n_head=2 * P, n_embd=8 * P, block_size=64) | config
    return ParallelBlock(GPT(GPTConfig(**settings)).double().blocks[0], C)


def whole_input(s, b=2, h=None, seed=7):
    return torch.randn(b, s, h or 8 * P, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def close(got, want, what):
    agree(got.shape == want.shape and torch.allclose(got, want, rtol=1e-12, atol=1e-12),
          f"{what}: {tuple(got.shape)} vs {tuple(want.shape)}, differs by "
          f"{(got - want).abs().max() if got.shape == want.shape else 'shape'}")


CONFIGS = {"gpt": {}, "gqa-rotary": {"n_kv_head": 1, "position": "rope"}, "swiglu": {"mlp": "swiglu", "bias": False},
           "llama-like": {"n_kv_head": max(1, P // 2), "position": "rope", "mlp": "swiglu", "norm": "rmsnorm",
                          "bias": False},
           "split-gqa": {"n_head": 4 * P, "n_kv_head": 2 * P, "n_embd": 16 * P, "position": "rope"}}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seq_per_rank, batch", [(1, 2), (3, 2), (2, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_block_on_shards_equals_the_plain_block(name, seq_per_rank, batch, causal):
    plain = block(**CONFIGS[name])
    plain.attention.causal = causal
    x = whole_input(P * seq_per_rank, b=batch, h=plain.attention.q_proj.in_features)
    with torch.no_grad():
        want = my_rows(plain(x), R, P)
        for attention in ("by_query_rows", "whole"):
            got = AsyncTPBlock(plain, EXCHANGE, attention=attention)(my_rows(x, R, P))
            close(got, want, f"{name}, causal={causal}, {seq_per_rank} positions per rank, batch {batch}, {attention}")


def test_a_stack_of_blocks_and_repeated_calls():
    blocks = [block(seed) for seed in range(3)]
    fast = torch.nn.Sequential(*[AsyncTPBlock(b, EXCHANGE) for b in blocks])
    for seed in range(3):   # (the exchanges' tags and buffers are reused call after call)
        x = whole_input(2 * P, seed=seed)
        with torch.no_grad():
            want = x
            for b in blocks:
                want = b(want)
            close(fast(my_rows(x, R, P)), my_rows(want, R, P), f"stack of 3, call {seed}")


def test_under_inference_mode_with_weights_changed_in_place():
    """torch.inference_mode: no version counters (a block built under it, its weights changed in place); the
    block still follows its weights call after call."""
    with torch.inference_mode():
        plain = block(3)
        fast = AsyncTPBlock(plain, EXCHANGE)
        x = whole_input(2 * P)
        for step in range(2):
            close(fast(my_rows(x, R, P)), my_rows(plain(x), R, P), f"inference_mode, step {step}")
            plain.attention.k_proj.weight.mul_(0.5)


def test_exchange_gathers_every_shard_and_scatters_sums():
    mine = torch.full((2, 3), float(R), dtype=torch.float64)
    gathered = EXCHANGE.start_gather(mine)
    agree(gathered.order == [(R + i) % P for i in range(P)], f"order {gathered.order}")
    agree(all(torch.equal(gathered.shard(q), torch.full((2, 3), float(q), dtype=torch.float64)) for q in range(P)),
          "gathered shards")
    gathered.done()
    scatter = EXCHANGE.start_scatter(mine)
    for q in gathered.order[1:]:
        scatter.out_for(q).fill_(10 * R + q)
        scatter.send(q)
    scatter.out_for(R).fill_(10 * R + R)
    want = sum(10 * q + R for q in range(P))
    agree(torch.equal(scatter.finish(), torch.full((2, 3), float(want), dtype=torch.float64)), "scattered sums")


def test_what_it_does_not_take_is_a_clear_error_on_every_rank():
    fast = AsyncTPBlock(block(), EXCHANGE)
    x = my_rows(whole_input(P), R, P)
    with pytest.raises(CollectiveArgumentError, match="forward only"):
        fast(x)                                        # (autograd on: the weights require gradients)
    with torch.no_grad():
        with pytest.raises(CollectiveArgumentError, match=r"\(s/p, b, h\)"):
            fast(x[0])
        with pytest.raises(CollectiveArgumentError, match="KV cache"):
            fast(x, {})
        # one rank alone passes what the block does not take: every rank raises, none waits for a shard
        with pytest.raises(CollectiveArgumentError, match=f"rank {P - 1}: .*no KV cache or mask"):
            fast(x, mask=torch.ones(1, dtype=torch.bool) if R == P - 1 else None)
        close(fast(x), my_rows(block()(whole_input(P)), R, P), "the block after the refusals")
    with pytest.raises(ValueError, match="equal shards"):
        my_rows(whole_input(3), 0, 2)
    with pytest.raises(CollectiveArgumentError, match=f"rank {P - 1}: host tensors only"):  # (every rank)
        EXCHANGE.start_gather(torch.zeros(2, device="meta" if R == P - 1 else "cpu"))
    if P > 1:
        with pytest.raises(CollectiveArgumentError, match="shards differ"):
            EXCHANGE.start_scatter(torch.zeros(2 + (R == 0)))
        with pytest.raises(CollectiveArgumentError, match="different calls"):   # (a gather meets a scatter)
            (EXCHANGE.start_gather if R == 0 else EXCHANGE.start_scatter)(torch.zeros(2))
    with pytest.raises(ValueError, match="split"):
        AsyncTPBlock(block(), type("Exchange", (), {"size": P + 1, "rank": R})())
    with pytest.raises(ValueError, match="attention must be"):
        AsyncTPBlock(block(), EXCHANGE, attention="by_heads")


def test_an_error_mid_block_leaves_the_exchange_usable():
    plain = block()
    fast = AsyncTPBlock(plain, EXCHANGE)
    x = my_rows(whole_input(2 * P), R, P)
    weight = plain.mlp.up.weight
    with torch.no_grad():
        plain.mlp.up.weight = torch.nn.Parameter(weight[:, :-1].clone())   # a shape the MLP's GEMM refuses
        with pytest.raises(RuntimeError):
            fast(x)                                    # (after the attention's scatter, inside the MLP's)
        plain.mlp.up.weight = weight
        close(fast(x), my_rows(plain(whole_input(2 * P)), R, P), "the block after an error mid-block")


@pytest.mark.skipif(P == 1, reason="a scatter of one rank sends nothing")
def test_a_scatter_sends_each_peer_exactly_once():
    mine = torch.zeros(2, 3, dtype=torch.float64)
    scatter = EXCHANGE.start_scatter(mine)
    peer = (R + 1) % P
    with pytest.raises(RuntimeError, match="before out_for"):
        scatter.send(peer)
    with pytest.raises(ValueError, match="a peer's rank"):
        scatter.send(R)
    for q in range(P):
        scatter.out_for(q).fill_(1)
        if q != R:
            scatter.send(q)
    with pytest.raises(RuntimeError, match="twice"):
        scatter.send(peer)
    close(scatter.finish(), torch.full_like(mine, P), "the sum after the refused sends")
    scatter = EXCHANGE.start_scatter(mine)
    scatter.out_for(peer)
    with pytest.raises(RuntimeError, match="nothing sent to rank"):
        scatter.finish()        # (refused before it waits: the scatter can still be completed)
    for q in range(P):
        scatter.out_for(q).fill_(2)
        if q != R:
            scatter.send(q)
    close(scatter.finish(), torch.full_like(mine, 2 * P), "the sum once every peer was sent to")


def test_null_exchange_runs_the_block_without_moving_anything():
    fast = AsyncTPBlock(block(), NullExchange(R, P))
    x = my_rows(whole_input(2 * P), R, P)
    with torch.no_grad():
        y = fast(x)
    agree(y.shape == x.shape and torch.isfinite(y).all().item(), "the null exchange's block runs")


def test_notebook_check_of_a_stack_reports_rounding_only():
    from tplab.overlap.experiments import check_async_tp

    row = check_async_tp(layers=2, hidden=8 * P, heads=2 * P, seq=3 * P, batch=2)
    agree(row["max |y - y_plain|"] < 1e-12 and row["rows per rank"] == (3, 2, 8 * P), f"{row}")
