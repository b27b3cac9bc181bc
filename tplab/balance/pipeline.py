"""Pipeline parallelism for inference: the layers split over p stages, micro-batches streamed through.

With K = p·t ranks, stage s is the TP group of ranks s·t .. s·t+t-1 and holds layers
``stage_layers(n_layer, p)[s]`` (stage 0 also the embeddings, stage p-1 the final norm and LM head).
Micro-batch j goes stage 0 -> 1 -> ... -> p-1; between stages, TP rank r of stage s sends its copy of
the activation (b, L, h) to TP rank r of stage s+1 (point-to-point, tag j). GPipe's forward schedule:

    time ->     1    2    3    4    5    6          p = 3 stages, m = 4 micro-batches
    stage 0    [0]  [1]  [2]  [3]                   fill: stage s starts after s steps
    stage 1         [0]  [1]  [2]  [3]
    stage 2              [0]  [1]  [2]  [3]         drain: stage 0 idles for the last p-1 steps

With every micro-batch costing c on every stage the run takes (m + p - 1)·c while each stage works m·c:
the idle share, the *bubble*, is (p-1)/(m+p-1). More micro-batches shrink it. With unequal micro-batch
costs c_j the run takes sum(c) + (p-1)·max(c) (the biggest micro-batch crosses every stage on the
critical path), so the bubble is (p-1)·max(c) / (sum(c) + (p-1)·max(c)): one long sequence in a
micro-batch stretches every stage's wait. *Length-aware micro-batching* fills the m micro-batches to
equal cost (LPT) instead of equal counts, which brings max(c) down to about sum(c)/m.

    result = run_pipeline(model, requests, micro_batches, stages=2, tp=2)      # collective
    result.outputs          # request id -> logits, on the last stage: equal to the unpipelined model
    result.intervals        # every rank's compute spans: the schedule, measured
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from tplab.balance.packing import embed, head, make_batch, run_block
from tplab.balance.schedulers import lpt
from tplab.balance.timeline import Timeline
from tplab.balance.workloads import check_requests
from tplab.comm import world

_stage_comms: dict = {}  # (id(comm), tp, timeout) -> _Stages


def gpipe_bubble(p: int, m: int) -> float:
    """The idle share of a GPipe forward with equal micro-batches: (p-1)/(m+p-1)."""
    return (p - 1) / (m + p - 1)


def gpipe_makespan(costs, p: int) -> float:
    """Time of m micro-batches of costs c_j through p identical stages: sum(c) + (p-1)·max(c)."""
    costs = np.asarray(costs, dtype=float)
    return float(costs.sum() + (p - 1) * costs.max()) if costs.size else 0.0


def ideal_schedule(costs, p: int) -> pd.DataFrame:
    """The GPipe schedule with micro-batch j taking costs[j] on every stage and free communication:
    stage s starts micro-batch j when stage s-1 has finished it and stage s has finished j-1.
    Rows like a Timeline's (rank = stage, item = micro-batch, start, end, duration)."""
    rows, finished = [], np.zeros((p, len(costs)))
    for s in range(p):
        for j, c in enumerate(costs):
            start = max(finished[s - 1, j] if s else 0.0, finished[s, j - 1] if j else 0.0)
            finished[s, j] = start + c
            rows.append({"rank": s, "what": "stage", "item": j, "start": start, "end": start + c, "duration": c})
    return pd.DataFrame(rows)


def bubble_fraction(intervals, ranks: int) -> float:
    """Measured idle share: 1 - (total busy time) / (ranks x makespan)."""
    if not len(intervals):
        return 0.0
    span = intervals["end"].max() - intervals["start"].min()
    return float(1 - intervals["duration"].sum() / (ranks * span)) if span > 0 else 0.0


def stage_layers(n_layer: int, stages: int) -> list[range]:
    """Contiguous layer ranges, as equal as possible (the first stages take one more when uneven)."""
    if stages < 1 or stages > n_layer:
        raise ValueError(f"{stages} pipeline stages for {n_layer} layers: need 1 <= stages <= n_layer")
    bounds = np.cumsum([0] + [len(a) for a in np.array_split(np.arange(n_layer), stages)])
    return [range(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def micro_batches(lengths, m: int, how: str = "count", cost=None) -> list[list[int]]:
    """Request indices split into m micro-batches. "count": arrival order, equal numbers (what a
    length-blind server does); "balanced": LPT on the predicted cost (``cost(length)``, default the
    length itself), each micro-batch in arrival order."""
    n = len(lengths)
    if not 1 <= m <= max(n, 1):
        raise ValueError(f"cannot make {m} non-empty micro-batches of {n} requests")
    if how == "count":
        return [list(map(int, chunk)) for chunk in np.array_split(np.arange(n), m)]
    if how == "balanced":
        costs = [cost(s) if cost else s for s in lengths]
        return [sorted(items) for items in lpt(costs, m)]
    raise ValueError(f"how must be 'count' or 'balanced', not {how!r}")


@dataclass
class PipelineResult:
    stages: int
    tp: int
    micro_batches: list  # request ids per micro-batch
    intervals: object  # DataFrame: rank, stage, tp_rank, what="stage", item=micro-batch, start, end
    outputs: dict = field(default_factory=dict)  # request id -> logits (last stage only)

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.intervals, self.stages * self.tp)

    @property
    def formula(self) -> float:
        return gpipe_bubble(self.stages, len(self.micro_batches))


class _Stages:
    """This rank's stage communicator, a private copy of the world for the sends, and the TP copies of
    the models run so far (made once: collective, and not free)."""

    def __init__(self, comm, tp, timeout):
        self.comm = comm  # kept, so that its id stays its own
        self.stage = comm.split(color=comm.rank // tp, key=comm.rank)
        self.p2p = comm.with_timeout(timeout)
        self.sharded: dict = {}

    def shard(self, model):
        from tplab.models import parallelize

        if self.stage.size == 1:  # a stage of one rank runs the unsplit layers
            return model
        if id(model) not in self.sharded:
            self.sharded[id(model)] = (model, parallelize(model, self.stage))
        return self.sharded[id(model)][1]


def _stages(comm, tp, timeout) -> _Stages:
    key = (id(comm), tp, timeout)
    if key not in _stage_comms:
        _stage_comms[key] = _Stages(comm, tp, timeout)
    return _stage_comms[key]


def run_pipeline(model, requests, micro_batch_ids, comm=None, *, stages=None, tp=1, mode="pack",
                 keep_outputs=False, timeout=600.0) -> PipelineResult:
    """Stream the micro-batches (lists of request ids; "pack" or "pad" each into one forward pass)
    through ``stages`` stages of ``tp`` ranks each (default: every rank its own stage). Collective."""
    comm = comm or world()
    stages = stages or comm.size // tp
    if stages * tp != comm.size:
        raise ValueError(f"{stages} stages x tp {tp} = {stages * tp} ranks, but there are {comm.size}")
    layers = stage_layers(model.config.n_layer, stages)  # also checks stages <= n_layer
    by_id = check_requests(requests, model.config.block_size)
    listed = [i for ids in micro_batch_ids for i in ids]
    if not set(listed) <= set(by_id) or len(set(listed)) != len(listed):
        raise ValueError("micro-batches must name known request ids, each at most once")
    layout = _stages(comm, tp, timeout)
    stage, stage_comm, p2p = comm.rank // tp, layout.stage, layout.p2p
    first, last = stage == 0, stage == stages - 1
    sharded = layout.shard(model)  # my stage uses only its blocks (and embeddings / head at the ends)
    my_blocks = [sharded.blocks[i] for i in layers[stage]]
    batches = [make_batch([by_id[i].tokens(model.config.vocab_size) for i in ids], mode) for ids in micro_batch_ids]
    h, dtype = model.config.n_embd, model.config.dtype

    timeline = Timeline(comm.rank, stage=stage, tp_rank=stage_comm.rank)
    outputs, sends = {}, []
    p2p.barrier()
    timeline.restart()
    with torch.no_grad():
        for j, batch in enumerate(batches):
            shape = (*batch.tokens.shape, h)  # (b, L, h): every stage knows it, no header needed
            if not first:  # wait for the previous stage's activation (idle time: not in a span)
                x = torch.from_numpy(p2p.recv(torch.empty(shape, dtype=dtype).numpy().reshape(-1), comm.rank - tp, j))
                x = x.view(shape)
            with timeline.span("stage", item=j, tokens=batch.real_tokens, slots=batch.slots):
                if first:
                    x = embed(sharded, batch.tokens, batch.positions)
                for block in my_blocks:
                    x = run_block(block, x, batch.mask)
                if last:
                    logits = head(sharded, x)
            if not last:  # non-blocking: start the next micro-batch while this one travels
                sends.append(p2p.isend(x.contiguous().numpy().reshape(-1), comm.rank + tp, j))
            elif keep_outputs:
                outputs.update(zip(micro_batch_ids[j], batch.split(logits)))
    p2p.waitall(sends)
    p2p.barrier()
    return PipelineResult(stages, tp, [list(ids) for ids in micro_batch_ids], timeline.gather(p2p), outputs)
