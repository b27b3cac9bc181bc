"""Run a batch of requests on the cluster's data-parallel groups, under a chosen strategy, and time it.

    result = run_requests(model, requests, strategy="lpt", tp=2)      # collective: every rank calls it
    result.intervals          # DataFrame, every rank's (start, end) of every item it ran: the Gantt
    summarize(result)         # makespan, idle, imbalance, tokens/s, padding waste   (metrics.py)

Work items: with ``batching="single"`` each request is its own item; with "pad" or "pack" requests are
first grouped into batches (``max_tokens`` / ``batch_size``, optionally longest first) and each batch is
one item, run in one forward pass (packing.py).

Strategies:
    round_robin, sorted, lpt    static: every rank computes the same assignment from the same predicted
                                costs (``cost``), then each group runs its share; nobody talks
    dynamic                     pull from a work queue, items in arrival order (workqueue.py)
    dynamic_lpt                 pull from a work queue, longest predicted item first
    guided                      pull chunks (about 1/(2G) of the remaining predicted cost each), longest
                                first: fewer round trips than one item at a time

Every group runs a real TP copy of the model (``parallelize`` over its ranks); with tp = 1 each group is
one rank holding the whole model (plain data parallelism). The clocks start after a barrier and the intervals
cover only the forward passes: the batches' tokens are prepared before the clock starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tplab.balance.cost import SequenceCost
from tplab.balance.groups import data_parallel_groups
from tplab.balance.packing import forward, make_batch, make_batches
from tplab.balance.schedulers import STATIC_SCHEDULERS, longest_first, static_schedule
from tplab.balance.timeline import Timeline
from tplab.balance.workloads import check_requests
from tplab.balance.workqueue import WorkQueue
from tplab.comm import world

STRATEGIES = (*STATIC_SCHEDULERS, "dynamic", "dynamic_lpt", "guided")


@dataclass
class RunResult:
    strategy: str
    ranks: int
    tp: int
    items: list  # work items, each a list of request ids
    predicted_costs: list  # the cost model's seconds per item
    intervals: object  # DataFrame: rank, group, tp_rank, what, item, requests, tokens, slots, start, end
    outputs: dict = field(default_factory=dict)  # request id -> logits (s, vocab), for my group's items
    assignment: list | None = None  # static strategies: item indices per group


def work_items(requests, batching="single", max_tokens=None, batch_size=None, sort=False) -> list[list[int]]:
    """Request ids grouped into work items (one forward pass each)."""
    if batching == "single":
        return [[r.id] for r in requests]
    if batching not in ("pad", "pack"):
        raise ValueError(f"batching must be 'single', 'pad' or 'pack', not {batching!r}")
    lengths = [r.length for r in requests]
    return [[requests[i].id for i in batch] for batch in make_batches(lengths, max_tokens, batch_size, sort)]


def run_requests(model, requests, comm=None, *, strategy="lpt", tp=1, batching="single", max_tokens=None,
                 batch_size=None, sort_batches=False, cost: SequenceCost | None = None, keep_outputs=False,
                 lookahead=1, timeout=600.0) -> RunResult:
    """Run ``requests`` (workloads.Request, the same list on every rank) through ``model`` (the same
    unsplit GPT on every rank) on DP groups of ``tp`` ranks. Collective over ``comm`` (default: world).
    ``lookahead``: the dynamic queue's (workqueue.WorkQueue). Every rank returns every rank's
    intervals; ``outputs`` (with ``keep_outputs``) holds the logits of the requests its group ran."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, not {strategy!r}")
    comm = comm or world()
    by_id = check_requests(requests, model.config.block_size)
    items = work_items(requests, batching, max_tokens, batch_size, sort_batches)
    mode = batching  # "single", "pad" or "pack" (checked by work_items)
    groups = data_parallel_groups(comm, tp, timeout)
    sharded = groups.shard(model)
    cost = cost or SequenceCost.from_flops(model.config)
    costs = [cost.batch_seconds([by_id[i].length for i in item], mode) for item in items]
    vocab = model.config.vocab_size
    batches = [make_batch([by_id[i].tokens(vocab) for i in item], mode) for item in items]

    assignment = None
    if strategy in STATIC_SCHEDULERS:
        assignment = static_schedule(strategy, costs, groups.count)
        mine = assignment[groups.index]
    else:
        order = range(len(items)) if strategy == "dynamic" else longest_first(costs)
        chunking = "guided" if strategy == "guided" else "single"
    timeline = Timeline(comm.rank, group=groups.index, tp_rank=groups.group.rank)
    outputs = {}
    queue = mine if assignment is not None else WorkQueue(groups, order, timeline, lookahead, costs, chunking)
    groups.control.barrier()
    timeline.restart()
    with torch.no_grad():
        for k in queue:
            batch = batches[k]
            with timeline.span("forward", item=k, requests=len(items[k]), tokens=batch.real_tokens,
                               slots=batch.slots):
                logits = forward(sharded, batch)
            if keep_outputs:
                outputs.update(zip(items[k], batch.split(logits)))
    groups.control.barrier()
    return RunResult(strategy, comm.size, tp, items, costs, timeline.gather(groups.control), outputs, assignment)
