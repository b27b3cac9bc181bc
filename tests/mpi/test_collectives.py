"""Every hand-written collective against the MPI library's own, on every rank, for many inputs.

Properties checked for each drawn example (count, dtype, op, algorithm, memory layout, root):
- integers, and max/min on any dtype, equal the MPI built-in exactly; float sums and products within
  the rounding bound of a p-term reduction;
- the result is bitwise identical on every rank;
- the caller's input is unchanged; shape and dtype are right.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpitest import COMM, abort_on_exception, agree, rearm_watchdog, same_on_every_rank

import tplab
from tplab.toolkit.blocks import block_bounds
from tplab.collectives.snapshots import recording
from tplab.comm import world

P = COMM.size
COMM_T = world(timeout=10)  # a deadlock inside an algorithm raises instead of hanging
DTYPES = ["int32", "int64", "float32", "float64", "float16"]
OPS = ["sum", "prod", "max", "min"]
LAYOUTS = ["contiguous", "strided", "2d-transposed"]

# counts that break naive block arithmetic (0, 1, fewer than p, around p, odd) plus arbitrary ones
counts = st.one_of(st.sampled_from(sorted({0, 1, max(P - 1, 0), P, P + 1, 2 * P + 1, 7})), st.integers(0, 2500))


def algorithms_of(collective):
    return [a for a in tplab.ALGORITHMS[collective]]


def make_input(count, dtype, op, seed, layout):
    """Different data on every rank, in the requested memory layout (possibly non-contiguous)."""
    rng = np.random.default_rng([seed, COMM.rank])
    dt = np.dtype(dtype)
    if dt.kind == "i":
        if op == "sum":  # the full range: sums wrap around, identically in every order
            info = np.iinfo(dt)
            values = rng.integers(info.min, info.max, size=count, dtype=dt, endpoint=True)
        else:
            values = rng.integers(-3, 4, size=count).astype(dt)
    elif op == "prod":  # magnitudes near 1 so p factors neither overflow nor underflow
        values = (rng.uniform(0.5, 2.0, size=count) * rng.choice([-1, 1], size=count)).astype(dt)
    else:
        values = rng.standard_normal(count).astype(dt)
    if layout == "strided":
        base = np.zeros(2 * count, dtype=dt)
        base[::2] = values
        return base[::2]
    if layout == "2d-transposed" and count % 2 == 0:
        return values.reshape(2, count // 2).T  # Fortran-ordered view: not C-contiguous
    return values


def abs_sum(x):
    """sum over ranks of |x| (float64), the scale of the rounding error of a sum. Collective."""
    out = np.empty(np.asarray(x).size, dtype=np.float64)
    COMM.Allreduce(np.abs(np.asarray(x, dtype=np.float64)).reshape(-1), out)
    return out


def matches(result, reference, op, scale=None):
    """Exact where arithmetic is exact; otherwise within the rounding bound of p combinations.
    ``scale``: abs_sum(x) for float sums (flat, matching the result's elements)."""
    if result.dtype.kind in "iu" or op in ("max", "min"):
        return np.array_equal(result, reference), "differs from MPI built-in"
    eps, tiny = np.finfo(result.dtype).eps, np.finfo(result.dtype).tiny
    res, ref = result.astype(np.float64).reshape(-1), reference.astype(np.float64).reshape(-1)
    bound = (2 * P * eps * scale if op == "sum" else 4 * P * eps * np.abs(ref)) + tiny
    err = np.abs(res - ref)
    worst = float(np.max(err - bound)) if err.size else 0.0
    return bool(np.all(err <= bound)), f"beyond rounding bound by {worst:.3g}"


def needs_scale(op, dtype):
    return op == "sum" and np.dtype(dtype).kind == "f"


def check_common(result, x, x_before, shape, dtype):
    problems = []
    if not np.array_equal(np.asarray(x).tobytes(), x_before):
        problems.append("input was modified")
    if result.shape != shape:
        problems.append(f"shape {result.shape} != {shape}")
    if result.dtype != np.dtype(dtype):
        problems.append(f"dtype {result.dtype} != {dtype}")
    return problems


@given(count=counts, dtype=st.sampled_from(DTYPES), op=st.sampled_from(OPS),
       algorithm=st.sampled_from(algorithms_of("allreduce")), layout=st.sampled_from(LAYOUTS),
       seed=st.integers(0, 2**16))
@abort_on_exception
def test_allreduce_matches_builtin(count, dtype, op, algorithm, layout, seed):
    rearm_watchdog()
    agree(same_on_every_rank((count, dtype, op, algorithm, layout, seed)), "ranks drew different examples")
    x = make_input(count, dtype, op, seed, layout)
    before = np.asarray(x).tobytes()
    result = tplab.allreduce(x, COMM_T, op=op, algorithm=algorithm)
    reference = COMM_T.builtin_allreduce(np.ascontiguousarray(x), op)
    scale = abs_sum(x) if needs_scale(op, dtype) else None
    problems = check_common(result, x, before, x.shape, dtype)
    ok, why = matches(result, reference, op, scale)
    agree(ok and not problems, f"{algorithm} {op} {dtype} n={count} {layout}: {why if not ok else ''} {problems}")
    agree(same_on_every_rank(result.tobytes()), f"{algorithm}: results differ between ranks")


@given(count=counts, dtype=st.sampled_from(DTYPES), op=st.sampled_from(OPS),
       algorithm=st.sampled_from(algorithms_of("reduce_scatter")), layout=st.sampled_from(LAYOUTS),
       seed=st.integers(0, 2**16))
@abort_on_exception
def test_reduce_scatter_matches_builtin(count, dtype, op, algorithm, layout, seed):
    rearm_watchdog()
    x = make_input(count, dtype, op, seed, layout)
    before = np.asarray(x).tobytes()
    result = tplab.reduce_scatter(x, COMM_T, op=op, algorithm=algorithm)
    reference = COMM_T.builtin_reduce_scatter(x, op)
    expected_len = len(np.array_split(np.arange(count), P)[COMM.rank])
    problems = check_common(result, x, before, (expected_len,), dtype)
    bounds = block_bounds(count, P)
    scale = abs_sum(x)[bounds[COMM.rank]:bounds[COMM.rank + 1]] if needs_scale(op, dtype) else None
    ok, why = matches(result, reference, op, scale) if not problems else (False, "")
    agree(ok and not problems, f"{algorithm} {op} {dtype} n={count}: {why} {problems}")


@given(base_count=counts, extra=st.lists(st.integers(0, 40), min_size=8, max_size=8),
       dtype=st.sampled_from(DTYPES), algorithm=st.sampled_from(algorithms_of("allgather")),
       layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2**16))
def test_allgather_matches_builtin(base_count, extra, dtype, algorithm, layout, seed):
    """Ranks contribute different lengths (allgatherv), some possibly zero."""
    rearm_watchdog()
    count = base_count + extra[COMM.rank % 8]
    x = make_input(count, dtype, "sum", seed, layout)
    before = np.asarray(x).tobytes()
    result = tplab.allgather(x, COMM_T, algorithm=algorithm)
    reference = np.concatenate([np.asarray(a).reshape(-1) for a in COMM.allgather(np.ascontiguousarray(x))])
    problems = check_common(result, x, before, reference.shape, dtype)
    ok = not problems and np.array_equal(result, reference)
    agree(ok, f"{algorithm} {dtype} n={count}: {problems or 'wrong values'}")
    agree(same_on_every_rank(result.tobytes()), f"{algorithm}: results differ between ranks")


@given(count=counts, dtype=st.sampled_from(DTYPES), algorithm=st.sampled_from(algorithms_of("broadcast")),
       root=st.integers(0, 7), layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2**16))
def test_broadcast_matches_builtin(count, dtype, algorithm, root, layout, seed):
    rearm_watchdog()
    root %= P
    x = make_input(count, dtype, "sum", seed, layout)
    before = np.asarray(x).tobytes()
    result = tplab.broadcast(x, COMM_T, root=root, algorithm=algorithm)
    reference = COMM_T.builtin_broadcast(x, root).reshape(x.shape)
    problems = check_common(result, x, before, x.shape, dtype)
    agree(not problems and np.array_equal(result, reference), f"{algorithm} root={root}: {problems or 'wrong'}")


@given(count=counts, dtype=st.sampled_from(DTYPES), op=st.sampled_from(OPS),
       algorithm=st.sampled_from(algorithms_of("reduce")), root=st.integers(0, 7),
       layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2**16))
def test_reduce_matches_builtin(count, dtype, op, algorithm, root, layout, seed):
    rearm_watchdog()
    root %= P
    x = make_input(count, dtype, op, seed, layout)
    before = np.asarray(x).tobytes()
    result = tplab.reduce(x, COMM_T, root=root, op=op, algorithm=algorithm)
    reference = COMM_T.builtin_reduce(x, op, root)
    scale = abs_sum(x) if needs_scale(op, dtype) else None  # collective: every rank computes it
    if COMM.rank == root:
        problems = check_common(result, x, before, x.shape, dtype)
        ok, why = matches(result, reference, op, scale) if not problems else (False, "")
    else:
        problems = [] if result is None else ["non-root rank got a result"]
        ok, why = True, ""
    agree(ok and not problems, f"{algorithm} {op} {dtype} root={root} n={count}: {why} {problems}")


@pytest.mark.parametrize("algorithm", algorithms_of("allreduce"))
def test_allreduce_large_message(algorithm):
    """A few MiB in float64: long-message paths (segmented blocks, big buffers)."""
    count = 3 * 2**17 + 5
    x = make_input(count, "float64", "sum", 7, "contiguous")
    result = tplab.allreduce(x, COMM_T, algorithm=algorithm)
    ok, why = matches(result, COMM_T.builtin_allreduce(x, "sum"), "sum", abs_sum(x))
    agree(ok, why)
    agree(same_on_every_rank(result.tobytes()), "results differ between ranks")


def test_torch_cpu_tensors_round_trip():
    torch = pytest.importorskip("torch")
    x = torch.arange(10, dtype=torch.float64).reshape(2, 5) + COMM.rank
    y = tplab.allreduce(x, COMM_T, algorithm="ring")
    expected = torch.arange(10, dtype=torch.float64).reshape(2, 5) * P + P * (P - 1) / 2
    agree(isinstance(y, torch.Tensor) and torch.equal(y, expected), f"got {y!r}")
    g = tplab.allgather(torch.full((COMM.rank + 1,), COMM.rank, dtype=torch.int32), COMM_T)
    agree(g.tolist() == [r for r in range(P) for _ in range(r + 1)], f"allgather got {g.tolist()}")


@pytest.mark.parametrize("algorithm", ["naive", "ring", "recursive_doubling", "rabenseifner", "tree"])
def test_snapshots_end_with_every_contribution(algorithm):
    """Contributing 2**rank with op sum makes each element a bit mask of the ranks summed into it:
    the last snapshot must hold all p bits, everywhere, on every rank."""
    x = np.full(2 * P + 1, 2**COMM.rank, dtype=np.int64)
    with recording() as steps:
        result = tplab.allreduce(x, COMM_T, algorithm=algorithm)
    agree(steps and steps[0][0] == "start", f"first snapshot {steps[:1]}")
    agree(np.all(result == 2**P - 1), f"result {result}")
    if P > 1:
        agree(np.array_equal(steps[-1][1], result), f"last snapshot {steps[-1]} != result")

