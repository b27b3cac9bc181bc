"""How much communication did the overlap hide? Exposed time and hidden fraction, over chunk counts.

    exposed communication  = time(layer with comm) - time(layer without comm)
    hidden fraction        = 1 - exposed / time(the same collectives alone)

"Without comm" is the layer as it is, its collectives no-ops (nullcomm.py); "the same collectives alone"
are the collectives the unchunked layer runs, replayed back to back on the real communicator. Without
overlap, exposed = the whole communication time and the hidden fraction is about 0; perfect overlap
gives exposed = 0 and a hidden fraction of 1. The baseline without comm is the *unchunked* layer, so the
cost of chunking itself (smaller, less efficient GEMMs; per-chunk overheads) counts as exposed: that is
what a user pays. ``compute_chunked_ms`` shows that part alone.

Timing: every call starts after a barrier; a rank's time is its median over ``iters``, a point's time
the slowest rank's (the ranks wait for each other in the collectives anyway). All variants of a sweep are
timed in interleaved rounds (time_forwards), so that a drift during the sweep cannot favour one of them --
except CUDA graph replays, timed one graph after another (repeat the sweep to see the drift). On GPUs the
time is measured with CUDA events (``cuda=True``).
"""

from __future__ import annotations

import statistics

import torch

import tplab
from tplab.layers import mappings
from tplab.overlap.factory import overlapped
from tplab.overlap.nullcomm import without_communication
from tplab.toolkit.timing import time_forward, time_once


def time_forwards(forwards: dict, comm, *, iters=10, warmup=2, cuda=False) -> dict:
    """Seconds per call of each of ``forwards`` (name -> function), measured in interleaved rounds: round i
    runs every function once, so a drift during the measurement (clocks, temperature, a neighbour's job)
    falls on all of them alike instead of on whichever came last. Each: the slowest rank's median over
    ``iters`` rounds (after ``warmup``); every call starts after a barrier."""
    times = {name: [] for name in forwards}
    for i in range(warmup + iters):
        for name, forward in forwards.items():
            seconds = time_once(forward, barrier=comm.barrier, cuda=cuda)
            if i >= warmup:
                times[name].append(seconds)
    gathered = comm.allgather_object({name: statistics.median(t) for name, t in times.items()})
    return {name: max(medians[name] for medians in gathered) for name in forwards}


def captured(forward):
    """``forward`` recorded once into a CUDA graph (collective: every rank at once); returns the function
    that replays it. Why: cut into k chunks, a layer's forward pass is many more kernel launches and Python
    calls, and the host can fall behind the GPU (the course project's block in 4 micro-batches: about 5 ms to queue
    for about 6 ms on an H200), leaving it idle between chunks. A replay queues the whole pass at once, so
    what is timed is the GPU's work. The plain layer is timed the same way, so the comparison stays fair."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the graph: NCCL, cuBLAS and NVRTC set themselves up
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: other threads (NCCL's watchdog) may go on querying events while this one captures
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = forward()  # lives in the graph's memory: each replay writes it again

    def replay():
        graph.replay()
        return out

    return replay


def _without_communication(layer, fn):
    with without_communication(layer):
        return fn()


def collectives_of(layer, x) -> list[tuple]:
    """The collectives one forward pass of ``layer`` runs: (name, shape, dtype, device) each."""
    with torch.no_grad(), without_communication(layer) as null:
        layer(x)
    return null.log


def replay(log, comm, algorithm="auto"):
    """Run the collectives in ``log`` (collectives_of) back to back on ``comm`` (a function to time)."""
    inputs = [(name, torch.randn(shape, dtype=dtype, device=device)) for name, shape, dtype, device in log]

    def run():
        for name, x in inputs:
            getattr(tplab, name)(x, comm, algorithm=algorithm, check=False)

    return run


def _algorithm_of(layer) -> str:
    return next((m.algorithm for m in layer.modules() if hasattr(m, "algorithm")), "auto")


def overlap_sweep(layer, x, comm, chunk_counts=(1, 2, 4, 8), *, iters=10, warmup=2, cuda=False, progress=True,
                  make_overlapped=overlapped, graphs=False):
    """Exposed communication and hidden fraction of ``layer`` (a tplab TP layer: ParallelMLP,
    ParallelAttention, RowParallelLinear, ParallelBlock) on input ``x``, pipelined over each chunk count.
    ``graphs=True`` (GPU): every variant is timed as a CUDA graph replay (``captured``), plain and chunked.
    Collective (run on every rank); a DataFrame, one row per chunk count, the same on every rank."""
    import pandas as pd
    from tqdm import tqdm

    def prepared(fn, silent=False):  # silent: the layer's collectives as no-ops (NullComm) while fn runs
        run = (lambda: _without_communication(layer, fn)) if silent else fn
        return captured(run) if graphs else run

    algorithm = _algorithm_of(layer)
    with mappings.argument_checks_off(), torch.no_grad():  # no agreement rounds while timing
        chunked = {k: make_overlapped(layer, k) for k in chunk_counts}
        plans = {"compute": (lambda: layer(x), True),  # name: (function, silent)
                 "comm": (replay(collectives_of(layer, x), comm, algorithm), False),
                 "no_overlap": (lambda: layer(x), False)}
        for k, layer_k in chunked.items():
            plans["compute_chunked", k] = (lambda layer_k=layer_k: layer_k(x), True)
            plans["comm_chunked", k] = (replay(collectives_of(layer_k, x), comm, algorithm), False)
            plans["overlapped", k] = (lambda layer_k=layer_k: layer_k(x), False)
        keep = ["no_overlap"] + [("overlapped", k) for k in chunk_counts]  # outputs to check
        if graphs:  # one graph at a time: captured, timed, its output kept, released (holding all of a
            ms, outputs = {}, {}  # sweep's graphs at once crashed: illegal address, torch 2.11, 4x H100)
            for name, (fn, silent) in plans.items():
                run = prepared(fn, silent)
                ms[name] = time_forward(run, comm, iters=iters, warmup=warmup, cuda=cuda) * 1e3
                if name in keep:
                    outputs[name] = run().clone()
                del run
        else:
            runs = {name: prepared(fn, silent) for name, (fn, silent) in plans.items()}
            ms = {name: seconds * 1e3 for name, seconds in
                  time_forwards(runs, comm, iters=iters, warmup=warmup, cuda=cuda).items()}
            outputs = {name: runs[name]() for name in keep}
        # a check that what was timed computes the layer (chunking changes rounding only; a lost or
        # doubled collective would change the output by its own size)
        plain = outputs["no_overlap"]
        scale = plain.abs().max().item() or 1.0
        rows = []
        for k in tqdm(chunk_counts, desc="chunk counts", disable=not progress or comm.rank != 0):
            max_rel_diff = max(comm.allgather_object((outputs["overlapped", k] - plain).abs().max().item() / scale))
            compute_ms, comm_ms, overlapped_ms = ms["compute"], ms["comm"], ms["overlapped", k]
            exposed = overlapped_ms - compute_ms
            rows.append({
                "layer": type(layer).__name__, "chunks": k, "ranks": comm.size, "algorithm": algorithm,
                "tokens": x.shape[:-1].numel(), "hidden": x.shape[-1], "dtype": str(x.dtype).replace("torch.", ""),
                "compute_ms": compute_ms, "compute_chunked_ms": ms["compute_chunked", k], "comm_ms": comm_ms,
                "comm_chunked_ms": ms["comm_chunked", k], "no_overlap_ms": ms["no_overlap"],
                "overlapped_ms": overlapped_ms, "exposed_no_overlap_ms": ms["no_overlap"] - compute_ms,
                "exposed_ms": exposed, "hidden_fraction": 1 - exposed / comm_ms, "iters": iters,
                "cuda_graph": graphs, "timing": "one after another" if graphs else "interleaved",
                "max_rel_diff": max_rel_diff})
    return pd.DataFrame(rows)


def pipeline_model(df):
    """The sweep's prediction by a two-stage pipeline model, added as columns.

    Chunk i's compute (c = compute_ms / k) and its communication (m) take turns on two resources; with k
    chunks the layer takes  T(k) = c + (k - 1)·max(c, m) + m:  the first chunk's compute and the last
    chunk's communication are never hidden (k = 1: compute + communication, nothing hidden). A chunk's
    communication is m = a + b/k: a fixed part per collective (latency: 2(p-1)α for a ring) and a part
    that shrinks with the chunk (bytes·β, γ), with a + b = comm_ms (the unchunked collectives) and a
    fitted to the measured comm_chunked_ms = k·a + b by least squares. Perfect overlap (no contention
    for cores, memory or SMs) is assumed: the measurement falls short of it by that contention."""
    import numpy as np

    df = df.copy()
    k = df["chunks"].to_numpy(dtype=float)
    comm = df["comm_ms"].to_numpy()
    extra = k - 1  # comm_chunked - comm = (k - 1)·a
    a = float(np.clip((extra * (df["comm_chunked_ms"].to_numpy() - comm)).sum() / (extra**2).sum(), 0, comm.min()))\
        if (extra**2).sum() > 0 else 0.0
    b = comm - a
    c, m = df["compute_ms"].to_numpy() / k, a + b / k
    df["latency_per_chunk_ms"], df["bandwidth_part_ms"] = a, b
    df["predicted_ms"] = c + (k - 1) * np.maximum(c, m) + m
    df["predicted_exposed_ms"] = df["predicted_ms"] - df["compute_ms"]
    df["predicted_hidden_fraction"] = 1 - df["predicted_exposed_ms"] / df["comm_ms"]
    return df
