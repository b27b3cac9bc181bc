"""two_shot meets its peers fewer times (kernels/two_shot.cu). Right after an agreed two_shot it pushes before
it agrees: its sums stay right whatever came before and whatever sizes follow each other with no host wait,
and a disagreement still raises on every rank -- also where the peers' grids differ or a peer runs a
one-block kernel -- and leaves the flags fit for the calls after it. On an input already in the shared
buffer it meets them twice, and not at its end: the next input may be written at once."""

from gputest import require_gpu

require_gpu()

import cupy  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpitest import COMM, agree  # noqa: E402

from tplab.comm import nccl_world  # noqa: E402
from tplab.gpu_collectives.peer_memory import PeerMemory  # noqa: E402

P = COMM.size
NCCL = nccl_world()
PEERS = PeerMemory(COMM, 1 << 20)  # two_shot in rounds above 256 KiB per rank


def inputs(count, seed=0):
    rng = np.random.default_rng([count, seed, COMM.rank])
    values = cupy.asarray(rng.standard_normal(count))
    return values.astype(cupy.float32), values.astype(cupy.float32).astype(cupy.float64)


def right(got, values) -> bool:
    want = NCCL.builtin_allreduce(values)
    scale = NCCL.builtin_allreduce(cupy.abs(values))
    return bool((cupy.abs(got.astype(cupy.float64) - want) <= 1e-6 * P * scale).all())


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_sizes_back_to_back_with_other_calls_between(graph):
    """Small, large, in rounds and tiny two_shots back to back, an all-gather and a one_shot_ll between
    some: each two_shot either pushes before it agrees (after a two_shot) or agrees first (after the
    others). A peer may still copy the last call's results out while the next one's pushes arrive: they
    must land elsewhere, whatever the two sizes."""
    counts = [64, 60000, 300, 200000, 4, 60000, 64]
    cases = [inputs(n, k) for k, n in enumerate(counts)]
    outs = [cupy.zeros_like(x) for x, _ in cases]
    runs = [PEERS.allreduce_init(x, out, "two_shot") for (x, _), out in zip(cases, outs)]
    between = cupy.arange(1000, dtype=cupy.float32) + COMM.rank
    gathered = cupy.zeros(P * between.size, dtype=cupy.float32)
    small, small_out = cases[0][0][:40].copy(), cupy.zeros(40, dtype=cupy.float32)
    ll = PEERS.allreduce_init(small, small_out, "one_shot_ll")
    copies = [cupy.zeros_like(out) for _ in range(3) for out in outs]   # (made before: none during a capture)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        if graph:
            stream.begin_capture()
        for round_ in range(3):
            for k, run in enumerate(runs):
                run()
                cupy.copyto(copies[round_ * len(runs) + k], outs[k])
                if k == 2:
                    PEERS.allgather(between, gathered, check=False)
                if k == 4:
                    ll()
        if graph:
            stream.end_capture().launch(stream)
        stream.synchronize()
    wrong = [counts[i % len(counts)] for i, got in enumerate(copies) if not right(got, cases[i % len(counts)][1])]
    agree(not wrong, f"two_shot back to back: wrong at sizes {wrong}")
    want = NCCL.builtin_allgather(between).ravel()
    agree(bool((gathered == want).all()), "the all-gather between two_shots")


@pytest.mark.skipif(P < 2, reason="disagreement needs two ranks")
def test_a_disagreement_after_an_agreed_two_shot_raises_on_every_rank():
    x, values = inputs(4096)
    cases = [
        ("counts whose grids differ", lambda: cupy.zeros(4096 + 40000 * (COMM.rank == 1), cupy.float32), "two_shot"),
        ("a one-block kernel on rank 0", lambda: cupy.zeros(64, cupy.float32),
         "one_shot_ll" if COMM.rank == 0 else "two_shot"),
        ("rounds on one rank only", lambda: cupy.zeros(4096 if COMM.rank else 200000, cupy.float32), "two_shot"),
        ("registered on rank 0 only", lambda: PEERS.buffer(4096) if COMM.rank == 0 else cupy.zeros(4096, cupy.float32),
         "two_shot"),
        ("two_shot_pull named, registered on rank 0 only",     # (the pulled kernel meets its peers less often)
         lambda: PEERS.buffer(4096) if COMM.rank == 0 else cupy.zeros(4096, cupy.float32), "two_shot_pull"),
    ]
    for what, make, algorithm in cases:
        agree(right(PEERS.allreduce(x, "two_shot"), values), f"before {what}")   # the next two_shot pushes first
        with pytest.raises(ValueError, match="ranks disagree"):
            PEERS.allreduce(make(), algorithm)
        agree(right(PEERS.allreduce(x, "two_shot"), values), f"the call after {what}")  # (agrees first)
        agree(right(PEERS.allreduce(x, "two_shot"), values), f"two calls after {what}")  # (pushes first)
    gathered = PEERS.allgather(x)
    agree(bool((gathered == NCCL.builtin_allgather(x).ravel()).all()), "an all-gather after them")


@pytest.mark.parametrize("in_place", [True, False], ids=["in place", "out of place"])
def test_registered_inputs_back_to_back(in_place):
    """two_shot on an input already in the shared buffer meets its peers twice, and not at its end: the next
    input, written into the buffer on the same stream with no host wait, must not reach a peer that still
    reads this one. 20 calls, the input changed before each, every result checked; a plain two_shot and a
    one_shot_ll between some of them."""
    n = 60000
    x, values = inputs(n)
    buf = PEERS.buffer(n, "float32")
    out = buf if in_place else cupy.zeros(n, cupy.float32)
    run = PEERS.allreduce_init(buf, out, "two_shot")
    plain_out, small_out = cupy.zeros(n, cupy.float32), cupy.zeros(40, cupy.float32)
    others = [PEERS.allreduce_init(x, plain_out, "two_shot"), PEERS.allreduce_init(x[:40].copy(), small_out, "one_shot_ll")]
    results = [cupy.zeros(n, cupy.float32) for _ in range(20)]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for k, result in enumerate(results):
            cupy.add(x, np.float32(k), out=buf)
            run()
            cupy.copyto(result, out)
            if k % 5 == 4:
                others[k % 2]()
        stream.synchronize()
    wrong = [k for k, got in enumerate(results) if not right(got, values + k)]
    agree(not wrong, f"registered two_shot back to back: wrong at calls {wrong}")
    agree(right(plain_out, values) and right(small_out, values[:40]), "the calls between")


@pytest.mark.parametrize("attempt", range(3))
def test_the_bench_times_registered_inputs_right(attempt):
    """tplab bench's peer_registered (the like-for-like comparison with torch's symm_mem): its first result
    is checked against NCCL, and it is right at every size it times. Three fresh communicators in turn. As the
    first run on freshly started 4x H200s at p = 3 this test failed (one rank never saw a peer's pushes) until
    PeerMemory.close waited for every peer to unmap its memory before freeing it (data/README.md, the GPU
    suite's last run)."""
    from tplab.gpu_collectives import PeerMemoryComm
    from tplab.lab.bench import time_collective

    comm = PeerMemoryComm(NCCL, 1 << 20)
    try:
        for size in (4096, 1 << 19, 1 << 20):
            row = time_collective("allreduce", "peer_registered", size, comm=comm, device="gpu", graph=True,
                                  iters=5, warmup=1)
            agree(row["wrong"] == 0, f"peer_registered at {size} bytes (attempt {attempt}): {row['wrong']} wrong")
    finally:
        comm.close()


@pytest.mark.skipif(P < 2, reason="disagreement needs two ranks")
def test_a_registered_input_written_right_after_a_failed_call():
    """A two_shot that pushed before it agreed, and failed, may still be pushing into a peer that has raised
    already: the raise queues a barrier, so that the input the peer then writes into its shared buffer is
    not overwritten. Large messages (long pushes), then the registered call at once, no host wait."""
    n = 120000
    x, values = inputs(n)
    for _ in range(3):
        agree(right(PEERS.allreduce(x, "two_shot"), values), "before")    # the next two_shot pushes first
        with pytest.raises(ValueError, match="ranks disagree"):
            PEERS.allreduce(PEERS.buffer(n) if COMM.rank == 0 else x, "two_shot")
        buf = PEERS.buffer(n, "float32")
        buf[...] = x
        agree(right(PEERS.allreduce(buf, "two_shot", out=buf), values), "the registered call right after")


def test_a_registered_input_on_one_rank_where_the_ranks_agreed_before():
    """Calls that agreed before (signature 0, as tplab.allreduce's general path) never switch one rank to the
    pulled kernel: an input in the shared buffer goes through a copy there, every rank runs the same kernel,
    and the call after it does not push first (the copy back may still be landing)."""
    x, values = inputs(50000)
    y = PEERS.buffer(x.size, "float32") if COMM.rank == 0 else cupy.empty_like(x)
    for algorithm in ("two_shot", "ring", "two_shot"):
        y[...] = x   # (the shared buffer is every call's scratch: the call before wrote over it)
        agree(PEERS.agree(PEERS.signature_of(x, algorithm)) is None, "the agreement")
        got = PEERS.allreduce(y, algorithm, agreed=True)
        cupy.cuda.get_current_stream().synchronize()
        agree(right(got, values), f"{algorithm}, agreed before")
    z = PEERS.buffer(x.size, "float32") if COMM.rank == 0 else cupy.empty_like(x)
    z[...] = x
    agree(PEERS.agree(PEERS.signature_of(x, "two_shot")) is None, "the agreement")
    got = PEERS.allreduce(z, "two_shot", out=z if COMM.rank == 0 else None, agreed=True).copy()
    after = PEERS.allreduce(x, "two_shot")   # (rank 0's result is copied into its buffer after its kernel:
    cupy.cuda.get_current_stream().synchronize()   # this call must agree first, not push at once)
    agree(right(after, values), "the call after an in-place call that agreed before")
    agree(right(got, values), "in place, agreed before")


@pytest.mark.skipif(P < 2, reason="disagreement needs two ranks")
@pytest.mark.parametrize("algorithm", ["two_shot", "ring"])
def test_a_plan_on_inputs_in_the_shared_buffer(algorithm):
    """tplab.allreduce's plans take an input in the shared buffer as PeerMemory.allreduce does: pulled where
    it lies, signed as such. Right after a two_shot on plain inputs (whose peers would push the next
    two_shot's sums at once, into the input being written), inputs written into every rank's buffer sum
    right; written on one rank only, the ranks disagree, which raises on every rank, and the next calls
    sum right."""
    import tplab
    from tplab.gpu_collectives import PeerMemoryComm

    x, values = inputs(50000)
    comm = PeerMemoryComm(NCCL, 1 << 20)
    try:
        comm.kernel = algorithm
        z = comm.peers.buffer(x.size, "float32")
        for _ in range(3):
            agree(right(tplab.allreduce(x, comm), values), "plain inputs")
            z[...] = x
            agree(right(tplab.allreduce(z, comm), values), "every rank's input in its buffer")
        agree(right(tplab.allreduce(x, comm), values), "plain inputs")
        one = z if COMM.rank == 0 else x
        if COMM.rank == 0:
            z[...] = x
        with pytest.raises(ValueError, match="disagree"):
            tplab.allreduce(one, comm)
            cupy.cuda.get_current_stream().synchronize()
            comm.peers.raise_pending()
        for _ in range(2):
            agree(right(tplab.allreduce(x, comm), values), "plain inputs after the disagreement")
        with pytest.raises(ValueError, match="from its start" if COMM.rank == 0 else "rank 0 refused"):
            if COMM.rank == 0:
                tplab.allreduce(comm.peers.buffer(x.size + 4, "float32")[4:], comm)
            else:
                tplab.allreduce(x, comm)
                cupy.cuda.get_current_stream().synchronize()
                comm.peers.raise_pending()
        agree(right(tplab.allreduce(x, comm), values), "plain inputs after the refusal")
        strided = (comm.peers.buffer(2 * x.size, "float32") if COMM.rank == 0 else cupy.zeros(2 * x.size, "float32"))
        strided[::2] = x    # (a strided view: its copy would read the buffer while a peer may push into it)
        with pytest.raises(ValueError, match="strided view" if COMM.rank == 0 else "rank 0 refused"):
            tplab.allreduce(strided[::2], comm)
            cupy.cuda.get_current_stream().synchronize()
            comm.peers.raise_pending()
        agree(right(tplab.allreduce(x, comm), values), "plain inputs after the strided view's refusal")
    finally:
        comm.close()
