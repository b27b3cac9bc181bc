"""The measurements behind data/balance_*.csv and notebook 07: functions every rank calls (under mpiexec,
or on the engines through ``cluster.run``), each returning the same plain rows on every rank.

    mpiexec -n 4 python -m tplab.balance.bench --tp 1,2 --csv data/balance_cpu-mine.csv --machine "..."

For each workload (a length distribution, seeded) and each strategy, the batch runs ``repeats`` times
and every run is one CSV row: measured makespan, idle, imbalance, tokens/s, padding waste, and the
makespan the cost model predicted for that schedule.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

from tplab.balance.cost import SequenceCost, time_sequences
from tplab.balance.groups import data_parallel_groups
from tplab.balance.metrics import summarize
from tplab.balance.pipeline import gpipe_bubble, gpipe_makespan, micro_batches, run_pipeline
from tplab.balance.runner import STRATEGIES, run_requests
from tplab.balance.schedulers import list_schedule, longest_first, makespan
from tplab.balance.workloads import describe, make_requests
from tplab.balance.workqueue import guided_chunks
from tplab.comm import world
from tplab.toolkit.machine import cpu_model, mpi_library


def build_model(n_layer=4, n_embd=64, n_head=4, vocab_size=256, block_size=2048, seed=0, dtype="float32"):
    """The same random GPT on every rank (seeded): no download, any size."""
    from tplab.models import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                         n_embd=n_embd, dtype=getattr(torch, dtype))).eval()


def calibrate(model, tp=1, lengths=(16, 64, 256, 1024), repeats=3, comm=None) -> SequenceCost:
    """Fit a + b·s + c·s² to forward times of one sequence per length, measured by every group at once
    (the conditions of the real run), averaged over the groups; the same fit on every rank."""
    comm = comm or world()
    groups = data_parallel_groups(comm, tp)
    lengths = [s for s in lengths if s <= model.config.block_size]
    times = time_sequences(groups.shard(model), lengths, model.config.vocab_size, repeats)
    everyone = np.array(groups.control.allgather_object(times))  # (ranks, lengths)
    return SequenceCost.fit(lengths, everyone.mean(axis=0))


def predicted_makespan(result) -> float:
    """What the cost model expected of this schedule (dynamic: the greedy list schedule in its order)."""
    costs, groups = result.predicted_costs, result.ranks // result.tp
    if result.assignment is not None:
        return makespan(result.assignment, costs)
    order = list(range(len(costs))) if result.strategy == "dynamic" else longest_first(costs)
    if result.strategy == "guided":  # the chunks are list-scheduled, each as one item
        chunks = guided_chunks([costs[i] for i in order], groups)
        chunk_costs = [sum(costs[order[k]] for k in chunk) for chunk in chunks]
        return makespan(list_schedule(chunk_costs, groups), chunk_costs)
    return makespan(list_schedule(costs, groups, order), costs)


def measure_strategies(model, requests, strategies=STRATEGIES, tp=1, repeats=3, cost=None,
                       batching="single", max_tokens=None, batch_size=None, sort_batches=False, comm=None,
                       keep_intervals=False, **labels) -> tuple[list[dict], list[dict]]:
    """(rows, intervals): one summary row per (strategy, repeat); with ``keep_intervals`` the last
    repeat's intervals of each strategy (for Gantt charts). Strategies alternate within each repeat so
    that slow phases of a shared machine hit them all alike."""
    comm = comm or world()
    lengths = [r.length for r in requests]
    rows, intervals = [], []
    run_requests(model, requests[: max(1, comm.size)], comm, strategy="round_robin", tp=tp)  # warm-up
    for repeat in range(repeats):
        for strategy in strategies:
            result = run_requests(model, requests, comm, strategy=strategy, tp=tp, batching=batching,
                                  max_tokens=max_tokens, batch_size=batch_size, sort_batches=sort_batches, cost=cost)
            rows.append({**labels, "ranks": comm.size, "tp": tp, "groups": comm.size // tp,
                         "n_requests": len(requests), "total_tokens": int(sum(lengths)), "strategy": strategy,
                         "batching": batching, "repeat": repeat, "predicted_makespan_s": predicted_makespan(result),
                         **summarize(result)})
            if keep_intervals and repeat == repeats - 1:
                intervals += [{**row, "strategy": strategy} for row in result.intervals.to_dict("records")]
    return rows, intervals


def measure_pipeline(model, requests, m_values=(1, 2, 4, 8), how=("count", "balanced"), stages=None,
                     tp=1, mode="pack", repeats=2, cost=None, comm=None,
                     keep_intervals=False) -> tuple[list[dict], list[dict]]:
    """GPipe runs for several micro-batch counts m and micro-batching rules: measured bubble next to
    (p-1)/(m+p-1) and to the unequal-micro-batch formula from the predicted costs."""
    comm = comm or world()
    stages = stages or comm.size // tp
    lengths = [r.length for r in requests]
    cost = cost or SequenceCost.from_flops(model.config)
    rows, intervals = [], []
    run_pipeline(model, requests[:1], [[requests[0].id]], comm, stages=stages, tp=tp, mode=mode)  # warm-up
    for repeat in range(repeats):
        for rule in how:
            for m in m_values:
                if m > len(requests):
                    continue
                ids = micro_batches(lengths, m, rule, cost=cost.seconds)
                ids = [[requests[i].id for i in mb] for mb in ids]
                result = run_pipeline(model, requests, ids, comm, stages=stages, tp=tp, mode=mode)
                by_id = {r.id: r.length for r in requests}
                costs = [cost.batch_seconds([by_id[i] for i in mb], mode) for mb in ids]
                predicted = gpipe_makespan(costs, stages)
                rows.append({"ranks": comm.size, "stages": stages, "tp": tp, "m": m, "micro_batching": rule,
                             "mode": mode, "repeat": repeat, "makespan_s": float(result.intervals["end"].max()),
                             "bubble": result.bubble, "bubble_formula": gpipe_bubble(stages, m),
                             "bubble_unequal_formula": 1 - sum(costs) / predicted if predicted else 0.0,
                             "tokens": int(sum(lengths))})
                if keep_intervals and repeat == repeats - 1:
                    intervals += [{**row, "m": m, "micro_batching": rule}
                                  for row in result.intervals.to_dict("records")]
    return rows, intervals


def machine_description() -> str:
    """A short honest description of where this runs: CPU model, cores, MPI library."""
    return f"{cpu_model()}, {os.cpu_count()} cores, {mpi_library()}, torch {torch.__version__}"


# The workloads of the recorded CSVs: a long tail (max/median ~ 30 at 64 requests), two peaks, and flat.
WORKLOADS = {
    "lognormal": {"median": 48, "sigma": 1.5, "max_length": 2048},
    "bimodal": {"long_fraction": 0.2, "max_length": 1024},
    "uniform": {"max_length": 1024},
}


def _append_csv(rows, path):
    import pandas as pd

    df = pd.DataFrame(rows)
    df.to_csv(path, mode="a", header=not os.path.exists(path), index=False)
    return df


def main(argv=None):
    parser = argparse.ArgumentParser(description="load balancing and pipelining on the MPI ranks (under mpiexec)")
    parser.add_argument("--tp", default="1", help="TP sizes, comma-separated (each must divide the ranks)")
    parser.add_argument("--distributions", default=",".join(WORKLOADS))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("-n", "--requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--machine", default=None, help="describes the machine in the CSV (default: detected)")
    parser.add_argument("--csv", help="strategies: one row per (workload, tp, strategy, repeat)")
    parser.add_argument("--pipeline-csv", help="GPipe: one row per (tp, m, micro-batching, repeat)")
    parser.add_argument("--pipeline-requests", type=int, default=32)
    args = parser.parse_args(argv)

    comm = world()
    machine = args.machine or machine_description()
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    model = build_model(n_layer=args.layers, n_embd=args.hidden, block_size=2048)
    labels = {"machine": machine, "seed": args.seed, "n_layer": args.layers, "n_embd": args.hidden}
    for tp in [int(t) for t in args.tp.split(",")]:
        cost = calibrate(model, tp, comm=comm)
        say(f"\n{comm.size} ranks, tp {tp}: fitted {cost}", flush=True)
        for distribution in args.distributions.split(",") if args.csv else []:
            options = WORKLOADS[distribution]
            requests = make_requests(distribution, args.requests, seed=args.seed, **options)
            rows, _ = measure_strategies(model, requests, args.strategies.split(","), tp=tp, repeats=args.repeats,
                                         cost=cost, comm=comm, distribution=distribution,
                                         max_length=options["max_length"], cost_model=str(cost), **labels)
            if comm.rank == 0:
                df = _append_csv(rows, args.csv)
                say(f"{distribution}: {describe([r.length for r in requests])}")
                columns = ["makespan_s", "predicted_makespan_s", "imbalance", "tokens_per_s"]
                say(df.groupby("strategy", sort=False)[columns].median().round(4).to_string(), flush=True)
        if args.pipeline_csv and comm.size // tp <= args.layers:
            requests = make_requests("lognormal", args.pipeline_requests, seed=args.seed, **WORKLOADS["lognormal"])
            m_values = [m for m in (1, 2, 4, 8, 16) if m <= len(requests)]
            rows, _ = measure_pipeline(model, requests, m_values, tp=tp, repeats=args.repeats, cost=cost, comm=comm)
            if comm.rank == 0:
                rows = [{**labels, "distribution": "lognormal", **row} for row in rows]
                df = _append_csv(rows, args.pipeline_csv)
                columns = ["makespan_s", "bubble", "bubble_formula", "bubble_unequal_formula"]
                say(df.groupby(["micro_batching", "m"])[columns].median().round(3).to_string(), flush=True)


if __name__ == "__main__":
    main()
