"""Load imbalance of a mixture-of-experts layer: tokens per expert, per rank, and what it costs.

A router is free to send most tokens to a few experts. With the experts spread over ranks, the rank that
holds the busiest experts computes longest, and every other rank waits for it at the combine all-to-all:
the layer's time is the *makespan*, the busiest rank's time, not the mean. Two numbers say how bad it is:

    imbalance = max / mean       (of tokens per expert, or per rank; 1 = perfectly balanced)
    makespan  = max_r tokens_r · t_token     against the balanced   mean_r tokens_r · t_token

A capacity factor c caps every expert at C = ⌈c · N · k / E⌉ assignments: the makespan is bounded, and the
tokens beyond C are dropped (they skip that expert). ``capacity_sweep`` shows the trade.
"""

from __future__ import annotations

import torch

from tplab.moe import dispatch
from tplab.toolkit.blocks import block_bounds


def max_over_mean(loads) -> float:
    """max / mean of a sequence of loads (1.0 for all-equal loads; inf when the mean is 0 but not the max)."""
    loads = torch.as_tensor(loads, dtype=torch.float64)
    mean = float(loads.mean()) if loads.numel() else 0.0
    return 1.0 if mean == 0 else float(loads.max()) / mean


def per_rank(per_expert, p: int) -> torch.Tensor:
    """Tokens per rank when rank j holds the experts of block j (numpy.array_split of the E experts)."""
    per_expert = torch.as_tensor(per_expert)
    b = block_bounds(per_expert.numel(), p)
    return torch.stack([per_expert[b[j]:b[j + 1]].sum() for j in range(p)])


@torch.no_grad()
def route_counts(moe, x, capacity_factor: float | None = None, batch_tokens: int | None = None) -> dict:
    """Route the tokens ``x`` (n, h) through ``moe``'s router in batches of ``batch_tokens`` (the whole of x
    by default), with the capacity decided per batch: assignments kept and dropped per expert, summed."""
    x = x.reshape(-1, moe.hidden)
    step = batch_tokens or max(1, x.shape[0])
    kept = torch.zeros(moe.num_experts, dtype=torch.int64)
    dropped = torch.zeros_like(kept)
    for start in range(0, x.shape[0], step):
        routing = moe.router(x[start:start + step])
        n = routing.experts.shape[0]
        plan = dispatch.plan(routing.experts, moe.num_experts,
                             dispatch.capacity(capacity_factor, n, moe.top_k, moe.num_experts))
        kept += plan.kept
        dropped += plan.dropped
    return {"kept": kept, "dropped": dropped}


def summary(per_expert, p: int, seconds_per_token: float = 1.0) -> dict:
    """The imbalance numbers of one routing: per expert, per rank (p ranks), the makespan it causes."""
    ranks = per_rank(per_expert, p).to(torch.float64)
    return {"expert_imbalance": max_over_mean(per_expert), "rank_imbalance": max_over_mean(ranks),
            "makespan": float(ranks.max()) * seconds_per_token, "balanced": float(ranks.mean()) * seconds_per_token}


def capacity_sweep(moe, x, factors, p: int, batch_tokens: int | None = None) -> list[dict]:
    """For each capacity factor (None: unlimited): the share of assignments dropped and the rank imbalance
    and makespan (in token-expert computations) that remain."""
    rows = []
    for factor in factors:
        counts = route_counts(moe, x, factor, batch_tokens)
        total = int(counts["kept"].sum() + counts["dropped"].sum())
        rows.append({"capacity_factor": factor, "dropped_fraction": int(counts["dropped"].sum()) / max(total, 1),
                     **summary(counts["kept"], p)})
    return rows
