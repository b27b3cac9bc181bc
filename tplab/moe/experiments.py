"""What notebook 09 runs on every rank (``cluster.run(check_exactness)``); each returns rows that are the same
on every rank (errors and counts gathered over the ranks). ``comm`` defaults to ``tplab.comm.world()``.

    check_exactness      ExpertParallelMoE against the unsplit MoE (float64): forward, input and weight
                         gradients, for several E (divisible by p or not), k, capacities, shared expert
    bytes_vs_formula     counters against ``traffic`` per rank, for a few tokens per rank
    exchange_record      one real dispatch: every rank's tokens, their experts, which rows travel in which step
    traced_layer         one layer under a tracer (pass ``tplab.overlap.Tracer``): route / dispatch / experts /
                         combine per rank, with a router that favours a few experts (a Gantt chart)
    alltoall_timings     pairwise against Bruck at several sizes (the crossover), slowest rank's median
"""

from __future__ import annotations

import torch

from tplab.collectives.alltoall import alltoall
from tplab.collectives.alltoallv import alltoallv
from tplab.comm import world
from tplab.moe import dispatch
from tplab.moe.expert_parallel import ExpertParallelMoE, traffic
from tplab.moe.layer import MoE
from tplab.toolkit.timing import slowest_median, time_calls


def _randn(*shape, seed):  # the same float64 tensor on every rank
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _grad(t):
    return torch.zeros_like(t) if t.grad is None else t.grad


def _max(comm, value) -> float:
    return max(comm.allgather_object(float(torch.as_tensor(value).detach())))


CONFIGS = [  # (experts, top_k, capacity_factor, shared expert, gating order)
    (8, 2, None, False, "softmax_then_topk"), (5, 2, None, True, "softmax_then_topk"),
    (7, 1, 1.0, False, "topk_then_softmax"), (3, 2, 0.5, True, "softmax_then_topk")]


def check_exactness(comm=None, *, hidden=8, tokens_per_rank=6, seed=0) -> list[dict]:
    comm = world() if comm is None else comm
    p, r = comm.size, comm.rank
    rows = []
    for experts, k, factor, shared, order in CONFIGS:
        torch.manual_seed(seed)
        moe = MoE(hidden, 2 * hidden, experts, k, capacity_factor=factor, shared_ffn=hidden if shared else None,
                  order=order, dtype=torch.float64)
        ep = ExpertParallelMoE.from_dense(moe, comm)
        x = _randn(p * tokens_per_rank, hidden, seed=seed + 1)
        lo, hi = r * tokens_per_rank, (r + 1) * tokens_per_rank
        full, mine = x.clone().requires_grad_(), x[lo:hi].clone().requires_grad_()
        want, got = moe(full), ep(mine)
        want.square().sum().backward()
        got.square().sum().backward()
        weights = max((float((_grad(a) - _grad(b)).abs().max()) for e, mine_e in zip(ep.my_experts, ep.experts)
                       for a, b in zip(mine_e.parameters(), moe.experts[e].parameters())), default=0.0)
        rows.append({"experts": experts, "top_k": k, "capacity_factor": factor, "shared": shared, "order": order,
                     "experts_per_rank": "/".join(str(ep.bounds[j + 1] - ep.bounds[j]) for j in range(p)),
                     "dropped": int(ep.last["dropped"].sum()),
                     "forward_error": _max(comm, (got - want[lo:hi]).abs().max()),
                     "input_grad_error": _max(comm, (_grad(mine) - _grad(full)[lo:hi]).abs().max()),
                     "expert_grad_error": _max(comm, weights)})
    return rows


def bytes_vs_formula(comm=None, *, hidden=16, experts=8, top_k=2, tokens=(1, 4, 32), seed=0) -> list[dict]:
    comm = world() if comm is None else comm
    torch.manual_seed(seed)
    ep = ExpertParallelMoE.from_dense(MoE(hidden, 2 * hidden, experts, top_k, dtype=torch.float64), comm)
    rows = []
    for n in tokens:
        x = _randn(n, hidden, seed=seed + comm.rank + 10 * n)
        comm.reset_counters()
        with torch.no_grad():
            ep(x)
        t = traffic(ep.last["kept"], ep.bounds, comm.rank, hidden * 8)
        mine = {"rank": comm.rank, "tokens_per_rank": n, "bytes_counted": comm.bytes_sent,
                "messages_counted": comm.messages_sent, "bytes_formula": sum(v["bytes"] for v in t.values()),
                "messages_formula": sum(v["messages"] for v in t.values()),
                "dispatch_bytes": t["dispatch"]["bytes"], "combine_bytes": t["combine"]["bytes"],
                "counts_bytes": t["counts"]["bytes"]}
        rows += comm.allgather_object(mine)
    return rows


def exchange_record(comm=None, *, tokens_per_rank=3, experts=None, top_k=2, hidden=8, seed=0) -> dict:
    """One dispatch, for the pictures: each rank's tokens (global ids) and chosen experts, the kept-count
    matrix, and for every rank the rows it received, with the rank and step they came from."""
    comm = world() if comm is None else comm
    p, r = comm.size, comm.rank
    experts = experts or 2 * p
    torch.manual_seed(seed)
    ep = ExpertParallelMoE.from_dense(MoE(hidden, 2 * hidden, experts, top_k, dtype=torch.float64), comm)
    x = _randn(p * tokens_per_rank, hidden, seed=seed + 1)[r * tokens_per_rank:(r + 1) * tokens_per_rank]
    with torch.no_grad():
        ep(x)
        chosen = ep.router(x).experts
    plan = dispatch.plan(chosen, experts)
    labels = torch.stack([plan.token + r * tokens_per_rank, chosen.reshape(-1)[plan.assignment]], dim=1)
    arrived = alltoallv(labels, ep.last["send_rows"], comm, ep.last["recv_rows"])  # the same counts, ids moving
    sources = [s for s in range(p) for _ in range(ep.last["recv_rows"][s])]
    mine = {"rank": r, "tokens": list(range(r * tokens_per_rank, (r + 1) * tokens_per_rank)),
            "chosen": chosen.tolist(), "received": [(int(t), int(e), s, (r - s) % p)  # (token, expert, from, step)
                                                    for (t, e), s in zip(arrived.tolist(), sources)]}
    return {"p": p, "experts": experts, "bounds": ep.bounds, "kept": ep.last["kept"].tolist(),
            "ranks": comm.allgather_object(mine)}


def traced_layer(tracer_class, comm=None, *, tokens_per_rank=512, hidden=256, experts=None, top_k=2,
                 favour=0.5, warmup=2, seed=0):
    """One forward of an expert-parallel layer whose router favours the first experts (its logits get
    ``favour`` added for expert 0, less for the next, ...), traced: returns ``tracer.gather()`` (rank 0)."""
    comm = world() if comm is None else comm
    experts = experts or 2 * comm.size
    torch.manual_seed(seed)
    moe = MoE(hidden, 2 * hidden, experts, top_k)
    with torch.no_grad():  # a bias towards low-numbered experts, through one input feature that is always 1
        moe.router.gate.weight[:, 0] = torch.linspace(favour, 0.0, experts)
    ep = ExpertParallelMoE.from_dense(moe, comm)
    x = torch.randn(tokens_per_rank, hidden, generator=torch.Generator().manual_seed(seed + comm.rank))
    x[:, 0] = 1.0
    with torch.no_grad():
        for _ in range(warmup):
            ep(x)
        tracer = tracer_class(comm)
        ep.span = tracer.span
        with tracer:
            ep(x)
    return {"timeline": tracer.gather(), "kept": ep.last["kept"].tolist()}


def alltoall_timings(comm=None, *, sizes=(64, 1024, 16384, 262144), iters=20, warmup=3) -> list[dict]:
    """Seconds per all-to-all (slowest rank's median) by pairwise exchange and Bruck; size = one rank's input."""
    import numpy as np

    comm = world() if comm is None else comm
    rows = []
    for size in sizes:
        x = np.zeros((comm.size, max(1, size // (8 * comm.size))))
        for algorithm in ("pairwise", "bruck"):
            times = time_calls(lambda: alltoall(x, comm, algorithm=algorithm, check=False), iters=iters,
                               warmup=warmup, barrier=comm.barrier)
            rows.append({"algorithm": algorithm, "size": x.nbytes, "time_us": slowest_median(times, comm) * 1e6})
    return rows


VARIANTS = [("plain", 0.0, False), ("noise", 0.0, True), ("aux loss 0.01", 0.01, False),
            ("noise + aux loss 0.05", 0.05, True)]


def train_variant(ids, comm=None, *, steps=100, every=10, ranks=4, factors=(None, 2.0, 1.5, 1.25, 1.0, 0.75, 0.5),
                  batch_tokens=256, seed=0) -> dict:
    """Rank r trains the router variant VARIANTS[r] (tplab.moe.train.train_router) on the token ids; returns
    its history and, for the trained router on the last 4096 tokens in batches of ``batch_tokens``, what each
    capacity factor drops and the imbalance over ``ranks`` ranks that remains. Ranks beyond the first four
    return empty lists (one run per variant). Not collective."""
    from tplab.moe.imbalance import capacity_sweep
    from tplab.moe.train import train_router

    comm = world() if comm is None else comm
    if comm.rank >= len(VARIANTS):
        return {"history": [], "capacity": []}
    name, aux_coef, noise = VARIANTS[comm.rank]
    torch.set_num_threads(1)
    ids = torch.as_tensor(ids)
    model, history = train_router(ids, steps=steps, aux_coef=aux_coef, noise=noise, every=every, seed=seed)
    with torch.no_grad():
        x = model.hidden_states(ids[-4096:].reshape(16, -1))
    sweep = capacity_sweep(model.moe, x, factors, ranks, batch_tokens)
    return {"history": [{"variant": name, **row} for row in history],
            "capacity": [{"variant": name, **row} for row in sweep]}
