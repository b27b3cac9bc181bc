"""The all-gather of K and V fused into the Q/K/V projection (tplab.sequence.FusedKV on
tplab.gpu_collectives.matmul_allgather): every rank's K and V land in every rank's buffer, equal to the projection
done by torch (cuBLAS) and gathered; the layer equals the unsplit one; bad input is the same error on every rank.
Needs Triton with tensor descriptors and a Hopper GPU (TMA): skipped otherwise."""

import importlib.util

from gputest import require_gpu

require_gpu()

import cupy  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from mpitest import COMM, agree  # noqa: E402

if importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.tools.tensor_descriptor") is None:
    pytest.skip("needs Triton with tensor descriptors", allow_module_level=True)
torch.cuda.set_device(cupy.cuda.Device().id)
if torch.cuda.get_device_capability()[0] < 9:
    pytest.skip("needs TMA (Hopper or newer)", allow_module_level=True)

from tplab.comm import nccl_world  # noqa: E402
from tplab.gpu_collectives.matmul_allgather import MatmulAllGather  # noqa: E402
from tplab.sequence import LAYOUTS, SequenceParallelBlock, shard, unsplit_layer  # noqa: E402
from tplab.sequence.fused_kv import FusedKV  # noqa: E402
from tplab.sequence.scaling import make_block, make_input  # noqa: E402

P, RANK = COMM.size, COMM.rank
NCCL = nccl_world()


def relative_error(got, want) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("local, n, k, m", [(256, 768, 256, 128), (128, 320, 200, 64), (64, 200, 64, 192)],
                         ids=["qkv", "odd-k", "gqa-like"])
def test_every_rank_gets_every_ranks_rows_of_the_product(local, n, k, m, dtype):
    generator = torch.Generator(device="cuda").manual_seed(0)           # the same weights on every rank
    weight = (torch.randn(n, k, device="cuda", generator=generator) / k ** 0.5).to(dtype)
    bias = torch.randn(n, device="cuda", generator=generator).to(dtype)
    xs = [torch.randn(2 * m, k, device="cuda", generator=generator).to(dtype) for _ in range(P)]  # every rank's
    fused = MatmulAllGather(COMM, weight, bias, local=local, batch=2, m=m)
    with torch.no_grad():
        for call in range(3):                                       # again: the two buffers alternate
            x = xs[RANK] * (call + 1)
            out, gathered = fused(x)
            want = [torch.nn.functional.linear(xq * (call + 1), weight, bias) for xq in xs]   # (2m, n) each
            want_gathered = torch.cat([w[:, local:].view(2, m, n - local) for w in want], dim=1)
            agree(relative_error(out, want[RANK][:, :local]) < 1e-2, f"local part {relative_error(out, want[RANK][:, :local]):.1e}")
            agree(relative_error(gathered, want_gathered) < 1e-2,
                  f"call {call}: gathered {relative_error(gathered, want_gathered):.1e}")
    fused.close()


def test_a_rank_that_reads_late_still_reads_its_own_call():
    """No barrier before the GEMM: the peers' next call writes into the other buffer, and the call after waits
    for this rank's barrier. Rank 0 holds its stream ~30 ms before reading each call's gathered rows, while the
    others run ahead; what it reads must still be that call's, never the next one's."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    local, n, k, m = 256, 768, 256, 128
    weight = (torch.randn(n, k, device="cuda", generator=generator) / k ** 0.5).to(torch.bfloat16)
    xs = [torch.randn(2 * m, k, device="cuda", generator=generator).to(torch.bfloat16) for _ in range(P)]
    fused = MatmulAllGather(COMM, weight, None, local=local, batch=2, m=m)
    read = []
    with torch.no_grad():
        for call in range(4):
            _, gathered = fused(xs[RANK] * (call + 1))
            if RANK == 0:
                torch.cuda._sleep(50_000_000)                   # (GPU cycles, on the calls' stream)
            read.append(gathered.clone())                       # the read, before the next call
        for call, got in enumerate(read):
            want = torch.cat([torch.nn.functional.linear(xq * (call + 1), weight)[:, local:].view(2, m, n - local)
                              for xq in xs], dim=1)
            agree(relative_error(got, want) < 1e-2, f"call {call}: {relative_error(got, want):.1e}")
    fused.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_fused_layer_equals_the_unsplit_layer(causal, layout):
    block = make_block(256, 4, dtype=torch.bfloat16, seed=0).cuda()    # made on the CPU: the same everywhere
    x = make_input(2, 128 * P, 256, dtype=torch.bfloat16, seed=1).cuda()
    tokens = x.shape[1] // P
    fused = FusedKV(block.attention, COMM, batch=2, tokens_per_rank=tokens)
    layer = SequenceParallelBlock(block, NCCL, scheme="allgather_kv", layout=layout, causal=causal, fused_kv=fused)
    plain = SequenceParallelBlock(block, NCCL, scheme="allgather_kv", layout=layout, causal=causal)
    with torch.no_grad():
        expected = shard(unsplit_layer(block, causal=causal)(x), RANK, P, layout)
        for _ in range(3):
            y = layer(shard(x, RANK, P, layout))
        y_plain = plain(shard(x, RANK, P, layout))
    agree(relative_error(y, expected) < 3e-2, f"fused {relative_error(y, expected):.2e}")
    agree(relative_error(y, y_plain) < 3e-2, f"fused vs all-gather {relative_error(y, y_plain):.2e}")
    fused.close()


def test_bad_input_is_the_same_error_on_every_rank():
    block = make_block(256, 4, dtype=torch.bfloat16, seed=0).cuda()
    fused = FusedKV(block.attention, COMM, batch=2, tokens_per_rank=64)
    x = torch.zeros(2, 64 if RANK != P - 1 else 32, 256, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad(), pytest.raises(ValueError, match=f"rank {P - 1}: x must be"):
        fused(x)
    with torch.no_grad():                                          # (a refused call leaves it usable)
        q, k_all, v_all = fused(torch.zeros(2, 64, 256, dtype=torch.bfloat16, device="cuda"))
    agree(tuple(k_all.shape) == (2, 4, 64 * P, 64), f"{tuple(k_all.shape)}")
    with pytest.raises(ValueError, match="no other way to gather"):   # one way to gather K and V at a time
        SequenceParallelBlock(block, NCCL, scheme="allgather_kv", fused_kv=fused, head_groups=2)
    with pytest.raises(ValueError, match=f"rank {P - 1}: the fused K/V gather is forward only"):
        fused(torch.zeros(2, 64, 256, dtype=torch.bfloat16, device="cuda", requires_grad=RANK == P - 1))
    fused.close()
    with pytest.raises(ValueError, match="multiple of 64"):
        MatmulAllGather(COMM, torch.zeros(96, 64, dtype=torch.bfloat16, device="cuda"), None, local=32, batch=1, m=64)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        MatmulAllGather(COMM, torch.zeros(192, 64, device="cuda"), None, local=64, batch=1, m=64)


def test_without_the_check_a_bad_input_fails_on_its_own_rank_and_nobody_waits():
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = (torch.randn(192, 64, device="cuda", generator=generator) / 8).to(torch.bfloat16)
    xs = [torch.randn(64, 64, device="cuda", generator=generator).to(torch.bfloat16) for _ in range(P)]
    fused = MatmulAllGather(COMM, weight, None, local=64, batch=1, m=64)
    with torch.no_grad():
        if RANK == P - 1:   # the wrong dtype, and no exchange to tell the others
            with pytest.raises(ValueError, match=f"on rank {P - 1}: x must be"):
                fused(xs[RANK].float(), check=False)
        else:
            fused(xs[RANK], check=False)
        torch.cuda.synchronize()   # (a rank left waiting would hang here: the watchdog fails the test)
        out, gathered = fused(xs[RANK], check=False)   # the barriers still pair up: the next call is whole
        want = torch.cat([torch.nn.functional.linear(x, weight)[:, 64:] for x in xs]).view(1, 64 * P, 128)
        agree(relative_error(gathered, want) < 1e-2, f"after a refused call: {relative_error(gathered, want):.1e}")
    fused.close()
