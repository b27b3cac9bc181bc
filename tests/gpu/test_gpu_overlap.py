"""Overlapped layers on GPU streams (tplab.overlap): a transformer block cut into chunks or micro-batches
(and a stack of blocks in micro-batches), its all-reduces on the side stream, equals the plain block
through the GPU communicators that scripts/gpu_overlap.py times -- torch.distributed's NCCL, the
peer-memory two-shot and the copy-engine all-reduce -- run eagerly and replayed from a CUDA graph
(tplab.overlap.metrics.captured: what gpu_overlap.py --graphs times). tplab's own NCCL communicator
(tplab.comm.nccl) is checked eagerly: its CuPy calls meet the legacy default stream, which a capture refuses."""

from gputest import require_gpu

require_gpu()

import cupy  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from mpitest import COMM, agree, same_on_every_rank  # noqa: E402

from tplab.comm import nccl_world  # noqa: E402
from tplab.gpu_collectives import PeerMemoryComm  # noqa: E402
from tplab.gpu_collectives.copy_engine import CopyEngineComm  # noqa: E402
from tplab.comm.torch_dist import TorchDistributedComm  # noqa: E402
from tplab.overlap import overlapped, with_comm  # noqa: E402
from tplab.overlap.experiments import make_block  # noqa: E402
from tplab.overlap.metrics import captured  # noqa: E402

P = COMM.size
NCCL = nccl_world()
torch.cuda.set_device(cupy.cuda.Device().id)  # the GPU NCCL's communicator chose for this rank
SHAPE = dict(hidden=16 * P, heads=2 * P, seq=24, batch=4)
BYTES = 4 * 24 * 16 * P * 8  # one all-reduce of the whole block's output, float64
PEERS = PeerMemoryComm(NCCL, BYTES)
PEERS.kernel = "two_shot"
COMMS = {"torch.distributed": TorchDistributedComm(torch.device("cuda", torch.cuda.current_device())),
         "peer": PEERS, "copy engine": CopyEngineComm(COMM, BYTES)}


def block_on_gpu(seed=0):
    block, x = make_block(dtype=torch.float64, comm=NCCL, seed=seed, **SHAPE)
    return block.cuda(), x.cuda()


@pytest.mark.parametrize("path", list(COMMS))
@pytest.mark.parametrize("split, chunks, tail, layers", [("batch", 4, 1, 1), ("batch", 2, 3, 1), ("sequence", 3, 2, 1),
                                                         ("batch", 2, 2, 3)])
def test_overlapped_block_equals_the_plain_one_eager_and_in_a_graph(path, split, chunks, tail, layers):
    blocks = [block_on_gpu(seed)[0] for seed in range(layers)]
    block, x = torch.nn.Sequential(*blocks), block_on_gpu()[1]
    with torch.no_grad(), with_comm(block, COMMS[path]):
        want = block(x)
        layer = overlapped(blocks if layers > 1 else blocks[0], chunks, split=split, tail=tail)
        eager = layer(x)
        replay = captured(lambda: layer(x))
        for _ in range(3):  # replays reuse the graph's buffers (and the peers' flags and halves)
            graphed = replay().clone()
        torch.cuda.synchronize()
    what = f"{path} {split} k={chunks} tail={tail} layers={layers}"
    for name, got in [("eager", eager), ("graph", graphed)]:
        agree(torch.allclose(got, want, rtol=1e-12, atol=1e-12), f"{what} {name}: differs by {(got - want).abs().max():.2e}")
    agree(same_on_every_rank(graphed.cpu().numpy().tobytes()), f"{what}: ranks differ")


def test_the_plain_block_on_each_path_agrees_with_tplab_nccl_and_so_does_its_overlapped_version():
    block, x = block_on_gpu()
    with torch.no_grad():
        want = block(x)  # tplab's NcclComm (make_block's communicator)
        got = overlapped(block, 2, split="batch", tail=2)(x)
        agree(torch.allclose(got, want, rtol=1e-12, atol=1e-12), f"tplab nccl, eager: {(got - want).abs().max():.2e}")
        for path, comm in COMMS.items():
            with with_comm(block, comm):
                got = block(x)
            agree(torch.allclose(got, want, rtol=1e-12, atol=1e-12), f"{path}: {(got - want).abs().max():.2e}")
