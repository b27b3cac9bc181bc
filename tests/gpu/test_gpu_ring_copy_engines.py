"""Ring attention's steps through the copy engines (CopyEngineExchange.start_pass): each pass hands every rank
its left neighbour's block; the ring equals the unsplit layer, call after call, also when one rank computes
late or the blocks change size, and replayed from CUDA graphs between eager rings; a ring's first pass in a
capture, or a pass that forwards a block across a capture's edge, is refused on every rank."""

from gputest import require_gpu

require_gpu()

import cupy  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from mpitest import COMM, agree  # noqa: E402

from tplab.comm import nccl_world  # noqa: E402
from tplab.comm.base import CollectiveArgumentError  # noqa: E402
from tplab.gpu_collectives.copy_engine_exchange import CopyEngineExchange  # noqa: E402
from tplab.sequence import LAYOUTS, SequenceParallelBlock, shard, unsplit_layer  # noqa: E402
from tplab.sequence.scaling import make_block, make_input  # noqa: E402

P, RANK = COMM.size, COMM.rank
NCCL = nccl_world()
torch.cuda.set_device(cupy.cuda.Device().id)
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-4}  # relative to the largest output


def relative_error(got, want) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def test_each_pass_brings_the_left_neighbours_block():
    exchange = CopyEngineExchange(COMM, 1 << 16)
    for shape, dtype in [((5, 3), torch.float32), ((2, 7, 3), torch.bfloat16), ((1,), torch.int32)]:
        block = torch.full(shape, RANK, device="cuda").to(dtype)
        held = []
        for _ in range(2 * P + 1):          # around the ring twice, and on: the three slots take turns
            block = exchange.start_pass(block).wait()
            held.append(int(block.flatten()[0]))
        want = [(RANK - i) % P for i in range(1, 2 * P + 2)]
        agree(held == want and tuple(block.shape) == shape and block.dtype == dtype,
              f"{dtype}: held {held}, want {want}; {tuple(block.shape)} {block.dtype}")
    exchange.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_ring_over_copy_engines_equals_the_unsplit_layer(causal, layout, dtype):
    exchange = CopyEngineExchange(COMM, 1 << 20)
    block = make_block(64, 8, dtype=dtype, seed=0).cuda()     # made on the CPU: the same weights on every rank
    layer = SequenceParallelBlock(block, NCCL, scheme="ring", layout=layout, causal=causal, exchange=exchange)
    with torch.no_grad():
        for call, tokens in enumerate([32 * P, 32 * P, 16 * P, 32 * P]):   # again, and a smaller block between
            x = make_input(2, tokens, 64, dtype=dtype, seed=call).cuda()  # (b, s, h)
            expected = shard(unsplit_layer(block, causal=causal)(x), RANK, P, layout)
            y = layer(shard(x, RANK, P, layout))
            error = relative_error(y, expected)
            agree(error < TOLERANCE[dtype], f"call {call} ({tokens} tokens): {error:.2e}")
    exchange.close()


def test_a_rank_that_computes_late_still_folds_the_right_blocks(monkeypatch):
    """Rank 0 holds its compute stream ~20 ms before every block's attention, while its neighbours pass on:
    the slots it reads must not be rewritten under it, and the block it forwards must be the one it holds."""
    from tplab.sequence import ring

    fold = ring.fold_block

    def late_fold(*args, **kwargs):
        if RANK == 0:
            torch.cuda._sleep(20_000_000)   # (GPU clock cycles: about 10-20 ms)
        return fold(*args, **kwargs)

    monkeypatch.setattr(ring, "fold_block", late_fold)
    exchange = CopyEngineExchange(COMM, 1 << 20)
    block = make_block(64, 8, dtype=torch.float32, seed=0).cuda()
    layer = SequenceParallelBlock(block, NCCL, scheme="ring", causal=False, exchange=exchange)
    with torch.no_grad():
        for call in range(3):
            x = make_input(2, 32 * P, 64, dtype=torch.float32, seed=10 + call).cuda()
            expected = shard(unsplit_layer(block, causal=False)(x), RANK, P, "contiguous")
            error = relative_error(layer(shard(x, RANK, P, "contiguous")), expected)
            agree(error < TOLERANCE[torch.float32], f"call {call}: {error:.2e}")
    exchange.close()


def test_a_first_pass_or_a_pass_across_a_captures_edge_is_refused_on_every_rank():
    exchange = CopyEngineExchange(COMM, 1 << 16)
    block = torch.full((4,), float(RANK), device="cuda")
    with pytest.raises(CollectiveArgumentError, match="first ring pass must run eagerly"):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
            exchange.start_pass(block)
    got = exchange.start_pass(block).wait()                 # eagerly: fine (nothing was queued)
    agree(float(got[0]) == (RANK - 1) % P, f"after the refused capture: {float(got[0])}")
    torch.cuda.synchronize()
    # a pass that forwards the block the last one returned (it skips the host agreement) across the edge
    with pytest.raises(CollectiveArgumentError, match="wholly inside one CUDA graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
            exchange.start_pass(got)
    got = exchange.start_pass(got).wait()
    agree(float(got[0]) == (RANK - 2) % P, f"after the refused forwarded capture: {float(got[0])}")
    torch.cuda.synchronize()
    # from one capture into another: refused alike (captures told apart by the driver's capture id)
    first = torch.cuda.CUDAGraph()
    with torch.cuda.graph(first):
        captured = exchange.start_pass(block).wait()
    with pytest.raises(CollectiveArgumentError, match="wholly inside one CUDA graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
            exchange.start_pass(captured)
    # a capture that fails with its pass still open: the next pass drops it (it never ran), on every rank
    with pytest.raises(RuntimeError):   # (the layer's error, or the capture's end finding the ring's stream unjoined)
        with torch.cuda.graph(torch.cuda.CUDAGraph(), capture_error_mode="thread_local"):
            exchange.start_pass(block)
            raise RuntimeError("the layer failed mid-capture")
    torch.cuda.synchronize()
    first.replay()
    agree(float(captured[0]) == (RANK - 1) % P, f"the first graph replayed: {float(captured[0])}")
    got = exchange.start_pass(block).wait()
    agree(float(got[0]) == (RANK - 1) % P, f"after the failed capture: {float(got[0])}")
    torch.cuda.synchronize()
    exchange.close()


@pytest.mark.parametrize("late", [False, True], ids=["in_step", "rank0_late"])
def test_a_captured_ring_replays_exactly_between_eager_rings(monkeypatch, late):
    """The layer's ring captured in CUDA graphs (one call, and two in a row), replayed with new inputs and with
    eager calls between the replays: every result equals the unsplit layer. ``rank0_late``: rank 0 holds its
    stream ~20 ms before every block's attention, in the graphs too, so a slot rewritten too soon would show."""
    from tplab.sequence import ring

    if late:
        fold = ring.fold_block

        def late_fold(*args, **kwargs):
            if RANK == 0:
                torch.cuda._sleep(20_000_000)
            return fold(*args, **kwargs)

        monkeypatch.setattr(ring, "fold_block", late_fold)
    exchange = CopyEngineExchange(COMM, 1 << 20)
    block = make_block(64, 8, dtype=torch.float32, seed=0).cuda()
    layer = SequenceParallelBlock(block, NCCL, scheme="ring", layout="zigzag", causal=True, exchange=exchange)
    whole = unsplit_layer(block, causal=True)

    def inputs(seed):
        x = make_input(2, 32 * P, 64, dtype=torch.float32, seed=seed).cuda()
        return shard(x, RANK, P, "zigzag"), shard(whole(x), RANK, P, "zigzag")

    with torch.no_grad():
        x, _ = inputs(0)
        layer(x)                                            # (eagerly first: the ring's area, compilation)
        static = x.clone()
        one, two = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(one):
            y_one = layer(static)
        with torch.cuda.graph(two):
            y_first = layer(static)
            y_second = layer(static)
        for call in range(3):
            x, want = inputs(20 + call)
            static.copy_(x)
            one.replay()
            error = relative_error(y_one, want)
            agree(error < TOLERANCE[torch.float32], f"replay {call}: {error:.2e}")
            two.replay()
            for y in (y_first, y_second):
                agree(relative_error(y, want) < TOLERANCE[torch.float32], f"two in a graph, replay {call}")
            x, want = inputs(40 + call)                     # an eager ring between the replays
            error = relative_error(layer(x), want)
            agree(error < TOLERANCE[torch.float32], f"eager call after replay {call}: {error:.2e}")
    torch.cuda.synchronize()
    exchange.close()
