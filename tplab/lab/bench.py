"""Timing collectives honestly, on every rank at once, in the field's conventions.

One point = validate once against the MPI built-in (#wrong), warm up, then ``iters`` timed calls, each
started together (barrier) and timed on every rank with a monotonic clock. Two ways to boil the
(ranks x iterations) times down to one number:

    nccl-tests style (default)  time_us = max over ranks of the median over iterations: robust to the odd
                                descheduled rank when ranks share cores, and the slowest rank decides
    OSU style (osu=True)        avg_us = the mean over iterations and ranks ("Avg Latency(us)"), with the
                                min and max over ranks of their means; iterations as osu_allreduce does
                                (1000 + 100 warm-up up to 8 KiB, then 100 + 10)

Argument checks are off while timing (``check=False``): they are not part of the algorithm.

Sizes follow nccl-tests: ``size`` is S in bytes, with algbw = S / time and busbw = algbw x factor:
allreduce S = bytes per rank, factor 2(p-1)/p; reduce_scatter S = the full input vector, allgather
S = the gathered total, both factor (p-1)/p; broadcast and reduce S = the message, factor 1.

    rows = sweep("allreduce", ["ring", "builtin"], sizes=[8, 1024, 1 << 20], csv="runs.csv")
    pandas.DataFrame(rows)   # identical on every rank; the CSV grows point by point and a rerun resumes

On GPUs (``device="gpu"``, or any ``comm`` that moves GPU memory, such as ``tplab.comm.nccl_world()``) the
input is a CuPy array on this rank's GPU, the built-in is NCCL's, and each call is timed with CUDA events
on the current stream, started together (the stream drained, then a barrier): the time the GPU waited
for the host (Python, launches) counts too.
"""

from __future__ import annotations

import csv
import os
import time

import numpy as np

import tplab
from tplab.comm import world
from tplab.toolkit.arrays import array_module, external_stream
from tplab.comm import communicator
from tplab.comm.devices import to_device
from tplab.lab import anchors
from tplab.lab.anchors import ANCHORS
from tplab.toolkit.ops import sum_tolerance

BUS_FACTOR = {  # nccl-tests' bus-bandwidth factors
    "allreduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "allgather": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
}
KEY = ("collective", "algorithm", "ranks", "size", "type", "redop", "mode")  # what identifies a point


def elements_per_rank(collective: str, size: int, p: int, itemsize: int) -> int:
    """How many elements each rank passes in for an nccl-tests size S (at least one)."""
    per_rank = size // p if collective == "allgather" else size
    return max(per_rank // itemsize, 1)


def _call(collective, x, comm, algorithm, op, check=False):
    fn = getattr(tplab, collective)
    if collective in ("allgather", "broadcast"):
        return fn(x, comm, algorithm=algorithm, check=check)
    return fn(x, comm, op=op, algorithm=algorithm, check=check)


def _builtin(collective, x, comm, op):
    comm = getattr(comm, "inner", comm)  # an emulated network's builtins would bypass it: ask the real one
    if collective == "allgather":
        return comm.builtin_allgather(x)
    if collective == "broadcast":
        return comm.builtin_broadcast(x, 0)
    if collective == "reduce":
        return comm.builtin_reduce(x, op, 0)
    return getattr(comm, f"builtin_{collective}")(x, op)


def count_wrong(collective, algorithm, x, comm, op) -> int:
    """Elements (summed over ranks) that differ from the MPI built-in: exactly for integers and
    max/min, beyond the rounding bound of p combinations for float sums and products."""
    return _wrong(collective, _call(collective, x, comm, algorithm, op, check=True), _builtin(collective, x, comm, op),
                  x, comm, op)


def _wrong(collective, got, want, x, comm, op) -> int:
    """count_wrong's comparison of ``got`` with the built-in's ``want`` (collective: summed over ranks)."""
    xp = array_module(x)  # numpy, or CuPy: GPU results are compared on the GPU (no copies of 256 MiB to the host)
    if got is None or want is None:  # reduce: only the root holds a result
        wrong = 0 if (got is None) == (want is None) else max(x.size, 1)
    elif got.dtype.kind in "iu" or op in ("max", "min") or collective in ("allgather", "broadcast"):
        wrong = int(xp.count_nonzero(got != want))
    else:
        tolerance = sum_tolerance(comm.size, np.finfo(got.dtype).eps)
        scale = xp.maximum(xp.abs(want.astype(np.float64)), 1.0)
        # (not "> tolerance": a NaN compares false either way, and a NaN where the built-in has a number is wrong)
        wrong = int(xp.count_nonzero(~(xp.abs(got.astype(np.float64) - want) <= tolerance * scale)))
    return sum(comm.allgather_object(wrong))


def peer_memory_failure(comm) -> str:
    """What a communicator's peer memory (PeerMemoryComm.peers) found wrong since the last look, on any rank
    ('' if nothing; the same on every rank). A peer-memory call that timed out or disagreed stops its kernels
    without writing, and only the next call would raise -- after a benchmark point that is never: its timings and
    an in-place result would then be silently wrong. Collective (one host all-gather) where ``comm`` has one."""
    peers = getattr(comm, "peers", None)
    if peers is None or not hasattr(peers, "raise_pending"):
        return ""
    mine = ""
    try:
        peers.raise_pending()
    except Exception as error:  # noqa: BLE001 - any of them: reported on every rank below
        mine = f"rank {comm.rank}: {type(error).__name__}: {error}"
    return "; ".join(said for said in comm.allgather_object(mine) if said)


REGISTERED = "peer_registered"  # tplab's kernels on an input already in the shared buffer, in place


def _registered_allreduce(comm, x, validate):
    """(run, wrong) as anchors.prepare: ``run()`` sums, in place, ``x``'s values copied once into this rank's
    shared buffer (PeerMemory.buffer), by the kernel "auto" picks for the size (two_shot on such an input
    pulls the chunks and meets its peers twice): like for like with torch's symmetric-memory anchors, whose
    input also lies in shared memory. ``comm``: a PeerMemoryComm."""
    peers = comm.peers
    buf = peers.buffer(x.size, x.dtype)
    buf[...] = x
    launch = peers.allreduce_init(buf, buf, "auto")

    def run():
        launch()
        return buf
    wrong = -1
    if validate:
        wrong = _wrong("allreduce", run().copy(), _builtin("allreduce", x, comm, "sum"), x, comm, "sum")
        buf[...] = x
    return run, wrong


def osu_iterations(size: int) -> tuple[int, int]:
    """(timed, warm-up) iterations as OSU's osu_allreduce chooses them."""
    return (1000, 100) if size <= 8192 else (100, 10)


def _timed_on_gpu(fn, comm, iters) -> np.ndarray:
    """Seconds of each of ``iters`` calls, by CUDA events on the current stream; each call starts together
    (comm.barrier: this rank's GPU work finished, then every rank)."""
    import cupy

    stream, events = cupy.cuda.get_current_stream(), []
    for _ in range(iters):
        comm.barrier()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        events.append((start, end))
    stream.synchronize()
    return np.array([cupy.cuda.get_elapsed_time(start, end) / 1e3 for start, end in events])


def _timed_in_graph(fn, comm, iters, reps: int = 7) -> np.ndarray:
    """Seconds per call of ``iters`` calls captured in one CUDA graph, one entry per replay (``reps``, each
    started together): the GPU's own time, without the host's launches. Captured on a side stream that
    torch and CuPy both take as current (plans are made per stream; the first call makes this one's)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), external_stream(stream.cuda_stream):
        fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream), external_stream(stream.cuda_stream):
        for _ in range(iters):
            fn()
    graph.replay()
    seconds = []
    for _ in range(reps):
        torch.cuda.synchronize()
        comm.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3 / iters)
    return np.array(seconds)


def time_collective(collective, algorithm, size, *, dtype="float32", op="sum", iters=None, warmup=3,
                    comm=None, osu=False, validate=True, device="cpu", graph=False) -> dict:
    """Measure one point; returns one row (the same on every rank). ``iters``: timed calls (default 20; with
    ``osu``, OSU's counts unless given). ``graph``: on GPUs, ``iters`` calls replayed from a CUDA graph
    (mode "graph"). ``algorithm`` may name an anchor (tplab.lab.anchors: NCCL, NCCL's symmetric kernels,
    torch's symm_mem; all-reduce on GPUs, after ``anchors.start``). ``comm`` defaults to the communicator
    for ``device`` (tplab.comm.communicator: the world on "cpu", NCCL on the bound GPU for "gpu")."""
    comm = comm or communicator(device)
    gpu = comm.moves_gpu_memory
    dt = np.dtype(dtype)
    count = elements_per_rank(collective, size, comm.size, dt.itemsize)
    rng = np.random.default_rng([count, comm.rank])
    x = (rng.integers(-8, 9, size=count) if dt.kind in "iu" else rng.uniform(-1, 1, size=count)).astype(dt)
    x = to_device(x, "gpu") if gpu else x
    if algorithm in ANCHORS:
        run, wrong = anchors.prepare(algorithm, x, validate)
    elif algorithm == REGISTERED:
        run, wrong = _registered_allreduce(comm, x, validate)
    else:
        wrong = count_wrong(collective, algorithm, x, comm, op) if validate else -1

        def run():
            return _call(collective, x, comm, algorithm, op)
    if osu and iters is None:
        iters, warmup = osu_iterations(size)
    iters = 20 if iters is None else iters
    for _ in range(warmup):
        run()
    if gpu:
        mine = (_timed_in_graph if graph else _timed_on_gpu)(run, comm, iters)
        failure = peer_memory_failure(comm)   # (after the validation, the warm-up and the timed calls)
        if failure:
            raise RuntimeError(f"{collective} {algorithm} at {size} bytes: the peer memory failed ({failure})")
    else:
        mine = np.empty(iters)
        for i in range(iters):
            comm.barrier()
            t0 = time.perf_counter()
            run()
            mine[i] = time.perf_counter() - t0
    everyone = np.array(comm.allgather_object(mine.tolist()))  # (ranks, iterations)
    nbytes = count * dt.itemsize * (comm.size if collective == "allgather" else 1)
    if osu:
        per_rank = everyone.mean(axis=1)
        t, lo, hi = float(per_rank.mean()), float(per_rank.min()), float(per_rank.max())
    else:
        t = float(np.median(everyone, axis=1).max())
        per_iteration = everyone.max(axis=0)  # each iteration lasts as long as its slowest rank
        lo, hi = float(per_iteration.min()), float(per_iteration.max())
    algbw = nbytes / t / 1e9 if t > 0 else float("nan")
    return {
        "collective": collective, "algorithm": algorithm, "ranks": comm.size,
        "size": nbytes, "count": count, "type": dt.name, "redop": op,
        "mode": "graph" if graph and gpu else "osu" if osu else "nccl",
        "time_us": t * 1e6, "min_us": lo * 1e6, "max_us": hi * 1e6,
        "algbw": algbw, "busbw": algbw * BUS_FACTOR[collective](comm.size), "wrong": wrong,
        "iters": iters,
    }


def _typed(row: dict) -> dict:
    """A CSV row's strings back to numbers where they are numbers."""
    out = {}
    for k, v in row.items():
        for kind in (int, float):
            try:
                out[k] = kind(v)
                break
            except (TypeError, ValueError):
                continue
        else:
            out[k] = v
    return out


def _done_points(path, comm) -> dict:
    """Rows already in the CSV, by KEY (read on rank 0, shared so every rank skips the same points)."""
    done = {}
    if comm.rank == 0 and path and os.path.exists(path):
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                done[tuple(row.get(k, "") for k in KEY)] = _typed(row)
    return comm.allgather_object(done)[0]


def _append(path, row) -> None:
    new_file = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(row))
        if new_file:
            writer.writeheader()
        writer.writerow(row)


def sweep(collective, algorithms, sizes, *, dtype="float32", op="sum", iters=None, warmup=3, comm=None,
          osu=False, validate=True, csv_path=None, extra=None, progress=False, device="cpu", graph=False,
          label=None) -> list:
    """``time_collective`` for every size and algorithm; the rows, identical on every rank.

    ``csv_path``: rank 0 appends each point as soon as it is measured, and points already in the file
    (same collective, algorithm, ranks, size, type, redop, mode) are not measured again, so an
    interrupted sweep resumes where it stopped. ``extra``: columns added to every row (say, machine).
    ``label``: the name rows and the CSV give the one algorithm (say, the kernel behind "builtin").
    ``progress=True``: a tqdm bar on rank 0 (for terminals; engines' output is captured). ``device="gpu"``:
    on the bound GPUs over NCCL (tplab.comm.communicator), unless ``comm`` is given."""
    from tqdm import tqdm  # (tqdm.auto would look for Jupyter widgets on the engines)

    comm = comm or communicator(device)
    done = _done_points(csv_path, comm)
    rows = []
    points = [(s, a) for s in sizes for a in algorithms]
    for size, algorithm in tqdm(points, desc=f"{collective} p={comm.size}", leave=False,
                                disable=not progress or comm.rank != 0):
        itemsize = np.dtype(dtype).itemsize
        nbytes = elements_per_rank(collective, size, comm.size, itemsize) * itemsize
        nbytes *= comm.size if collective == "allgather" else 1
        mode = "graph" if graph and comm.moves_gpu_memory else "osu" if osu else "nccl"
        key = (collective, label or algorithm, str(comm.size), str(nbytes), np.dtype(dtype).name, op, mode)
        if key in done:
            rows.append(done[key])
            continue
        row = time_collective(collective, algorithm, size, dtype=dtype, op=op, iters=iters, warmup=warmup,
                              comm=comm, osu=osu, validate=validate, graph=graph)
        row.update(extra or {}, **({"algorithm": label} if label else {}))
        if csv_path and comm.rank == 0:
            _append(csv_path, row)
        rows.append(row)
    return rows


def sweep_on_emulated_network(collective, algorithms, sizes, *, ranks_per_node, latency, bandwidth,
                              **kwargs) -> list:
    """``sweep`` on an EmulatedNetwork over this job's ranks (``ranks_per_node`` consecutive ranks per
    emulated node; messages between nodes pay ``latency`` + bytes / ``bandwidth``). Each row also gets
    the bytes one call sent across the network from the busiest rank, and the network's description.
    Validation compares with the MPI built-in on the real communicator underneath."""
    from tplab.comm import EmulatedNetwork

    base = kwargs.pop("comm", None) or world()
    net = EmulatedNetwork(base, ranks_per_node, latency=latency, bandwidth=bandwidth)
    rows = sweep(collective, algorithms, sizes, comm=net, **kwargs)
    description = f"{base.size // ranks_per_node} nodes x {ranks_per_node} ranks, {latency * 1e6:g} us, " \
                  f"{bandwidth / 1e9:g} GB/s between nodes"
    for row in rows:
        x = np.ones(row["count"], dtype=row["type"])
        net.reset_counters()
        _call(collective, x, net, row["algorithm"], row["redop"])
        row["inter_node_bytes"] = max(net.allgather_object(net.inter_node_bytes))
        row["network"] = description
    return rows
