"""Bad input to tplab's collectives on GPUs: a clear error on every rank within seconds, never a hang or a
silent wrong sum; dtypes a path cannot sum fall back to one that can; the communicator works afterwards.

    mpiexec -n 4 python -m pytest tests/gpu/test_gpu_bad_input.py      (also -n 2 and -n 3)

The communicator is a PeerMemoryComm (NCCL inside, tplab's kernels as its own all-reduce): the ranks
compare their calls on the GPUs, not by a host all-gather.
"""

import time

import pytest
from gputest import require_gpu

require_gpu()
import cupy  # noqa: E402
import torch  # noqa: E402
from mpitest import COMM, agree  # noqa: E402

import tplab  # noqa: E402
from tplab import CollectiveArgumentError  # noqa: E402
from tplab.comm import nccl_world  # noqa: E402
from tplab.gpu_collectives import PeerMemoryComm  # noqa: E402

P = COMM.size
NCCL = nccl_world()
torch.cuda.set_device(cupy.cuda.Device().id)
PEERS = PeerMemoryComm(NCCL, 1 << 20, timeout=20.0)
SECONDS = 10.0  # "within seconds"
pytestmark = pytest.mark.skipif(P < 2, reason="disagreement needs two ranks")


def gpu(n, dtype=torch.float32, rank_offset=True):
    return (torch.arange(n, device="cuda") % 7 + (COMM.rank if rank_offset else 0)).to(dtype)


def fails_everywhere(call, match=None):
    """Run ``call`` on this rank: it raises CollectiveArgumentError here within SECONDS, at once or (a plan
    that ran before does not wait for its kernel: the error is found at the next call once the GPU has
    finished the failed one) at the next call. Every rank must report so; then the communicator must
    still sum correctly."""
    start = time.monotonic()
    message = None
    try:
        call()
        torch.cuda.synchronize()
        tplab.allreduce(gpu(8), PEERS)  # a deferred error surfaces here
    except CollectiveArgumentError as e:
        message = str(e)
    took = time.monotonic() - start
    ok = message is not None and took < SECONDS and (match is None or match in message)
    agree(ok, f"rank {COMM.rank}: {message!r} after {took:.1f} s")
    assert_still_works()


def assert_still_works():
    for n in (5, 4096):
        got = tplab.allreduce(gpu(n), PEERS)
        want = sum((torch.arange(n, device="cuda") % 7 + r).float() for r in range(P))
        agree(torch.equal(got, want), "the communicator sums correctly afterwards")


def test_mismatched_count_on_a_fresh_plan():
    fails_everywhere(lambda: tplab.allreduce(gpu(1000 + (COMM.rank == 1)), PEERS), "disagree")


def test_mismatched_count_on_a_plan_used_before():
    for _ in range(2):
        tplab.allreduce(gpu(777), PEERS)  # every rank has this plan now: no wait on its calls
    fails_everywhere(lambda: tplab.allreduce(gpu(777 if COMM.rank == 0 else 778), PEERS))


def test_a_rank_that_queued_more_calls_after_a_failure_still_meets_its_peers_later():
    """Plans do not wait for their kernels. Rank 0 queues three more calls behind one that will fail; they
    stop without meeting anyone (the failure is seen on the GPU first) and must not count as calls: small
    all-reduces (one_shot_ll) tag their data by the call's number, so a rank that counted more would wait for
    lines its peers never write (a timeout, the peer memory unusable) -- assert_still_works checks it."""
    for _ in range(2):
        tplab.allreduce(gpu(777), PEERS)                     # the plan exists on every rank: no waits

    def call():
        if COMM.rank == 0:
            for n in (777, 777, 777, 777):                   # the first one fails; three more queued behind it
                tplab.allreduce(gpu(n), PEERS)
        else:
            time.sleep(0.5)                                  # (rank 0's host has queued all four by now)
            tplab.allreduce(gpu(778), PEERS)
    fails_everywhere(call, "disagree")


def test_a_failure_found_while_a_graph_is_captured_is_raised_again_outside_it():
    """A failure found while a CUDA graph is being captured cannot be cleared there (the clearing and the
    barrier after it would be recorded, not run): it raises, and raises again at the next call outside."""
    for n in (900, 901):
        for _ in range(2):
            tplab.allreduce(gpu(n), PEERS)         # both plans made on every rank: their calls do not wait
    tplab.allreduce(gpu(900 if COMM.rank == 0 else 901), PEERS)   # fails on the GPUs, found later
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    x = gpu(64)
    with pytest.raises(CollectiveArgumentError, match="captured"):
        with torch.cuda.graph(graph):
            tplab.allreduce(x, PEERS)
    fails_everywhere(lambda: tplab.allreduce(gpu(64), PEERS), "disagree")


def test_the_barrier_after_a_failure_times_out_when_a_peer_never_comes():
    """After a failed call every rank queues one barrier; a peer whose program never comes back to this peer
    memory must not leave the stream waiting forever: the barrier gives up after the timeout, and the next
    call raises that the peer did not join (the peer memory is unusable from then on)."""
    from tplab.gpu_collectives.peer_memory import PeerMemory

    peers = PeerMemory(COMM, 1 << 16, timeout=1.0)
    try:
        if COMM.rank == 0:
            with pytest.raises(ValueError, match="unknown algorithm"):
                peers.allreduce(cupy.zeros(4, dtype="float32"), "three_shot")   # refuses, queues its barrier
            start = time.monotonic()
            cupy.cuda.get_current_stream().synchronize()                 # the barrier ends, with TIMEOUT
            waited = time.monotonic() - start
            with pytest.raises(Exception, match="did not join"):
                peers.allreduce(cupy.zeros(4, dtype="float32"))
            ok = waited < SECONDS
        else:
            time.sleep(3.0)                                              # (never calls this peer memory again)
            ok = True
        agree(ok, f"rank {COMM.rank}: the barrier waited for a peer that never came")
    finally:
        peers.close()


def test_mismatched_shape_same_count():
    shape = (4, 8) if COMM.rank == 0 else (8, 4)
    fails_everywhere(lambda: tplab.allreduce(gpu(32).reshape(shape), PEERS), "disagree")


@pytest.mark.parametrize("mine, theirs", [(torch.bfloat16, torch.int16), (torch.float16, torch.bfloat16),
                                          (torch.int32, torch.float32)])
def test_mismatched_dtype(mine, theirs):
    dtype = mine if COMM.rank == 0 else theirs
    fails_everywhere(lambda: tplab.allreduce(gpu(256, dtype), PEERS), "disagree")


def test_mismatched_op():
    op = "max" if COMM.rank == 0 else "sum"
    fails_everywhere(lambda: tplab.allreduce(gpu(64), PEERS, op=op))


def test_mismatched_algorithm():
    algorithm = "ring" if COMM.rank == 0 else "auto"
    fails_everywhere(lambda: tplab.allreduce(gpu(64), PEERS, algorithm=algorithm))


def test_a_cpu_tensor_on_one_rank():
    x = gpu(64).cpu() if COMM.rank == 1 else gpu(64)
    fails_everywhere(lambda: tplab.allreduce(x, PEERS))


def test_a_bfloat16_cpu_tensor_on_one_rank():
    x = gpu(64, torch.bfloat16).cpu() if COMM.rank == 1 else gpu(64, torch.bfloat16)
    fails_everywhere(lambda: tplab.allreduce(x, PEERS))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU visible to the process")
def test_a_tensor_on_the_wrong_gpu():
    other = (torch.cuda.current_device() + 1) % torch.cuda.device_count()
    x = gpu(64).to(f"cuda:{other}") if COMM.rank == 1 else gpu(64)
    fails_everywhere(lambda: tplab.allreduce(x, PEERS), None)


def test_too_large_for_the_peer_buffer_falls_back_to_nccl():
    n = PEERS.peers.nbytes // 4 + 1000
    got = tplab.allreduce(gpu(n), PEERS)
    want = sum((torch.arange(n, device="cuda") % 7 + r).float() for r in range(P))
    agree(torch.equal(got, want), "larger than the peer buffer: NCCL's sum")


def test_too_large_on_one_rank_only():
    n = PEERS.peers.nbytes // 4 + (1000 if COMM.rank == 1 else -1000)
    fails_everywhere(lambda: tplab.allreduce(gpu(n), PEERS), "disagree")


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16])
def test_dtypes_the_kernels_cannot_sum_fall_back(dtype):
    got = tplab.allreduce(gpu(100, dtype), PEERS)
    want = sum((torch.arange(100, device="cuda") % 7 + r) for r in range(P)).to(dtype)
    agree(torch.equal(got, want), f"{dtype}: summed by a fallback")


def test_non_contiguous_views_are_summed_as_their_values():
    base = gpu(64 * 3).reshape(64, 3)
    view = base[:, 1] if COMM.rank == 0 else base[:, 1].contiguous()
    got = tplab.allreduce(view, PEERS)
    want = sum((torch.arange(64 * 3, device="cuda") % 7 + r).float().reshape(64, 3)[:, 1] for r in range(P))
    agree(torch.equal(got, want), "a strided view sums like its values")


def test_the_raw_kernels_refuse_a_non_contiguous_array_on_every_rank():
    x = cupy.arange(64, dtype=cupy.float32)
    x = x[::2] if COMM.rank == 1 else x[:32]
    start = time.monotonic()
    try:
        PEERS.peers.allreduce(x)
        message = None
    except CollectiveArgumentError as e:
        message = str(e)
    agree(message is not None and time.monotonic() - start < SECONDS, f"rank {COMM.rank}: {message!r}")
    assert_still_works()


def test_mismatched_reduce_scatter_and_allgather():
    n = 8 * P + (COMM.rank == 0)
    fails_everywhere(lambda: tplab.reduce_scatter(gpu(n), PEERS), "disagree")
    fails_everywhere(lambda: tplab.allgather(gpu(8), PEERS, algorithm="ring" if COMM.rank else "builtin"))
