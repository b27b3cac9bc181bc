"""What notebook 07 runs on the engines: plain arguments in (dicts of model and workload options), plain
rows out, the same on every rank. ``cluster.run(experiments.strategies, model, workload, ...)[0]``.

The model is built once per engine for each set of options (seeded: the same weights everywhere) and
kept, so repeated calls reuse its TP copies and communicators.
"""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
import torch

from tplab.balance.bench import build_model, calibrate, measure_pipeline, measure_strategies
from tplab.balance.cost import SequenceCost, time_sequences
from tplab.balance.groups import data_parallel_groups
from tplab.balance.runner import STRATEGIES, run_requests
from tplab.balance.workloads import make_requests
from tplab.comm import world

_models: dict = {}


def model_for(options: dict):
    key = tuple(sorted(options.items()))
    if key not in _models:
        _models[key] = build_model(**options)
    return _models[key]


def calibration(model: dict, tp=1, lengths=(8, 32, 128, 256, 512), repeats=3) -> dict:
    """Forward time of one sequence per length on every group at once (mean over ranks) and the fit
    a + b·s + c·s² through it."""
    m = model_for(model)
    groups = data_parallel_groups(world(), tp)
    lengths = [s for s in lengths if s <= m.config.block_size]
    seconds = np.mean(groups.control.allgather_object(time_sequences(groups.shard(m), lengths, m.config.vocab_size,
                                                                     repeats)), axis=0)
    return {"lengths": list(lengths), "seconds": seconds.tolist(), "cost": asdict(SequenceCost.fit(lengths, seconds))}


def strategies(model: dict, workload: dict, strategies=STRATEGIES, tp=1, repeats=1, cost: dict | None = None,
               **run_options) -> dict:
    """Every strategy ``repeats`` times on the requests ``make_requests(**workload)``: summary rows and
    the last repeat's intervals (for Gantt charts)."""
    m = model_for(model)
    requests = make_requests(**workload)
    cost = SequenceCost(**cost) if cost else calibrate(m, tp)
    rows, intervals = measure_strategies(m, requests, strategies, tp=tp, repeats=repeats, cost=cost,
                                         keep_intervals=True, distribution=workload.get("distribution"),
                                         **run_options)
    return {"rows": rows, "intervals": intervals}


def one_run(model: dict, workload: dict, strategy="lpt", tp=1, cost: dict | None = None, **run_options) -> dict:
    """A single run: its intervals, its work items and the cost model's price of each."""
    m = model_for(model)
    cost = SequenceCost(**cost) if cost else None
    result = run_requests(m, make_requests(**workload), strategy=strategy, tp=tp, cost=cost, **run_options)
    return {"intervals": result.intervals.to_dict("records"), "items": result.items,
            "predicted_costs": result.predicted_costs, "assignment": result.assignment}


def packing_check(model: dict, lengths=(5, 1, 11, 4), mode="pack") -> float:
    """Largest difference between a packed (or padded) batch on the TP copy of ``model`` over all ranks
    and each sequence run alone through the unsplit model."""
    from tplab.balance.packing import forward, make_batch
    from tplab.models import parallelize

    m = model_for(model)
    sharded = parallelize(m, world())
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, m.config.vocab_size, (s,), generator=generator) for s in lengths]
    batch = make_batch(sequences, mode)
    with torch.no_grad():
        together = batch.split(forward(sharded, batch))
        return max(float((got - m(t[None])[0]).abs().max()) for got, t in zip(together, sequences))


def pipeline(model: dict, workload: dict, m_values=(1, 2, 4, 8), how=("count", "balanced"), tp=1, repeats=1,
             mode="pack", cost: dict | None = None) -> dict:
    """GPipe runs over every rank (stages = ranks / tp): bubble rows and the last repeat's intervals."""
    m = model_for(model)
    requests = make_requests(**workload)
    cost = SequenceCost(**cost) if cost else None
    rows, intervals = measure_pipeline(m, requests, m_values, how, tp=tp, mode=mode, repeats=repeats, cost=cost,
                                       keep_intervals=True)
    return {"rows": rows, "intervals": intervals}
