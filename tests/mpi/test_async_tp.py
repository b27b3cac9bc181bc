"""Async tensor parallelism (tplab.overlap.async_tp) on CPU ranks: the block on sequence shards, its
collectives cut into shards that move under the GEMMs, equals the plain tensor-parallel block's rows
(float64, ~1e-12): causal and not, grouped-query attention with rotary positions, SwiGLU, a stack; the
message exchange on its own; and clear errors for what it does not take."""

import pytest
from mpitest import COMM, agree

torch = pytest.importorskip("torch")

from tplab.collectives import CollectiveArgumentError  # noqa: E402
from tplab.comm import world  # noqa: E402
from tplab.models import GPT, GPTConfig  # noqa: E402
from tplab.models.parallel import ParallelBlock  # noqa: E402
from tplab.overlap.async_tp import AsyncTPBlock, my_rows  # noqa: E402
from tplab.overlap.shard_exchange import MessageExchange  # noqa: E402

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


@pytest.mark.parametrize("config", [{}, {"n_kv_head": 1, "position": "rope"}, {"mlp": "swiglu", "bias": False},
                                    {"n_kv_head": max(1, P // 2), "position": "rope", "mlp": "swiglu",
                                     "norm": "rmsnorm", "bias": False}],
                         ids=["gpt", "gqa-rotary", "swiglu", "llama-like"])
@pytest.mark.parametrize("seq_per_rank", [1, 3])
def test_block_on_shards_equals_the_plain_block(config, seq_per_rank):
    plain = block(**config)
    x = whole_input(P * seq_per_rank)
    with torch.no_grad():
        want = my_rows(plain(x), R, P)
        got = AsyncTPBlock(plain, EXCHANGE)(my_rows(x, R, P))
    close(got, want, f"{config}, {seq_per_rank} positions per rank")


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
    with pytest.raises(RuntimeError, match="forward only"):
        fast(x)                                        # (autograd on: the weights require gradients)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"\(s/p, b, h\)"):
            fast(x[0])
        with pytest.raises(NotImplementedError, match="KV cache"):
            fast(x, {})
    with pytest.raises(ValueError, match="equal shards"):
        my_rows(whole_input(3), 0, 2)
    with pytest.raises(CollectiveArgumentError, match=f"rank {P - 1}: host tensors only"):  # (every rank)
        EXCHANGE.start_gather(torch.zeros(2, device="meta" if R == P - 1 else "cpu"))
    with pytest.raises(CollectiveArgumentError, match="shards differ" if P > 1 else "never"):
        if P > 1:
            EXCHANGE.start_scatter(torch.zeros(2 + (R == 0)))
        else:
            raise CollectiveArgumentError("never")
    with pytest.raises(ValueError, match="split"):
        AsyncTPBlock(block(), type("Exchange", (), {"size": P + 1, "rank": R})())
