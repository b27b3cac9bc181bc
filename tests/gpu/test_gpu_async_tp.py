"""Async tensor parallelism on GPUs (tplab.overlap.async_tp through the copy engines,
tplab.gpu_collectives.copy_engine_exchange): the block on sequence shards equals the plain block's rows
(float64 ~1e-12; bf16 to its rounding), call after call (the exchange's halves alternate), in a stack;
the exchange alone gathers every shard and sums every scatter; bad input is an error on every rank."""

from gputest import require_gpu

require_gpu()

import pytest  # noqa: E402
import torch  # noqa: E402
from asynctp import BATCH, DEVICE, HIDDEN, P, R, SEQ, SHARD_BYTES, block, whole_input  # noqa: E402
from mpitest import COMM, agree  # noqa: E402

from tplab.collectives import CollectiveArgumentError  # noqa: E402
from tplab.gpu_collectives.copy_engine_exchange import CopyEngineExchange  # noqa: E402
from tplab.overlap.async_tp import AsyncTPBlock, my_rows  # noqa: E402

EXCHANGES = {"copy engines push": CopyEngineExchange(COMM, SHARD_BYTES),
             "every peer at once": CopyEngineExchange(COMM, SHARD_BYTES, peers_at_once=max(P - 1, 1)),
             "GEMMs write into the peers": CopyEngineExchange(COMM, SHARD_BYTES, pushes="gemm")}
EXCHANGE = EXCHANGES["copy engines push"]


@pytest.mark.parametrize("config", [{}, {"n_kv_head": 1, "position": "rope", "mlp": "swiglu", "norm": "rmsnorm",
                                         "bias": False}], ids=["gpt", "llama-like"])
@pytest.mark.parametrize("pushes", list(EXCHANGES))
@pytest.mark.parametrize("attention", ["by_query_rows", "whole"])
def test_block_on_shards_equals_the_plain_block_call_after_call(config, pushes, attention):
    plain = block(**config)
    fast = AsyncTPBlock(plain, EXCHANGES[pushes], attention=attention)
    with torch.no_grad():
        for seed in range(5):   # odd and even calls: both halves of every area, reused
            x = whole_input(seed)
            want, got = my_rows(plain(x), R, P), fast(my_rows(x, R, P))
            torch.cuda.synchronize()
            agree(torch.allclose(got, want, rtol=1e-12, atol=1e-12),
                  f"{config}, {pushes}, call {seed}: differs by {(got - want).abs().max():.2e}")


def test_a_stack_and_bfloat16():
    blocks = [block(seed) for seed in range(3)]
    fast = torch.nn.Sequential(*[AsyncTPBlock(b, EXCHANGE) for b in blocks])
    with torch.no_grad():
        x = whole_input(9)
        want = x
        for b in blocks:
            want = b(want)
        got = fast(my_rows(x, R, P))
        agree(torch.allclose(got, my_rows(want, R, P), rtol=1e-12, atol=1e-12), "stack of 3")
        low = block(3, dtype=torch.bfloat16)
        x = whole_input(10, torch.bfloat16)
        want = my_rows(low(x), R, P).float()
        errors = {}
        for attention in ("by_query_rows", "whole"):
            got = AsyncTPBlock(low, EXCHANGE, attention=attention)(my_rows(x, R, P)).float()
            errors[attention] = ((got - want).abs().max() / want.abs().max()).item()
    agree(max(errors.values()) < 3e-2, f"bf16: relative errors {errors}")


@pytest.mark.parametrize("pushes", list(EXCHANGES))
def test_the_exchange_gathers_every_shard_and_sums_every_scatter(pushes):
    check_exchange(EXCHANGES[pushes])


def check_exchange(exchange):
    mine = torch.full((5, 7), float(R), dtype=torch.float64, device=DEVICE)
    for _ in range(3):
        gathered = exchange.start_gather(mine)
        shards = [gathered.shard(q).clone() for q in range(P)]
        gathered.done()
        scatter = exchange.start_scatter(mine)
        for q in gathered.order[1:]:
            scatter.out_for(q).fill_(10 * R + q)
            scatter.send(q)
        scatter.out_for(R).fill_(10 * R + R)
        total = scatter.finish()
        torch.cuda.synchronize()
        agree(all(torch.equal(s, torch.full_like(s, q)) for q, s in enumerate(shards)), "gathered shards")
        agree(torch.equal(total, torch.full_like(total, sum(10 * q + R for q in range(P)))), "scattered sums")


def test_bad_input_is_an_error_on_every_rank():
    too_big = torch.zeros(SEQ * BATCH * HIDDEN * 2 if R == 0 else 4, dtype=torch.float64, device=DEVICE)
    with pytest.raises(CollectiveArgumentError, match="rank 0: a shard of .* does not fit"):
        EXCHANGE.start_gather(too_big)
    with pytest.raises(CollectiveArgumentError, match="rank 0: a tensor on GPU"):
        EXCHANGE.start_scatter(torch.zeros(4) if R == 0 else torch.zeros(4, device=DEVICE))
    if P > 1:
        with pytest.raises(CollectiveArgumentError, match="shards differ"):
            EXCHANGE.start_gather(torch.zeros(4 + R, device=DEVICE))
    with torch.no_grad():   # one rank alone passes a mask: every rank raises, none waits for a shard
        x = my_rows(whole_input(0), R, P)
        with pytest.raises(CollectiveArgumentError, match=f"rank {P - 1}: .*no KV cache or mask"):
            AsyncTPBlock(block(), EXCHANGE)(x, mask=torch.ones(1, device=DEVICE) if R == P - 1 else None)
    # the exchange still works after the refusals (nothing was queued)
    check_exchange(EXCHANGE)


def test_an_error_mid_block_breaks_the_exchange_on_every_rank_and_a_new_one_works():
    exchange = CopyEngineExchange(COMM, SHARD_BYTES)
    plain = block()
    x = my_rows(whole_input(1), R, P)
    weight = plain.mlp.up.weight
    with torch.no_grad():
        plain.mlp.up.weight = torch.nn.Parameter(weight[:, :-1].clone())   # a shape the MLP's GEMM refuses
        with pytest.raises(RuntimeError):
            AsyncTPBlock(plain, exchange)(x)          # (inside the MLP: its gather and scatter are open)
        plain.mlp.up.weight = weight
        with pytest.raises(CollectiveArgumentError, match="make a new CopyEngineExchange"):
            AsyncTPBlock(plain, exchange)(x)
        fresh = CopyEngineExchange(COMM, SHARD_BYTES)
        got, want = AsyncTPBlock(plain, fresh)(x), my_rows(plain(whole_input(1)), R, P)
        torch.cuda.synchronize()
    agree(torch.allclose(got, want, rtol=1e-12, atol=1e-12), f"a new exchange: differs by {(got - want).abs().max():.2e}")
    exchange.close()
    fresh.close()
