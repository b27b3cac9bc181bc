"""tplab's all-to-all (pairwise, Bruck) and all-to-all-v over NCCL point-to-point on GPU memory, against MPI's
own on host copies (bitwise), and the expert-parallel MoE layer on CUDA tensors against the unsplit layer."""

from gputest import require_gpu

require_gpu()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpitest import COMM, agree  # noqa: E402

torch = pytest.importorskip("torch")

from tplab.collectives import alltoall, alltoallv  # noqa: E402
from tplab.comm import nccl_world  # noqa: E402
from tplab.moe import ExpertParallelMoE, MoE  # noqa: E402

P, RANK = COMM.size, COMM.rank
NCCL = nccl_world()
DEVICE = torch.device("cuda", NCCL.device)


@pytest.mark.parametrize("algorithm", ["pairwise", "bruck"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [0, 1, 7, 4096])
def test_alltoall_on_gpus_equals_mpi(algorithm, dtype, block):
    x = (torch.arange(P * block * 3, dtype=torch.float32) + 1000 * RANK).reshape(P, block, 3).to(dtype)
    want = np.empty_like(x.view(torch.int16 if dtype == torch.bfloat16 else torch.float32).numpy())
    COMM.Alltoall(x.view(torch.int16 if dtype == torch.bfloat16 else torch.float32).numpy(), want)
    got = alltoall(x.to(DEVICE), NCCL, algorithm=algorithm)
    agree(got.device == DEVICE and got.dtype == dtype, f"{got.device} {got.dtype}")
    bits = got.cpu().view(torch.int16 if dtype == torch.bfloat16 else torch.float32).numpy()
    agree(np.array_equal(bits, want), f"{algorithm} {dtype} block {block}: differs from MPI_Alltoall")


@pytest.mark.parametrize("largest", [0, 1, 300])
def test_alltoallv_on_gpus_equals_mpi(largest):
    rng = np.random.default_rng(largest)
    m = rng.integers(0, largest + 1, size=(P, P))
    sends, recvs = m[RANK], m[:, RANK]
    x = torch.arange(int(sends.sum()) * 4, dtype=torch.float32).reshape(-1, 4) + 10**6 * RANK
    want = np.empty((int(recvs.sum()), 4), np.float32)
    COMM.Alltoallv([x.numpy(), sends * 4], [want, recvs * 4])
    got = alltoallv(x.to(DEVICE), sends, NCCL)
    agree(np.array_equal(got.cpu().numpy(), want), f"counts up to {largest}: differs from MPI_Alltoallv")


def test_expert_parallel_layer_on_gpus():
    torch.manual_seed(0)
    moe = MoE(16, 32, 5, 2, capacity_factor=1.0, shared_ffn=8).to(DEVICE)
    ep = ExpertParallelMoE.from_dense(moe, NCCL)
    x = torch.randn(P * 6, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.no_grad():
        want, got = moe(x)[RANK * 6:(RANK + 1) * 6], ep(x[RANK * 6:(RANK + 1) * 6])
    err = float((got - want).abs().max())
    agree(err < 1e-5, f"expert-parallel on GPUs differs from the unsplit layer by {err:.1e}")


PEERS = None


def peers():
    global PEERS
    if PEERS is None:
        from tplab.gpu_collectives.peer_memory import PeerMemory

        PEERS = PeerMemory(COMM, 1 << 20)
    return PEERS


@pytest.mark.parametrize("dtype", ["float32", "int16", "uint8"])
@pytest.mark.parametrize("block", [0, 1, 3, 4, 1000, 4096])
def test_peer_memory_alltoall_equals_mpi(dtype, block):
    """Each rank writes each destination's block into that peer's buffer: bitwise MPI_Alltoall, odd block sizes
    (padded to whole 16-byte packs) included."""
    import cupy

    from tplab.gpu_collectives.peer_alltoall import peer_alltoall

    x = ((np.arange(P * block) * 7 + 1000 * RANK) % 251).astype(dtype)
    want = np.empty_like(x)
    COMM.Alltoall(x, want)
    with cupy.cuda.Device(NCCL.device):
        got = peer_alltoall(peers(), cupy.asarray(x)).get()
    agree(np.array_equal(got, want), f"peer all-to-all {dtype} block {block}: differs from MPI_Alltoall")


def test_peer_memory_alltoall_mismatched_sizes_raise_on_every_rank():
    import cupy

    from tplab.collectives import CollectiveArgumentError
    from tplab.gpu_collectives.peer_alltoall import peer_alltoall

    n = P * (8 if RANK == 0 else 16)
    with cupy.cuda.Device(NCCL.device):
        try:
            peer_alltoall(peers(), cupy.zeros(n, cupy.float32))
            raised = ""
        except CollectiveArgumentError as e:
            raised = str(e)
    agree(bool(raised), "mismatched all-to-all sizes must raise on every rank")
    with cupy.cuda.Device(NCCL.device):  # and the peer memory works on afterwards
        x = cupy.full(P * 4, RANK, cupy.float32)
        got = peer_alltoall(peers(), x).get()
    agree(np.array_equal(got, np.repeat(np.arange(P, dtype=np.float32), 4)), "peer all-to-all after a refusal")
