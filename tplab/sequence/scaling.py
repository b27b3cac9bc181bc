"""Measuring sequence parallelism: a layer's forward time for p = 1..P, and each rank's causal work.

    scaling_study(comm, hidden=64, heads=4, seq_len=512, batch=2, mode="strong")   rows, one per p
    causal_balance(comm, seq_len=1024, heads=4, head_dim=16)                       rows, one per rank

Metrics as the course project reported them: forward time (the slowest rank's median), speedup and parallel
efficiency against the unsplit layer on one rank, tokens per second. Strong scaling keeps the problem
(b, s) and adds ranks; weak scaling keeps s/p tokens per rank, so the sequence grows with p — and
attention's s² work with it, which no number of ranks hides (``ideal_time_s`` says how much).

On CPU ranks (the notebook) every p runs on a sub-communicator of the first p ranks; the others wait.
Timing follows tplab.lab.bench: warm-up, then iterations started together (barrier), medians, max over
ranks (tplab.toolkit.timing). ``cuda=True`` times with CUDA events (scripts/gpu_sequence_parallel.py).
``comm`` defaults to ``tplab.comm.world()``: ``cluster.run(scaling_study, mode="weak")`` in a notebook;
``scaling_study(device="gpu")`` runs on each rank's bound GPU over NCCL (tplab.comm.devices), timed with CUDA events.
"""

from __future__ import annotations

import statistics

import torch

from tplab.comm import world
from tplab.cost.sequence_parallel import attention_bytes, causal_work
from tplab.comm import communicator
from tplab.comm.devices import is_gpu, torch_device
from tplab.models.gpt import Block, GPTConfig
from tplab.sequence.allgather_kv import attend_local
from tplab.sequence.gather import gather_sequence
from tplab.sequence.layer import SequenceParallelBlock, unsplit_layer
from tplab.sequence.layout import chunk_length, shard
from tplab.toolkit.timing import slowest_median, time_calls

# The mpi4py course project (github.com/harshita-mp/transformer-sequence-parallelism): hidden 5120,
# sequence 4096, batch 4, fp32, all-gather K/V through CPU-staged mpi4py, 10 timed forward passes per point.
COURSE_PROJECT_CONFIG = {"hidden": 5120, "seq_len": 4096, "batch": 4, "dtype": "float32"}
COURSE_PROJECT = [
    {"p": 1, "time_s": 0.947, "speedup": 1.00, "efficiency": 1.00, "tokens_per_s": 17295},
    {"p": 2, "time_s": 0.816, "speedup": 1.16, "efficiency": 0.58, "tokens_per_s": 20072},
    {"p": 4, "time_s": 1.010, "speedup": 0.94, "efficiency": 0.23, "tokens_per_s": 16218},
]


def make_block(hidden, heads, *, kv_heads=None, dtype=torch.float32, device="cpu", seed=0) -> Block:
    """A GPT layer with the same weights on every rank (same seed), in inference mode."""
    torch.manual_seed(seed)
    with torch.device(device):
        block = Block(GPTConfig(n_embd=hidden, n_head=heads, n_kv_head=kv_heads, dtype=dtype))
    return block.eval()


def make_input(batch, seq_len, hidden, *, dtype=torch.float32, device="cpu", seed=1) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(batch, seq_len, hidden, generator=generator, dtype=dtype, device=device)  # (b, s, h)


def measure_layer(comm, block, x_full, *, scheme="allgather_kv", layout="contiguous", causal=False,
                  iters=5, warmup=2, cuda=False, barrier=None, **options) -> dict:
    """Time ``SequenceParallelBlock`` on this communicator (collective); bytes counted on one call."""
    x = shard(x_full, comm.rank, comm.size, layout, dim=1)  # (b, s/p, h)
    layer = SequenceParallelBlock(block, comm, scheme=scheme, layout=layout, causal=causal, check=False, **options)
    with torch.no_grad():
        sent = comm.bytes_sent
        layer(x)
        sent = comm.bytes_sent - sent
        times = time_calls(lambda: layer(x), iters=iters, warmup=warmup, barrier=barrier or comm.barrier, cuda=cuda)
    return {"time_s": slowest_median(times, comm), "bytes_per_rank": max(comm.allgather_object(sent))}


def _unsplit_time(layer, x, iters, warmup, cuda=False) -> float:
    with torch.no_grad():
        return statistics.median(time_calls(lambda: layer(x), iters=iters, warmup=warmup, cuda=cuda))


def _sleeping_twin(comm):
    """A twin of ``comm`` whose waits sleep between polls (MPIComm with a timeout), for ranks that only
    wait: MPI's own barrier spins, and on a laptop a spinning rank steals the core a measured one needs."""
    return comm.with_timeout(3600.0)


def scaling_study(comm=None, *, hidden=64, heads=4, seq_len=512, batch=2, ranks=None, mode="strong",
                  scheme="allgather_kv", layout="contiguous", causal=False, dtype=torch.float32, iters=5,
                  warmup=2, threads=1, device="cpu") -> list[dict]:
    """Forward time of the sequence-parallel layer for each p in ``ranks`` (default: every p up to
    comm.size that the sequence splits over), on the first p ranks; the unsplit layer timed on rank 0
    alone. ``scheme``: one name or a list (each measured at every p). Collective; the same rows on every
    rank. ``threads``: torch threads per rank (1: ranks, not threads, do the parallel work).
    ``device="gpu"``: the layer and its input on each rank's GPU, ``comm`` by default NCCL over the bound
    GPUs (tplab.comm.communicator), CUDA-event timing."""
    cuda, where = is_gpu(device), torch_device(device)
    comm = communicator(device) if comm is None else comm
    schemes = [scheme] if isinstance(scheme, str) else list(scheme)
    if mode not in ("strong", "weak"):
        raise ValueError(f"mode must be 'strong' or 'weak', not {mode!r}")
    chunks = 2 if layout == "zigzag" else 1  # chunks per rank
    if ranks is None:  # every p the sequence splits over (weak scaling: s·p always does)
        ranks = [p for p in range(1, comm.size + 1) if mode == "weak" or seq_len % (chunks * p) == 0]
    ranks = list(ranks)
    if any(not 1 <= p <= comm.size for p in ranks):
        raise ValueError(f"ranks {ranks} must lie in 1..{comm.size}")
    for p in ranks:  # every rank checks before any communication: the same error everywhere
        chunk_length(seq_len * (p if mode == "weak" else 1), p, layout)
    # ranks that only wait sleep (CPU: they would spin on a core a measured rank needs); GPU ranks wait in MPI
    waiter = comm.host if comm.moves_gpu_memory else _sleeping_twin(comm)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        block = make_block(hidden, heads, dtype=dtype, device=where)
        whole = unsplit_layer(block, causal=causal)  # the same layer, all tokens on one rank
        # the unsplit layer on one rank (rank 0, the others asleep): the baseline, as the course project's "1 GPU";
        # warmed up twice over, since the very first calls of a process pay for allocations and caches
        base = _unsplit_time(whole, make_input(batch, seq_len, hidden, dtype=dtype, device=where), iters,
                             2 * warmup + 2, cuda) if comm.rank == 0 else None
        rows = []
        for p in ranks:
            s = seq_len * p if mode == "weak" else seq_len
            x_full = make_input(batch, s, hidden, dtype=dtype, device=where)
            if comm.rank == 0:  # weak scaling: the whole grown problem on one rank, for the speedup
                unsplit = base if s == seq_len else _unsplit_time(whole, x_full, iters, warmup, cuda)
            waiter.barrier()
            sub = comm.split(color=0 if comm.rank < p else 1)
            for name in schemes:
                measured = measure_layer(sub, block, x_full, scheme=name, layout=layout, causal=causal,
                                         iters=iters, warmup=warmup, cuda=cuda) if comm.rank < p else None
                waiter.barrier()
                if comm.rank != 0:
                    continue
                predicted = attention_bytes(name, batch, s, hidden, p, bytes_per_element=x_full.element_size()) \
                    if p > 1 else 0.0
                t = measured["time_s"]
                rows.append({
                    "mode": mode, "scheme": name, "layout": layout, "causal": causal, "p": p, "hidden": hidden,
                    "heads": heads, "seq_len": s, "batch": batch, "dtype": str(dtype).replace("torch.", ""),
                    "tokens_per_rank": batch * s // p, **measured, "predicted_bytes_per_rank": predicted,
                    "unsplit_time_s": unsplit, "speedup": unsplit / t, "efficiency": unsplit / t / p,
                    "tokens_per_s": batch * s / t, "weak_efficiency": base / t if mode == "weak" else None})
        return comm.allgather_object(rows)[0]
    finally:
        torch.set_num_threads(saved_threads)


def causal_balance(comm=None, *, seq_len=1024, heads=4, head_dim=16, batch=1, layouts=("contiguous", "zigzag"),
                   iters=5, threads=1) -> list[dict]:
    """Each rank's causal attention compute (after the all-gather of K and V: no communication timed),
    contiguous vs zig-zag. Ranks take turns, the others asleep, so that each is timed on an otherwise
    idle machine, and each keeps its fastest of ``iters`` runs: pure compute, the run least disturbed by
    other processes. One row per (layout, rank), the same rows on every rank; ``scores`` is the model's
    work (cost.causal_work)."""
    comm = world() if comm is None else comm
    waiter = _sleeping_twin(comm)
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(batch, heads, seq_len, head_dim, generator=generator) for _ in range(3))
        rows = []
        for layout in layouts:
            p, rank = comm.size, comm.rank
            mine = [shard(t, rank, p, layout, dim=2) for t in (q, k, v)]
            k_all = gather_sequence(mine[1], comm, dim=2)  # (b, n, s, d), rank by rank
            v_all = gather_sequence(mine[2], comm, dim=2)
            work = causal_work(seq_len, p, layout)
            for turn in range(p):
                waiter.barrier()
                if turn == rank:
                    times = time_calls(lambda: attend_local(mine[0], k_all, v_all, rank, p, causal=True, layout=layout),
                                       iters=iters, warmup=1)
                    rows.append({"layout": layout, "rank": rank, "compute_s": min(times),
                                 "scores": work[rank], "share_of_work": work[rank] / sum(work)})
        return [row for rank_rows in comm.allgather_object(rows) for row in rank_rows]
    finally:
        torch.set_num_threads(saved_threads)
