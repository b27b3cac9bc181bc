"""Sequence parallelism's overlapped paths on GPUs. attend_with_lse's fused kernels (in bf16 cuDNN's, or
FlashAttention's for a causal rectangle; the memory-efficient kernel in float32) against the exact computation,
causal masks aligned to the lower right; ring attention (its transfers on a side stream) and the all-gather of K/V
in head groups (its gathers on a side stream), over tplab.comm.nccl, streamed K/V and the head groups' gathers
through the copy engines (CopyEngineExchange), against the unsplit layer on one GPU."""

import warnings
from functools import partial

from gputest import require_gpu

require_gpu()

import cupy  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from mpitest import COMM, agree  # noqa: E402

from tplab.comm import nccl_world  # noqa: E402
from tplab.gpu_collectives.copy_engine_exchange import CopyEngineExchange  # noqa: E402
from tplab.layers.attend import attend_with_lse  # noqa: E402
from tplab.sequence import (  # noqa: E402
    LAYOUTS,
    SequenceParallelBlock,
    exchange_allgather_first_dim,
    shard,
    unsplit_layer,
)
from tplab.sequence.scaling import make_block, make_input  # noqa: E402

P, RANK = COMM.size, COMM.rank
NCCL = nccl_world()
torch.cuda.set_device(cupy.cuda.Device().id)  # the GPU NCCL's communicator chose for this rank
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}  # relative to the largest output
# (collective: made once, used by every test here; every call of an exchange on one stream -- the compute
# stream for streamed K/V and a gather of one head group, the side stream for head groups)
EXCHANGE, SIDE_EXCHANGE = CopyEngineExchange(COMM, 1 << 20), CopyEngineExchange(COMM, 1 << 20)


def relative_error(got, want) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("s_q, s_k", [(128, 128), (64, 192)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_fused_kernels_give_attention_and_its_log_sum_exp(causal, s_q, s_k, dtype):
    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 4, s_q, 64, device="cuda", generator=generator).to(dtype)
    k, v = (torch.randn(2, 2, s_k, 64, device="cuda", generator=generator).to(dtype) for _ in range(2))  # GQA
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # falling back to the exact path warns: here that is a failure
        out, lse = attend_with_lse(q, k, v, causal=causal)
    want_out, want_lse = attend_with_lse(q.double(), k.double(), v.double(), causal=causal)  # exact, float64
    agree(out.dtype == dtype and lse.dtype == torch.float32 and tuple(lse.shape) == (2, 4, s_q),
          f"{out.dtype} {lse.dtype} {tuple(lse.shape)}")
    agree(relative_error(out, want_out) < TOLERANCE[dtype], f"out: {relative_error(out, want_out):.2e}")
    agree(float((lse.double() - want_lse).abs().max()) < 1e-3, f"lse: {(lse.double() - want_lse).abs().max():.2e}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_head_groups_and_streamed_kv_equal_the_unsplit_layer(causal, layout, dtype):
    block = make_block(64, 8, dtype=dtype, seed=0).cuda()  # made on the CPU: the same weights on every rank
    x = make_input(2, 32 * P, 64, dtype=dtype, seed=1).cuda()  # (b, s, h)
    with torch.no_grad():
        expected = shard(unsplit_layer(block, causal=causal)(x), RANK, P, layout)
        for scheme, options in [("ring", {}), ("allgather_kv", {"head_groups": 4}),
                                ("allgather_kv", {"head_groups": 8, "algorithm": "builtin"}),
                                ("streamed_kv", {"exchange": EXCHANGE}),
                                ("allgather_kv", {"gather": partial(exchange_allgather_first_dim, exchange=EXCHANGE)}),
                                ("allgather_kv", {"head_groups": 4,
                                                  "gather": partial(exchange_allgather_first_dim,
                                                                    exchange=SIDE_EXCHANGE)}),
                                ("allgather_kv", {"side_stream": True,   # (one group, under the Q projection)
                                                  "gather": partial(exchange_allgather_first_dim,
                                                                    exchange=SIDE_EXCHANGE)}),
                                ("allgather_kv", {"side_stream": True})]:
            layer = SequenceParallelBlock(block, NCCL, scheme=scheme, layout=layout, causal=causal, **options)
            for _ in range(3):  # again and again: memory freed on one stream and reused on the other
                y = layer(shard(x, RANK, P, layout))
            error = relative_error(y, expected)
            agree(error < TOLERANCE[dtype], f"{scheme} {options}: {error:.2e}")


@pytest.mark.parametrize("destination", [False, True], ids=["own", "into"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_merge_kernel_equals_the_eager_merge(dtype, destination, monkeypatch):
    """The online softmax's merge as one Triton kernel (the GPU default) and as eager passes, the last merge
    told it is final (it then writes the queries' dtype), on strided views as the attention kernels return them;
    ``into``: the result goes to a given view laid out (b, s, n, d), as the schemes hand it, and nowhere else."""
    from tplab.sequence.online_softmax import OnlineSoftmax

    generator = torch.Generator(device="cuda").manual_seed(RANK)
    q = torch.randn(2, 96, 4, 64, device="cuda", generator=generator).to(dtype).transpose(1, 2)  # (b, n, sq, d) view
    blocks = [tuple(torch.randn(2, 2, 64, 64, device="cuda", generator=generator).to(dtype) for _ in range(2))
              for _ in range(3)]
    results = {}
    for kernel in (True, False):
        monkeypatch.setattr(OnlineSoftmax, "merge_kernel", kernel)
        out = None   # (into: a (b, s, n, d) tensor seen as (b, n, s, d), NaN where nothing wrote)
        if destination:
            out = torch.full((2, 96, 4, 64), float("nan"), device="cuda", dtype=dtype).transpose(1, 2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a kernel failure (the eager fallback warns) fails here
            acc = OnlineSoftmax(q, out=out)
            for i, (k, v) in enumerate(blocks):
                acc.update(q, k, v, final=i == len(blocks) - 1)
        result = acc.result()
        agree(not destination or (result is out and result.stride() == out.stride()), "the result is not in out")
        results[kernel] = (result, acc.lse)
        agree(OnlineSoftmax.merge_kernel == kernel, "the merge kernel fell back to the eager passes")
    (out_k, lse_k), (out_e, lse_e) = results[True], results[False]
    agree(out_k.dtype == dtype and out_k.shape == q.shape, f"{out_k.dtype} {tuple(out_k.shape)}")
    rounding = 1e-2 if dtype == torch.bfloat16 else 1e-5   # (bf16: the last merge rounds once, as the cast did)
    agree(float((out_k.float() - out_e.float()).abs().max()) < rounding and float((lse_k - lse_e).abs().max()) < 1e-5,
          f"out {float((out_k.float() - out_e.float()).abs().max()):.2e}, lse {float((lse_k - lse_e).abs().max()):.2e}")


def test_the_copy_engine_gather_refuses_a_bad_out_on_every_rank():
    from tplab.comm.base import CollectiveArgumentError

    exchange = CopyEngineExchange(COMM, 1 << 16)
    shard = torch.full((3, 2), float(RANK), device="cuda")
    bad = torch.empty((P, 3, 2), device="cuda", dtype=torch.float16 if RANK == P - 1 else torch.float32)
    with pytest.raises(CollectiveArgumentError, match=f"rank {P - 1}: out must be"):
        exchange.start_gather(shard, out=bad)
    good = torch.empty((P, 3, 2), device="cuda")
    exchange.start_gather(shard, out=good).done()  # (a refused call leaves the exchange usable)
    agree(all(bool((good[q] == q).all()) for q in range(P)), f"gathered {good[:, 0, 0].tolist()}")
    agree(exchange.scatter_memory is None, "an exchange that only gathered made its scatter area")
    exchange.close()
