"""tplab.balance — many sequences of different lengths on a cluster: load imbalance and what fixes it.

    workloads.py   seeded request batches: uniform, log-normal (long tail), bimodal lengths
    cost.py        what a sequence costs: 24·s·h² + 4·s²·h per layer, or a + b·s + c·s² fitted
    schedulers.py  static schedules: round-robin, sorted by length, LPT; list scheduling; brute-force optimum
    groups.py      the world split into data-parallel groups of tensor-parallel ranks
    workqueue.py   dynamic work pulling: a dispatcher thread on rank 0 hands out items on request
    packing.py     several sequences in one pass: padded, or packed with a block-diagonal causal mask
    runner.py      run_requests: a batch through the groups under a strategy, timed per item
    pipeline.py    pipeline parallelism: layers split over stages, micro-batches streamed GPipe-style
    timeline.py    a per-rank interval recorder -> DataFrame      gantt.py   its Gantt chart
    metrics.py     makespan, busy/idle per rank, imbalance, tokens/s, padding waste
    bench.py       the measurements behind data/balance_*.csv and notebook 07
"""

from tplab.balance.cost import SequenceCost, sequence_flops
from tplab.balance.gantt import plot_gantt
from tplab.balance.metrics import per_rank, summarize
from tplab.balance.packing import Batch, block_diagonal_causal_mask, forward, make_batch, make_batches
from tplab.balance.pipeline import gpipe_bubble, run_pipeline
from tplab.balance.runner import STRATEGIES, RunResult, run_requests
from tplab.balance.schedulers import list_schedule, lpt, makespan, optimal_makespan, round_robin, sorted_by_length
from tplab.balance.timeline import Timeline
from tplab.balance.workloads import DISTRIBUTIONS, Request, make_lengths, make_requests, requests_from_lengths

__all__ = [
    "DISTRIBUTIONS", "STRATEGIES", "Batch", "Request", "RunResult", "SequenceCost", "Timeline",
    "block_diagonal_causal_mask", "forward", "gpipe_bubble", "list_schedule", "lpt", "make_batch",
    "make_batches", "make_lengths", "make_requests", "makespan", "optimal_makespan", "per_rank", "plot_gantt",
    "requests_from_lengths", "round_robin", "run_pipeline", "run_requests", "sequence_flops",
    "sorted_by_length", "summarize",
]
