"""tplab.overlap: nonblocking collectives equal the blocking ones, waited in any order; overlapped layers
equal the plain ones (float64, ~1e-12), forward and backward; the tracer's intervals and Chrome JSON."""

import json
import threading

import numpy as np
import pytest
from mpitest import COMM, agree, same_on_every_rank

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import tplab  # noqa: E402
from tplab.collectives import ALGORITHMS, CollectiveArgumentError  # noqa: E402
from tplab.comm import world  # noqa: E402
from tplab.layers import ParallelAttention, ParallelMLP, RowParallelLinear  # noqa: E402
from tplab.models import GPT, GPTConfig  # noqa: E402
from tplab.models.parallel import ParallelBlock  # noqa: E402
from tplab.overlap import (  # noqa: E402
    Tracer,
    chrome_trace,
    collectives_of,
    iallgather,
    iallreduce,
    ireduce_scatter,
    overlap_sweep,
    overlapped,
    running_threads,
    shutdown,
)
from tplab.overlap import progress_thread  # noqa: E402

P, R = COMM.size, COMM.rank
C = world(timeout=10)
TOL = dict(rtol=1e-12, atol=1e-12)
SIZES = [0, 1, 3 * P + 1, 5000]  # empty, fewer elements than ranks (P > 1), uneven blocks, bigger
BLOCKING = {"allreduce": tplab.allreduce, "reduce_scatter": tplab.reduce_scatter, "allgather": tplab.allgather}
NONBLOCKING = {"allreduce": iallreduce, "reduce_scatter": ireduce_scatter, "allgather": iallgather}
CASES = [(name, algorithm) for name in NONBLOCKING for algorithm in ALGORITHMS[name]]


@pytest.fixture(scope="module", autouse=True)
def no_thread_left_behind():
    yield
    shutdown()
    agree(not running_threads(), f"progress threads still running: {running_threads()}")


def data(size, seed):
    return np.random.default_rng([seed, R]).standard_normal(size)  # different on every rank


def waiting_orders(n):
    """Wait in the order started, reversed, and interleaved (odd ones first, then even, backwards)."""
    return {"in order": list(range(n)), "reversed": list(range(n))[::-1],
            "interleaved": list(range(1, n, 2)) + list(range(0, n, 2))[::-1]}


@pytest.mark.parametrize("name,algorithm", CASES)
def test_nonblocking_equals_blocking_in_any_waiting_order(name, algorithm):
    blocking, start = BLOCKING[name], NONBLOCKING[name]
    inputs = [data(n, seed) for seed, n in enumerate(SIZES)]
    expected = [blocking(x, C, algorithm=algorithm) for x in inputs]
    for order_name, order in waiting_orders(len(inputs)).items():
        handles = [start(x, C, algorithm=algorithm) for x in inputs]
        # a blocking collective on the same communicator while they are in flight (its own messages and
        # scratch buffers: the thread works on a duplicate)
        between = tplab.allreduce(inputs[-1], C, algorithm="ring")
        results = {i: handles[i].wait() for i in order}
        ok = all(np.array_equal(results[i], expected[i]) for i in range(len(inputs)))
        agree(ok and all(h.test() for h in handles), f"{name} {algorithm}, waited {order_name}")
        agree(np.array_equal(between, tplab.allreduce(inputs[-1], C, algorithm="ring")), "blocking one in between")


def test_nonblocking_collectives_of_different_kinds_interleaved_across_communicators():
    other = C.split(0)  # a second communicator: its own progress thread
    x = data(1000, 11)
    handles = [iallreduce(x, C, algorithm="ring"), iallgather(x, other), ireduce_scatter(x, C),
               iallreduce(x, other, algorithm="recursive_doubling"), iallgather(x, C, algorithm="recursive_doubling")]
    got = [h.wait() for h in handles[::-1]][::-1]
    want = [tplab.allreduce(x, C, algorithm="ring"), tplab.allgather(x, other), tplab.reduce_scatter(x, C),
            tplab.allreduce(x, other, algorithm="recursive_doubling"),
            tplab.allgather(x, C, algorithm="recursive_doubling")]
    agree(all(np.array_equal(g, w) for g, w in zip(got, want)), "interleaved kinds and communicators")


def test_torch_tensors_in_and_out():
    x = torch.from_numpy(data(12, 3))
    y = iallreduce(x, C, algorithm="ring").wait()
    agree(isinstance(y, torch.Tensor) and torch.equal(y, tplab.allreduce(x, C, algorithm="ring")), "torch tensor")


def test_bad_arguments_are_an_error_on_every_rank():
    with pytest.raises(CollectiveArgumentError, match="unknown algorithm"):
        iallreduce(data(4, 0), C, algorithm="nope")
    if P > 1:
        with pytest.raises(CollectiveArgumentError, match="disagree on shape"):
            iallreduce(data(4 + R, 0), C, algorithm="ring")  # checked before anything is queued
    agree(np.array_equal(iallreduce(data(5, 1), C).wait(), tplab.allreduce(data(5, 1), C)), "still usable")


def test_an_error_in_the_thread_is_raised_by_wait_and_fails_what_follows():
    sub = C.split(0)
    engine = progress_thread.engine_for(sub)
    first = engine.submit("boom", lambda comm: 1 / 0)
    second = iallreduce(data(3, 0), sub, algorithm="ring")
    with pytest.raises(ZeroDivisionError):
        first.wait()
    with pytest.raises(RuntimeError, match="earlier nonblocking collective"):
        second.wait()
    agree(engine.close(), "the engine did not stop")


def test_closing_an_engine_whose_thread_hangs_returns_instead_of_hanging():
    engine = progress_thread.engine_for(C.split(0))
    release = threading.Event()
    engine.submit("hangs until released", lambda comm: release.wait(10))
    agree(not engine.close(timeout=0.05), "close() waited for a hung thread")  # gives up, does not hang
    release.set()
    engine.thread.join(10)
    agree(not engine.thread.is_alive(), "the thread did not end once released")


def test_thread_level_below_multiple_is_a_clear_error(monkeypatch):
    from mpi4py import MPI

    monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_SERIALIZED)
    with pytest.raises(RuntimeError, match="MPI_THREAD_MULTIPLE"):
        progress_thread.require_thread_multiple()


# ---- overlapped layers ----------------------------------------------------------------------------------------------
def replicated(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def forward_and_backward(layer, x):
    x = x.detach().clone().requires_grad_()
    for param in layer.parameters():
        param.grad = None
    y = layer(x)
    y.square().sum().backward()
    return y.detach(), x.grad, {id(p): p.grad.clone() for p in layer.parameters()}  # (wrappers order them anew)


def assert_same(layer, fast, x, what):
    y, dx, grads = forward_and_backward(layer, x)
    y2, dx2, grads2 = forward_and_backward(fast, x)
    agree(torch.allclose(y, y2, **TOL), f"{what}: forward differs by {(y - y2).abs().max():.2e}")
    agree(torch.allclose(dx, dx2, **TOL), f"{what}: input gradient differs by {(dx - dx2).abs().max():.2e}")
    agree(grads.keys() == grads2.keys() and all(torch.allclose(grads[k], grads2[k], **TOL) for k in grads),
          f"{what}: weight gradients differ")


def dense_mlp(h, ffn, seed=1, bias=True):
    torch.manual_seed(seed)
    return nn.Linear(h, ffn, bias=bias, dtype=torch.float64), nn.Linear(ffn, h, bias=bias, dtype=torch.float64)


@pytest.mark.parametrize("chunks", [1, 2, 3, 7])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_overlapped_mlp_equals_the_mlp(chunks, sequence_parallel):
    up, down = dense_mlp(8, 4 * P)
    mlp = ParallelMLP.from_dense(up, down, C, sequence_parallel=sequence_parallel, algorithm="ring")
    x = replicated(3 * P, 2, 8, seed=2)  # (s, b, h)
    if sequence_parallel:
        x = x.chunk(P)[R]  # my slice of the sequence
    assert_same(mlp, overlapped(mlp, chunks), x, f"MLP sp={sequence_parallel} k={chunks}")


def test_overlapped_swiglu_mlp_and_row_parallel_linear():
    up, down = dense_mlp(8, 4 * P, bias=False)
    gate = nn.Linear(8, 4 * P, bias=False, dtype=torch.float64)
    mlp = ParallelMLP.from_dense(up, down, C, gate=gate, activation="swiglu")
    assert_same(mlp, overlapped(mlp, 3), replicated(2, 5, 8, seed=3), "SwiGLU MLP")
    row = RowParallelLinear.from_linear(down, C, input_is_parallel=False)
    assert_same(row, overlapped(row, 4), replicated(5, 4 * P, seed=4), "row-parallel, unsplit input")
    row = RowParallelLinear.from_linear(nn.Linear(2 * P, 3, dtype=torch.float64), C)
    assert_same(row, overlapped(row, 2), replicated(4, 2, seed=5 + R), "row-parallel, split input")


def small_block(kv_heads=None, seed=0):
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=8, n_layer=1, n_head=2 * P, n_embd=8 * P, block_size=32, n_kv_head=kv_heads)
    return ParallelBlock(GPT(config).double().blocks[0], C)


@pytest.mark.parametrize("chunks", [1, 2, 5, 13])
def test_overlapped_attention_and_block_equal_the_plain_ones(chunks):
    block = small_block()
    x = replicated(2, 11, 8 * P, seed=6)  # (b, s, h); 13 chunks > 11 positions: one per position
    assert_same(block.attention, overlapped(block.attention, chunks), x, f"attention k={chunks}")
    assert_same(block, overlapped(block, chunks), x, f"block k={chunks}")


@pytest.mark.parametrize("chunks", [1, 2, 3, 5])
def test_block_split_into_micro_batches_equals_the_plain_one(chunks):
    """split="batch": k micro-batches (5 > the batch of 4: one per sequence), QKV per micro-batch; the
    causal GQA block with rotary positions too."""
    x = replicated(4, 7, 8 * P, seed=8)
    block = small_block()
    assert_same(block, overlapped(block, chunks, split="batch"), x, f"micro-batches k={chunks}")
    torch.manual_seed(1)
    config = GPTConfig(vocab_size=8, n_layer=1, n_head=2 * P, n_kv_head=1, n_embd=8 * P, block_size=32,
                       norm="rmsnorm", mlp="swiglu", position="rope", bias=False)
    gqa = ParallelBlock(GPT(config).double().blocks[0], C)
    assert_same(gqa, overlapped(gqa, chunks, split="batch"), x, f"GQA micro-batches k={chunks}")
    with pytest.raises(ValueError, match="split"):
        overlapped(small_block(), 2, split="heads")


@pytest.mark.parametrize("split, chunks, tail, pieces", [("batch", 2, 3, 3), ("batch", 4, 2, 2), ("sequence", 3, 4, 4),
                                                          ("sequence", 2, 50, 12)])
def test_block_with_its_last_mlp_cut_into_pieces_equals_the_plain_one(split, chunks, tail, pieces):
    """tail=t: the last chunk's MLP in t pieces of tokens (50 > its 4·3 tokens: one piece per token)."""
    block, x = small_block(), replicated(4, 7, 8 * P, seed=9)
    layer = overlapped(block, chunks, split=split, tail=tail)
    assert_same(block, layer, x, f"{split} k={chunks} tail={tail}")
    with torch.no_grad():  # without autograd the chunks are written straight into the output
        y, y2 = block(x), layer(x)
    agree(torch.allclose(y, y2, **TOL), f"no_grad {split} k={chunks} tail={tail}: {(y - y2).abs().max():.2e}")
    agree(len(collectives_of(layer, x)) == 2 * chunks - 1 + pieces, "one all-reduce per piece")
    with pytest.raises(ValueError, match="tail"):
        overlapped(block, 2, tail=0)


@pytest.mark.parametrize("chunks, tail", [(1, 1), (2, 1), (3, 2), (4, 5)])
def test_micro_batches_through_a_stack_of_blocks_equal_the_blocks_in_turn(chunks, tail):
    """MicroBatchPipeline: overlap across layers; values and all gradients as the plain stack."""
    blocks = [small_block(seed=s) for s in range(3)]
    stack, x = nn.Sequential(*blocks), replicated(4, 6, 8 * P, seed=11)
    pipeline = overlapped(blocks, chunks, split="batch", tail=tail)
    assert_same(stack, pipeline, x, f"stack of 3, k={chunks}, tail={tail}")
    with torch.no_grad():  # without autograd each micro-batch's last add writes into the output
        y, y2 = stack(x), pipeline(x)
    agree(torch.allclose(y, y2, **TOL), f"no_grad stack k={chunks}: {(y - y2).abs().max():.2e}")
    pieces = min(tail, 6 * (4 // chunks if 4 % chunks == 0 else 1))  # tokens of the last micro-batch
    agree(len(collectives_of(pipeline, x)) == 2 * 3 * min(chunks, 4) - 1 + pieces, "one all-reduce per step")
    with pytest.raises(ValueError, match="split='batch'"):
        overlapped(blocks, 2)


def test_a_stack_generating_with_kv_caches_runs_each_block_on_its_own_cache():
    blocks = [small_block(seed=s) for s in range(2)]
    pipeline, x = overlapped(blocks, 2, split="batch"), replicated(2, 5, 8 * P, seed=12)
    with torch.no_grad():
        plain_caches, caches = [{}, {}], [{}, {}]
        y = x
        for block, cache in zip(blocks, plain_caches):
            y = block(y, cache)
        y2 = pipeline(x, caches)
    agree(torch.allclose(y, y2, **TOL), f"prefill with caches: {(y - y2).abs().max():.2e}")
    with pytest.raises(ValueError, match="one cache dict per block"):
        pipeline(x, {})


def test_notebook_check_of_blocks_and_stacks_reports_rounding_only():
    from tplab.overlap import experiments

    shape = dict(hidden=8 * P, heads=2 * P, seq=6, batch=3)
    rows = experiments.check_block((1, 2, 3), **shape) + experiments.check_block((2, 3), ("batch",), 2, 2, **shape)
    agree(len(rows) == 8 and all(r["max |y - y_plain|"] < 1e-12 and r["max |dx - dx_plain|"] < 1e-12 for r in rows),
          f"{rows}")


def test_overlapped_gqa_block_with_rotary_and_cache():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=8, n_layer=1, n_head=2 * P, n_kv_head=1, n_embd=8 * P, block_size=32,
                       norm="rmsnorm", mlp="swiglu", position="rope", bias=False)
    block = ParallelBlock(GPT(config).double().blocks[0], C)
    x = replicated(2, 9, 8 * P, seed=7)
    assert_same(block, overlapped(block, 3), x, "GQA + rotary + SwiGLU block")
    with torch.no_grad():  # with a KV cache (one new token) the plain layer runs
        y, y2 = block(x[:, :1], {}), overlapped(block, 3)(x[:, :1], {})
    agree(torch.equal(y, y2), "cached step")


def test_sequence_parallel_attention_is_refused_clearly():
    attention = ParallelAttention(8 * P, 2 * P, C, sequence_parallel=True, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="sequence-parallel attention"):
        overlapped(attention, 2)


def test_collectives_of_counts_one_per_chunk():
    block = small_block()
    x = replicated(2, 8, 8 * P, seed=8)
    plain = collectives_of(block, x)
    agree([c[0] for c in plain] == ["allreduce", "allreduce"], f"plain block: {plain}")
    chunked = collectives_of(overlapped(block, 4), x)
    agree(len(chunked) == 8 and sum(np.prod(c[1]) for c in chunked) == 2 * 2 * 8 * 8 * P, f"k=4: {chunked}")


# ---- timelines and the sweep -----------------------------------------------------------------------------------------
def test_tracer_intervals_and_chrome_trace(tmp_path_factory):
    block = small_block()
    x = replicated(2, 8, 8 * P, seed=9)
    tracer = Tracer(C)
    with tracer, torch.no_grad():
        overlapped(block, 4)(x)
        with tracer.span("extra", kind="compute"):
            pass
    df = tracer.gather()
    if R == 0:
        ok = (set(df["rank"]) == set(range(P)) and (df["end"] >= df["start"]).all() and (df["start"] >= -1e-3).all()
              and {"compute", "comm"} <= set(df["kind"]) and "progress thread" in set(df["lane"])
              and (df["kind"] == "comm").sum() == 8 * P)
        trace = json.loads(json.dumps(chrome_trace(df)))
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        ok = ok and len(spans) == len(df) and all(
            {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] >= 0 and 0 <= e["pid"] < P for e in spans)
    else:
        ok = df is None
    agree(ok, "tracer or Chrome trace")


def test_overlap_sweep_runs_and_is_the_same_everywhere():
    up, down = dense_mlp(8, 4 * P)
    mlp = ParallelMLP.from_dense(up, down, C)
    df = overlap_sweep(mlp, replicated(16, 8, seed=10), C, [1, 2], iters=1, warmup=0, progress=False)
    ok = list(df["chunks"]) == [1, 2] and (df[["compute_ms", "comm_ms", "overlapped_ms"]] > 0).all().all()
    agree(ok and same_on_every_rank(df.to_csv()), f"sweep:\n{df}")
    agree((df["max_rel_diff"] < 1e-12).all(), f"the timed overlapped layer computes the layer:\n{df}")
