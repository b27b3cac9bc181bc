"""The flag-synchronised peer-memory all-reduces (tplab.gpu_collectives.peer_memory) and the copy-engine all-reduce
(tplab.gpu_collectives.copy_engine) against NCCL: integers exactly, floats within rounding, bfloat16 too, bitwise
identical on every rank, buffers and flags reused call after call, in place on the shared buffer, inside
a CUDA graph, and clear errors on every rank for bad arguments. (scripts/gpu_peer_allreduce.py runs the
same checks over more sizes before it times.)"""

from gputest import require_gpu

require_gpu()

import cupy  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpitest import COMM, agree, same_on_every_rank  # noqa: E402

from tplab.toolkit.bfloat16 import narrow, widen  # noqa: E402
from tplab.comm import nccl_world  # noqa: E402
from tplab.gpu_collectives.copy_engine import CopyEngineComm  # noqa: E402
from tplab.gpu_collectives.peer_memory import PeerMemory  # noqa: E402

P = COMM.size
NCCL = nccl_world()
PEERS = PeerMemory(COMM, 1 << 24)  # one_shot: up to 8 MiB
SMALL_PEERS = PeerMemory(COMM, 1 << 16)  # two_shot in rounds above 32 KiB
CE = CopyEngineComm(COMM, 1 << 22)
TOLERANCE = {"int32": 0, "int64": 0, "float16": 2e-3 * P, "bfloat16": 1e-2 * P, "float32": 1e-6 * P, "float64": 1e-14 * P}


def inputs(dtype, count):
    """This rank's input, and its values in float64/int64 (bfloat16 as int16 bits)."""
    rng = np.random.default_rng([count, COMM.rank])
    if dtype.startswith("int"):
        x = cupy.asarray(rng.integers(-1000, 1000, count).astype(dtype))
        return x, x.astype(cupy.int64)
    values = rng.standard_normal(count)
    if dtype == "bfloat16":
        x = narrow(cupy.asarray(values.astype(np.float32)))  # bfloat16 bits (int16), rounded to nearest even
        return x, as_float64(x, True)
    x = cupy.asarray(values.astype(dtype))
    return x, x.astype(cupy.float64)


def as_float64(y, bf16):
    if bf16:
        return widen(y).astype(cupy.float64)
    return y.astype(cupy.int64 if y.dtype.kind == "i" else cupy.float64)


def close(got, want, scale, dtype) -> bool:
    return bool((cupy.abs(got - want) <= TOLERANCE[dtype] * scale).all())


LAMPORT_DTYPES = ("float32", "bfloat16", "float16")


@pytest.mark.parametrize("algorithm", ["one_shot", "one_shot_ll", "one_shot_lamport", "two_shot_lamport", "two_shot",
                                       "two_shot_pull", "ring", "ring_pull", "auto", "copy_engine"])
@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("count", [0, 1, 7, P + 1, 1023, 65537])
def test_equals_nccl_and_is_identical_everywhere(algorithm, dtype, count):
    x, values = inputs(dtype, count)
    if x.nbytes > PEERS.limit(algorithm):
        pytest.skip(f"{algorithm} takes up to {PEERS.limit(algorithm)} bytes")
    bf16 = dtype == "bfloat16"
    if algorithm.endswith("_lamport") and dtype not in LAMPORT_DTYPES:   # (its sentinel is a NaN of theirs)
        with pytest.raises(ValueError, match=f"{algorithm} sums float32, bfloat16 and float16 only"):
            PEERS.allreduce(x, algorithm, bf16=bf16)
        return
    want = NCCL.builtin_allreduce(values)
    scale = NCCL.builtin_allreduce(cupy.abs(values).astype(cupy.float64))
    results = []
    for _ in range(2):  # the second call reuses the buffers and flags
        if algorithm == "copy_engine":
            y = x.copy()
            CE.allreduce_(y, "bf16_bits" if bf16 else {"float16": "f16_bits", "float32": "float", "float64": "double",
                                                       "int32": "int", "int64": "long long"}[dtype])
        else:
            y = PEERS.allreduce(x, algorithm, bf16=bf16)
        results.append(y)
    agree(close(as_float64(results[0], bf16), want, scale, dtype), f"{algorithm} {dtype} n={count}")
    agree(bool((results[0] == results[1]).all()), "a second call differs from the first")
    agree(same_on_every_rank(cupy.asnumpy(results[0]).tobytes()), "ranks differ")


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot_lamport", "two_shot", "two_shot_pull", "ring",
                                       "ring_pull"])
def test_in_place_on_the_shared_buffer(algorithm):
    x, values = inputs("float32", 10007)
    buf = PEERS.buffer(x.size, "float32")
    buf[...] = x
    PEERS.allreduce(buf, algorithm, out=buf)
    want = NCCL.builtin_allreduce(values)
    agree(close(buf.astype(cupy.float64), want, NCCL.builtin_allreduce(cupy.abs(values)), "float32"), algorithm)


@pytest.mark.parametrize("share", [0.5, 0.8, 1.0])
def test_two_shot_in_rounds(share):
    """Inputs larger than half the buffer go through two_shot in rounds (its partial sums and results each
    fill half): out of place, in place, and replayed from a CUDA graph between other algorithms."""
    count = int(share * SMALL_PEERS.nbytes // 4) // 4 * 4 + (4 if share == 0.5 else 0)  # (0.5: just over half)
    x, values = inputs("float32", count)
    want = NCCL.builtin_allreduce(values)
    scale = NCCL.builtin_allreduce(cupy.abs(values))
    got = SMALL_PEERS.allreduce(x, "two_shot")
    agree(close(got.astype(cupy.float64), want, scale, "float32"), f"two_shot in rounds n={count}")
    y = x.copy()
    SMALL_PEERS.allreduce(y, "two_shot", out=y)
    agree(bool((y == got).all()), "in place differs")
    out = cupy.zeros_like(x)
    runs = [SMALL_PEERS.allreduce_init(x, out, "two_shot"), SMALL_PEERS.allreduce_init(x[:100], out[:100], "one_shot_ll")]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for k in range(6):
            runs[k % 2]()
        graph = stream.end_capture()
        graph.launch(stream)
        graph.launch(stream)
        stream.synchronize()
    agree(bool((out[100:] == got[100:]).all()), "replayed in rounds differs")


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_back_to_back_launches_see_each_others_writes(graph):
    """Eagerly and in a CUDA graph the persistent launches start while the kernel before them ends
    (programmatic dependent launch on Hopper): each must still see what that kernel wrote, and the next must
    see its result. Calls back to back, no host wait, the input changed and the output read by CuPy's kernels in
    between (CuPy's kernels are launched the plain way)."""
    x, values = inputs("float32", 3000)
    algorithms = ["one_shot_ll", "two_shot", "ring", "one_shot", "one_shot_ll", "one_shot_lamport", "two_shot",
                  "one_shot_lamport", "one_shot_ll", "one_shot_lamport", "two_shot_lamport", "two_shot_lamport",
                  "one_shot_lamport", "two_shot_lamport", "ring", "two_shot_lamport"]
    outs = [cupy.zeros_like(x) for _ in algorithms]
    runs = [PEERS.allreduce_init(x, out, algorithm) for out, algorithm in zip(outs, algorithms)]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        if graph:
            stream.begin_capture()
        for run, out in zip(runs, outs):
            x += 1
            run()
            out *= 2
        if graph:
            stream.end_capture().launch(stream)
        stream.synchronize()
    for k, (algorithm, out) in enumerate(zip(algorithms, outs)):
        want = 2 * NCCL.builtin_allreduce(values + k + 1)
        agree(close(out.astype(cupy.float64), want, 2 * NCCL.builtin_allreduce(cupy.abs(values + k + 1)), "float32"),
              f"call {k}: {algorithm}")


def test_signature_zero_meets_before_it_writes():
    """A call that agreed before ("agreed already", signature 0, no agreement of its own) still meets its
    peers before it writes into their buffers: a small two_shot, then a larger one and a ring that would
    write where a slower peer still copies the small one's results out, back to back, many times; and a
    one_shot_lamport after the ring (which meets only its neighbours), whose pushes must not land before a
    peer two calls behind has written its sentinel back, and a two_shot_lamport on the other half."""
    small, big = inputs("float32", 64), inputs("float32", 60000)
    outs = [cupy.zeros_like(small[0])] + [cupy.zeros_like(big[0]) for _ in range(4)]
    runs = [PEERS.allreduce_init(small[0], outs[0], "two_shot", sig=0),
            PEERS.allreduce_init(big[0], outs[1], "two_shot", sig=0),
            PEERS.allreduce_init(big[0], outs[2], "ring", sig=0),
            PEERS.allreduce_init(big[0], outs[3], "one_shot_lamport", sig=0),
            PEERS.allreduce_init(big[0], outs[4], "two_shot_lamport", sig=0)]
    copies = []
    for _ in range(20):  # (no host wait, no other call in between: copies of the results on the same stream)
        for run in runs:
            run()
        copies.append([out.copy() for out in outs])
    wants = [NCCL.builtin_allreduce(v) for v in (small[1], big[1], big[1], big[1], big[1])]
    scales = [NCCL.builtin_allreduce(cupy.abs(v)) for v in (small[1], big[1], big[1], big[1], big[1])]
    wrong = sum(not close(got.astype(cupy.float64), want, scale, "float32")
                for results in copies for got, want, scale in zip(results, wants, scales))
    agree(wrong == 0, f"signature 0: {wrong} of {len(runs) * len(copies)} results wrong")


@pytest.mark.skipif(P < 2, reason="a failed agreement needs two ranks")
@pytest.mark.parametrize("algorithm", ["one_shot", "one_shot_ll", "one_shot_lamport", "two_shot_lamport", "two_shot",
                                       "ring"])
def test_signature_zero_stops_behind_a_failure_not_yet_raised(algorithm):
    """A persistent launch with signature 0 agreed long before. Queued behind a call that failed on the GPUs
    and was not raised yet, it must stop without writing: the peers raise and set their areas back, and a
    push landing after that would be read as data two calls on. Then the failure raises on every rank, and
    the same launch is right again."""
    x, values = inputs("float32", 4096)
    out = cupy.full_like(x, -7.0)
    again = PEERS.allreduce_init(x, out, algorithm, sig=0)
    count = 64 + 4 * COMM.rank                                    # (the ranks disagree)
    failing = PEERS.allreduce_init(cupy.ones(count, "float32"), cupy.empty(count, "float32"), "one_shot_lamport")
    failing()
    again()
    cupy.cuda.get_current_stream().synchronize()
    untouched = bool((out == -7.0).all())
    with pytest.raises(ValueError, match="ranks disagree"):
        PEERS.raise_pending()
    agree(untouched, f"{algorithm} with signature 0 wrote after a failed call")
    want, scale = NCCL.builtin_allreduce(values), NCCL.builtin_allreduce(cupy.abs(values))
    for k in range(3):                                            # (both halves of the Lamport areas)
        again()
        agree(close(out.astype(cupy.float64), want, scale, "float32"), f"{algorithm} call {k} after the raise")


def test_algorithms_in_any_order():
    """Each algorithm leaves the flags and buffers fit for any other next (one_shot's own double buffer,
    every call's meeting before it writes into a peer): a random sequence of all of them, each checked."""
    rng = np.random.default_rng(7)  # the same sequence on every rank
    for step in range(40):
        algorithm = ["one_shot", "one_shot_ll", "one_shot_lamport", "two_shot_lamport", "two_shot", "two_shot_pull",
                     "ring", "ring_pull"][rng.integers(8)]
        count = int(rng.choice([5, 1000, 40000]))
        x, values = inputs("float32", count)
        got = PEERS.allreduce(x + step, algorithm)
        want = NCCL.builtin_allreduce(values + step)
        agree(close(got.astype(cupy.float64), want, NCCL.builtin_allreduce(cupy.abs(values + step)), "float32"),
              f"step {step}: {algorithm} n={count}")


@pytest.mark.parametrize("algorithm", ["one_shot", "one_shot_ll", "one_shot_lamport", "two_shot_lamport", "two_shot",
                                       "two_shot_pull", "ring", "ring_pull"])
def test_replayed_from_a_cuda_graph(algorithm):
    x, values = inputs("float32", 4096)
    out = cupy.zeros_like(x)
    run = PEERS.allreduce_init(x, out, algorithm)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for _ in range(5):
            run()
        graph = stream.end_capture()
        for _ in range(3):  # replays go on counting barriers (the counts live in GPU memory)
            out.fill(0)
            graph.launch(stream)
        stream.synchronize()
    want = NCCL.builtin_allreduce(values)
    agree(close(out.astype(cupy.float64), want, NCCL.builtin_allreduce(cupy.abs(values)), "float32"), algorithm)


@pytest.mark.parametrize("calls", [1, 3])
def test_copy_engine_replayed_back_to_back_from_a_cuda_graph(calls):
    """Replays with no host wait in between, an odd number of calls per graph too: the barriers of a
    captured call must wait again on every replay, and a replay's first call may reuse the half of the
    previous replay's last (copy_engine.py's docstring)."""
    x, values = inputs("float32", 300007)
    outs = [cupy.empty_like(x) for _ in range(calls)]
    CE.allreduce_(x.copy(), "float")  # (kernels compiled outside the capture), on another stream than the graph:
    cupy.cuda.Device().synchronize()  # done everywhere before the replays start
    COMM.Barrier()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for out in outs:
            out[...] = x
            CE.allreduce_(out, "float")
        graph = stream.end_capture()
        for _ in range(6):
            graph.launch(stream)
        stream.synchronize()
    want = NCCL.builtin_allreduce(values)
    scale = NCCL.builtin_allreduce(cupy.abs(values).astype(cupy.float64))
    for i, out in enumerate(outs):
        agree(close(out.astype(cupy.float64), want, scale, "float32"), f"call {i} of {calls}, after 6 replays")


def test_copy_engine_eager_calls_then_a_replay_without_waiting():
    """A graph replayed right behind eager calls, the last of which used the same half of the buffers as the
    captured call: the eager call's last barrier must keep the replay from writing what peers still read."""
    x, values = inputs("float32", 300007)
    out, eager = cupy.empty_like(x), [x.copy() for _ in range(2)]
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        CE.allreduce_(x.copy(), "float")  # (kernels compiled outside the capture)
        stream.begin_capture()
        out[...] = x
        CE.allreduce_(out, "float")       # call c: half c % 2
        graph = stream.end_capture()
        stream.synchronize()
        COMM.Barrier()
        for y in eager:                   # calls c+1, c+2: the last on half c % 2 again
            CE.allreduce_(y, "float")
        graph.launch(stream)              # no wait in between
        stream.synchronize()
    want = NCCL.builtin_allreduce(values)
    scale = NCCL.builtin_allreduce(cupy.abs(values).astype(cupy.float64))
    for name, y in [("eager 1", eager[0]), ("eager 2", eager[1]), ("replay", out)]:
        agree(close(y.astype(cupy.float64), want, scale, "float32"), name)


def test_bad_arguments_raise_on_every_rank():
    with pytest.raises(ValueError, match="do not fit"):
        PEERS.allreduce(cupy.zeros(PEERS.nbytes // 4 + 1, dtype="float32"))
    with pytest.raises(ValueError, match="unknown algorithm"):
        PEERS.allreduce(cupy.zeros(4, dtype="float32"), "three_shot")
    if P > 1:
        with pytest.raises(ValueError, match="ranks disagree"):
            PEERS.allreduce(cupy.zeros(4 + COMM.rank, dtype="float32"))
        with pytest.raises(ValueError, match="ranks disagree"):  # one_shot_ll's pushes meet the peers' barrier
            PEERS.allreduce(cupy.zeros(64, dtype="float32"), "one_shot_ll" if COMM.rank == 0 else "two_shot")
        with pytest.raises(ValueError, match="ranks disagree"):
            PEERS.allreduce(cupy.zeros(64 + 4 * COMM.rank, dtype="float32"), "one_shot_ll")
        # one_shot_ll waits for its data and the agreement together: rank 0's 64 blocks of lines, of which
        # the peers push only the first's, must stop waiting once the agreement has failed (no timeout)
        with pytest.raises(ValueError, match="ranks disagree"):
            PEERS.allreduce(cupy.zeros(16384 if COMM.rank == 0 else 256, dtype="float32"), "one_shot_ll")
        with pytest.raises(ValueError, match="handles up to|refused its input"):   # a peer that only refuses
            PEERS.allreduce(cupy.zeros(PEERS.ll_bytes // 4 + 4 if COMM.rank == P - 1 else 16384, "float32"),
                            "one_shot_ll")
        for algorithm in ("two_shot", "ring"):  # registered on rank 0 only: it pulls, the others push
            y = PEERS.buffer(256, "float32") if COMM.rank == 0 else cupy.zeros(256, dtype="float32")
            with pytest.raises(ValueError, match="input in the shared buffer on one rank only"):
                PEERS.allreduce(y, algorithm)
        x, values = inputs("float32", 1000)                     # and the next call is right
        agree(close(PEERS.allreduce(x, "one_shot_ll").astype(cupy.float64), NCCL.builtin_allreduce(values),
                    NCCL.builtin_allreduce(cupy.abs(values)), "float32"), "one_shot_ll after two mismatches")
        # one_shot_lamport's failed pushes land where nobody reads them: the area is set back after the raise,
        # so the next calls (both halves of its area, sizes that cover the stale pushes) are right
        for count in (16384 if COMM.rank == 0 else 256, 64 + 4 * COMM.rank):
            with pytest.raises(ValueError, match="ranks disagree"):
                PEERS.allreduce(cupy.ones(count, dtype="float32"), "one_shot_lamport")
        with pytest.raises(ValueError, match="refused its input|one_shot_lamport sums"):   # a peer that refuses
            PEERS.allreduce(cupy.ones(16384, dtype="int32" if COMM.rank == P - 1 else "float32"), "one_shot_lamport")
        for k in range(3):
            x, values = inputs("float32", 16384)
            agree(close(PEERS.allreduce(x + k, "one_shot_lamport").astype(cupy.float64),
                        NCCL.builtin_allreduce(values + k), NCCL.builtin_allreduce(cupy.abs(values + k)), "float32"),
                  f"one_shot_lamport call {k} after its failed calls")
        # two_shot_lamport likewise: a peer with another size pushes into other slots' places, one with another
        # algorithm waits for data nobody sends; then calls of both halves of the area are right
        for count, algorithm in ((100000 if COMM.rank == 0 else 3000, "two_shot_lamport"),
                                 (40000, "two_shot_lamport" if COMM.rank == 0 else "one_shot_lamport")):
            with pytest.raises(ValueError, match="ranks disagree"):
                PEERS.allreduce(cupy.ones(count, dtype="float32"), algorithm)
        for k in range(3):
            x, values = inputs("float32", 100000)
            agree(close(PEERS.allreduce(x + k, "two_shot_lamport").astype(cupy.float64),
                        NCCL.builtin_allreduce(values + k), NCCL.builtin_allreduce(cupy.abs(values + k)), "float32"),
                  f"two_shot_lamport call {k} after its failed calls")
    with pytest.raises(ValueError, match="one_shot handles up to"):
        PEERS.allreduce(cupy.zeros(PEERS.small // 4 + 4, dtype="float32"), "one_shot")
    with pytest.raises(ValueError, match="out may lie in the shared buffer only"):
        PEERS.allreduce(cupy.zeros(8, dtype="float32"), "two_shot", out=PEERS.buffer(8))
    with pytest.raises(ValueError, match="x may lie in the shared buffer only from its start"):
        PEERS.allreduce(PEERS.buffer(16, "float32")[4:], "two_shot")


@pytest.mark.parametrize("dtype", ["float32", "int16", "float64"])
@pytest.mark.parametrize("count", [0, 1, 5, 4096, 10001])
def test_allgather_equals_nccl(dtype, count):
    x = (cupy.arange(count) * (COMM.rank + 1) + 7 * COMM.rank).astype(dtype)
    results = [PEERS.allgather(x) for _ in range(2)]
    want = NCCL.builtin_allgather(x).ravel()
    agree(all(r.size == P * count and bool((r == want).all()) for r in results), f"allgather {dtype} n={count}")


def test_allgather_of_torch_tensors_along_dim_0():
    import torch

    x = torch.randn(3, 5, 7, device="cuda").to(torch.bfloat16) + COMM.rank
    got = PEERS.allgather_torch(x)
    parts = COMM.allgather(x.float().cpu().numpy())
    agree(tuple(got.shape) == (3 * P, 5, 7) and np.array_equal(got.float().cpu().numpy(), np.concatenate(parts)),
          "allgather_torch")


def test_tplab_allreduce_on_peer_memory_runs_the_kernels():
    """tplab.allreduce on a PeerMemoryComm: "auto" runs the kernel the measured table names for the size,
    or the one set as ``comm.kernel``; integers come out exact either way."""
    import tplab
    from tplab.gpu_collectives import PeerMemoryComm

    comm = PeerMemoryComm(NCCL, 1 << 22)
    try:
        for count in [3, 1000, 300000]:
            x = cupy.arange(count, dtype=cupy.int32) + COMM.rank
            want = NCCL.builtin_allreduce(x)
            for kernel in ["auto", "one_shot_ll", "one_shot_lamport", "one_shot", "two_shot_lamport", "two_shot",
                           "ring"]:
                comm.kernel = kernel     # (the Lamport kernels do not sum integers: NCCL does, as for any other)
                for _ in range(2):  # the plan's first call and a later one
                    agree(bool((tplab.allreduce(x, comm) == want).all()), f"{kernel} n={count}")
    finally:
        comm.close()


@pytest.mark.parametrize("algorithm", ["one_shot_lamport", "two_shot_lamport"])
@pytest.mark.parametrize("dtype", LAMPORT_DTYPES)
def test_lamport_inputs_that_hold_its_sentinel(dtype, algorithm):
    """one_shot_lamport's area holds all-ones words until data lands, and a sender swaps any all-ones word of
    its input for another NaN: inputs holding that pattern (whole all-ones words, and for 16-bit types single
    all-ones elements too) give NaN where any rank has one, the right sum elsewhere, the same bits on every
    rank, call after call."""
    count = 4099
    x, values = inputs(dtype, count)
    bits = x.view(cupy.uint16 if dtype != "float32" else cupy.uint32)
    special = cupy.zeros(count, dtype=bool)
    rng = np.random.default_rng(11)                       # the same positions on every rank, each its own share
    marks = rng.choice(count - 1, 300, replace=False)
    if dtype != "float32":
        marks = np.unique(marks // 2 * 2)           # (word-aligned pairs: whole all-ones 32-bit words)
    mine = cupy.asarray(marks[COMM.rank::P])
    bits[mine] = (0xFFFF if dtype != "float32" else 0xFFFFFFFF)            # the sentinel's pattern itself
    if dtype != "float32":
        bits[mine + 1] = 0xFFFF                                           # a whole all-ones 32-bit word
    special[cupy.asarray(marks)] = True
    if dtype != "float32":
        special[cupy.asarray(marks) + 1] = True
    results = [PEERS.allreduce(x, algorithm, bf16=dtype == "bfloat16") for _ in range(3)]
    got = as_float64(results[0], dtype == "bfloat16")
    nan_where = cupy.isnan(got)
    want = NCCL.builtin_allreduce(cupy.where(special, 0.0, values))
    scale = NCCL.builtin_allreduce(cupy.abs(cupy.where(special, 0.0, values)))
    agree(bool((nan_where == special).all()), "NaN exactly where a rank sent the sentinel's pattern")
    agree(close(cupy.where(special, 0.0, got), want, scale, dtype), "the other sums")
    agree(all(bool((r.view(bits.dtype) == results[0].view(bits.dtype)).all()) for r in results), "calls differ")
    agree(same_on_every_rank(cupy.asnumpy(results[0]).tobytes()), "ranks differ")
