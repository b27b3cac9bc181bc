"""tplab's hand-written collectives on GPU memory, on every GPU transport, against NCCL's own collectives.

For each transport (NCCL point-to-point, MPI staged naive / pipelined), algorithm, dtype and count:
- integers equal NCCL's all-reduce exactly, float sums lie within the rounding bound of a p-term sum;
- the result is bitwise identical on every rank, a CuPy array on this rank's GPU, and the input is unchanged;
- torch CUDA tensors (float32 and bfloat16) come back as torch tensors of the same dtype and device.
"""

from gputest import require_gpu

require_gpu()

import cupy  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpitest import COMM, agree, same_on_every_rank  # noqa: E402

import tplab  # noqa: E402
from tplab.toolkit.blocks import block_bounds  # noqa: E402
from tplab.comm import StagedComm, nccl_world, world  # noqa: E402

P = COMM.size
NCCL = nccl_world()
TRANSPORTS = {"nccl": NCCL, "staged-naive": StagedComm(world(), mode="naive"),
              "staged-pipelined": StagedComm(world(), mode="pipelined", chunk_bytes=4096)}
DTYPES = ["int32", "int64", "float32", "float64", "float16"]
COUNTS = sorted({0, 1, 7, P + 1, 1000, 4099})


def rank_input(count, dtype, seed=0):
    rng = np.random.default_rng([seed, count, COMM.rank])
    dt = np.dtype(dtype)
    host = rng.integers(-1000, 1000, size=count) if dt.kind in "iu" else rng.standard_normal(count)
    return cupy.asarray(host.astype(dt))


def within_rounding(got, want, x, part=slice(None)) -> tuple[bool, str]:
    """Integers exactly; floats within p * eps * sum over ranks of |x| (the bound of a p-term sum).
    ``got`` and ``want`` are ``part`` of the reduced vector. Collective."""
    got, want = cupy.asnumpy(got).astype(np.float64), cupy.asnumpy(want).astype(np.float64)
    scale = np.empty(x.size)
    COMM.Allreduce(np.abs(cupy.asnumpy(x).astype(np.float64)), scale)
    if x.dtype.kind in "iu":
        bad = np.count_nonzero(got != want)
        return bad == 0, f"{bad} elements differ"
    scale = scale[part]
    err = np.abs(got - want)
    bound = 2 * P * np.finfo(x.dtype).eps * scale + np.finfo(x.dtype).tiny
    return bool(np.all(err <= bound)), f"max error {err.max(initial=0):.3g}, bound {bound.max(initial=0):.3g}"


def cuda_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    return torch


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_every_allreduce_matches_nccl(transport):
    comm, failures = TRANSPORTS[transport], []
    for algorithm in tplab.ALGORITHMS["allreduce"]:
        for dtype in DTYPES:
            for count in COUNTS:
                x = rank_input(count, dtype)
                before = x.copy()
                got = tplab.allreduce(x, comm, algorithm=algorithm)
                want = NCCL.builtin_allreduce(x, "sum")
                ok, why = within_rounding(got, want, x)
                ok = ok and isinstance(got, cupy.ndarray) and got.dtype == x.dtype and got.shape == x.shape
                ok = ok and bool((x == before).all()) and got.device.id == x.device.id
                if not (ok and same_on_every_rank(cupy.asnumpy(got).tobytes())):
                    failures.append(f"{algorithm} {dtype} n={count}: {why}")
    agree(not failures, "; ".join(failures[:5]))


def test_other_collectives_match_nccl():
    failures = []
    for dtype in ["int32", "float32"]:
        for count in COUNTS:
            x = rank_input(count, dtype, seed=1)
            lo, hi = block_bounds(count, P)[COMM.rank : COMM.rank + 2]  # my block, cut like array_split
            for algorithm in tplab.ALGORITHMS["reduce_scatter"]:
                got = tplab.reduce_scatter(x, NCCL, algorithm=algorithm)
                ok, why = within_rounding(got, NCCL.builtin_allreduce(x, "sum")[lo:hi], x, slice(lo, hi))
                if not ok or got.size != hi - lo:
                    failures.append(f"reduce_scatter {algorithm} {dtype} n={count}: {why}")
            mine = x[: count - COMM.rank % 2] if count else x  # allgather: ranks may contribute different lengths
            for algorithm in tplab.ALGORITHMS["allgather"]:
                got, want = tplab.allgather(mine, NCCL, algorithm=algorithm), NCCL.builtin_allgather(mine)
                if not bool((got == want).all()) or got.size != sum(COMM.allgather(mine.size)):
                    failures.append(f"allgather {algorithm} {dtype} n={count}")
            for algorithm in tplab.ALGORITHMS["broadcast"]:
                got = tplab.broadcast(x, NCCL, root=P - 1, algorithm=algorithm)
                want = NCCL.builtin_broadcast(x, root=P - 1)
                if not bool((got == want).all()) or not same_on_every_rank(cupy.asnumpy(got).tobytes()):
                    failures.append(f"broadcast {algorithm} {dtype} n={count}")
            for algorithm in tplab.ALGORITHMS["reduce"]:
                got = tplab.reduce(x, NCCL, root=0, algorithm=algorithm)
                want = NCCL.builtin_allreduce(x, "sum")
                ok, why = within_rounding(want if got is None else got, want, x)  # (collective: all ranks)
                if COMM.rank != 0:
                    ok, why = got is None, "a result off the root"
                if not ok:
                    failures.append(f"reduce {algorithm} {dtype} n={count}: {why}")
    agree(not failures, "; ".join(failures[:5]))


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "rabenseifner", "builtin"])
def test_torch_cuda_tensors_float32_and_bfloat16(algorithm):
    torch = cuda_torch()
    device = torch.device("cuda", cupy.cuda.runtime.getDevice())
    failures = []
    for dtype, rel in [(torch.float32, 1e-6), (torch.bfloat16, 2.0 ** -7)]:
        for count in [1, 7, 1000, 4099]:
            g = torch.Generator(device="cpu").manual_seed(1000 * COMM.rank + count)
            x = torch.randn(count, generator=g).to(device=device, dtype=dtype)
            before = x.clone()
            got = tplab.allreduce(x, NCCL, algorithm=algorithm)
            gathered = tplab.allgather(x, NCCL, algorithm="ring" if algorithm == "builtin" else "recursive_doubling")
            piece = tplab.reduce_scatter(x, NCCL, algorithm="ring")
            exact = np.zeros(count)
            COMM.Allreduce(x.float().cpu().numpy().astype(np.float64), exact)
            scale = np.zeros(count)
            COMM.Allreduce(np.abs(x.float().cpu().numpy().astype(np.float64)), scale)
            err = np.abs(got.float().cpu().numpy() - exact)
            ok = (isinstance(got, torch.Tensor) and got.dtype == dtype and got.device == device
                  and torch.equal(x, before) and bool(np.all(err <= P * rel * scale + 1e-30))
                  and gathered.dtype == dtype and gathered.numel() == P * count and piece.dtype == dtype)
            if not (ok and same_on_every_rank(got.float().cpu().numpy().tobytes())):
                failures.append(f"{dtype} n={count}: max error {err.max():.3g}")
    agree(not failures, "; ".join(failures[:5]))


def test_point_to_point_posted_before_waiting_does_not_deadlock():
    """isend to the right and irecv from the left, both posted before any wait: a ring shift. NCCL
    would hang if the two were issued one by one; NcclComm issues them as one group."""
    torch = cuda_torch()
    device = torch.device("cuda", cupy.cuda.runtime.getDevice())
    right, left = (COMM.rank + 1) % P, (COMM.rank - 1) % P
    mine = torch.full((1000,), float(COMM.rank), device=device)
    theirs = torch.empty_like(mine)
    NCCL.reset_counters()
    requests = [NCCL.irecv(theirs, left), NCCL.isend(mine, right)]
    NCCL.waitall(requests)
    shifted = cupy.full(10, COMM.rank, dtype=cupy.int64)
    back = NCCL.sendrecv(shifted, left, cupy.empty_like(shifted), right)
    ok = bool((theirs == left).all()) and int(back[0]) == right
    ok = ok and NCCL.bytes_sent == mine.numel() * 4 + shifted.nbytes
    agree(ok, f"got {theirs[0].item()} (want {left}), {int(back[0])} (want {right}), {NCCL.bytes_sent} B counted")


def test_host_arrays_on_host_mpi_and_gpu_arrays_refused_there():
    x = cupy.arange(5, dtype=np.float32)
    with pytest.raises(tplab.CollectiveArgumentError, match="moves host memory"):  # on every rank
        tplab.allreduce(x, world(), algorithm="ring")
    host = np.arange(5, dtype=np.float32)
    out = tplab.allreduce(host, TRANSPORTS["staged-pipelined"], algorithm="ring")  # staged passes numpy through
    agree(isinstance(out, np.ndarray) and np.array_equal(out, host * P))


def test_torch_tensors_through_nccl_replay_from_a_cuda_graph():
    """tplab's collectives over tplab.comm.nccl captured in a CUDA graph (torch's), replayed with new inputs:
    bitwise the results of eager calls on those inputs. (What CuPy allocates inside the capture comes from
    torch's graph pool: tplab.toolkit.arrays.gpu_scope.) Last in this file: the ring's point-to-point
    messages go last of all."""
    torch = cuda_torch()
    device = torch.device("cuda", cupy.cuda.runtime.getDevice())
    calls = {"allreduce builtin": lambda x: tplab.allreduce(x, NCCL, algorithm="builtin"),
             "allgather builtin": lambda x: tplab.allgather(x, NCCL, algorithm="builtin"),
             "reduce_scatter builtin": lambda x: tplab.reduce_scatter(x, NCCL, algorithm="builtin"),
             "allreduce ring": lambda x: tplab.allreduce(x, NCCL, algorithm="ring")}
    for name, call in calls.items():
        for dtype in (torch.float32, torch.bfloat16):
            static = torch.zeros(4 * P + 3, device=device, dtype=dtype)
            call(static)                                    # (eagerly first: plans, NCCL's own set-up)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = call(static)
            for seed in range(3):
                g = torch.Generator(device="cpu").manual_seed(100 * COMM.rank + seed)
                static.copy_(torch.randn(static.numel(), generator=g).to(dtype))
                graph.replay()
                want = call(static)
                torch.cuda.synchronize()
                agree(torch.equal(out, want), f"{name} {dtype}, replay {seed}: differs from the eager call")
