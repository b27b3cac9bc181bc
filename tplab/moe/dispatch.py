"""The dispatch plan: the k·n (token, expert) assignments sorted by expert, and which of them fit.

Experts compute on contiguous rows, so the assignments are reordered by expert: a *stable* sort, so that
inside each expert the tokens keep their order (token 0's assignment before token 1's). With experts
spread over ranks in contiguous blocks (rank 0 holds experts 0 .. E/p - 1, ...) the same order is also
by destination rank: the rows for rank 0 first, then for rank 1, ... -- what all-to-all-v sends.

Capacity. An expert takes at most C = ⌈capacity_factor · N · k / E⌉ assignments of a batch of N tokens (a
fixed buffer on a GPU; None: no limit). The rest are *dropped*: that token gets nothing from that expert
(the residual connection around the layer carries it). Who is dropped is decided in token order over the
whole batch: with the batch split over ranks (rank 0's tokens first), ``ahead[e]`` says how many of expert
e's assignments come from lower ranks, so every rank decides its own drops exactly as one process would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def capacity(capacity_factor: float | None, tokens: int, top_k: int, num_experts: int) -> int | None:
    """⌈capacity_factor · tokens · k / E⌉ assignments per expert; None: unlimited."""
    if capacity_factor is None:
        return None
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be positive or None, got {capacity_factor!r}")
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


@dataclass
class DispatchPlan:
    assignment: torch.Tensor  # (kept,) index into experts.reshape(-1): token = assignment // k
    token: torch.Tensor       # (kept,) which token each row is, grouped by expert
    kept: torch.Tensor        # (E,) rows per expert that fit
    dropped: torch.Tensor     # (E,) assignments per expert that did not


def kept_counts(counts: torch.Tensor, ahead: torch.Tensor, limit: int | None) -> torch.Tensor:
    """Assignments per expert that fit, given ``ahead`` assignments before them (elementwise)."""
    if limit is None:
        return counts.clone()
    return torch.clamp(torch.clamp(limit - ahead, min=0), max=counts)


def plan(experts: torch.Tensor, num_experts: int, limit: int | None = None, ahead=None) -> DispatchPlan:
    """experts: (n, k) int64, the router's choice -> the plan (rows grouped by expert, drops applied)."""
    flat = experts.reshape(-1)
    k = experts.shape[1] if experts.dim() == 2 else 1
    counts = torch.bincount(flat, minlength=num_experts)
    order = torch.sort(flat, stable=True).indices  # assignments grouped by expert, token order inside
    ahead = torch.zeros_like(counts) if ahead is None else torch.as_tensor(ahead).to(counts.device)
    kept = kept_counts(counts, ahead, limit)
    starts = torch.cumsum(counts, 0) - counts  # where each expert's group begins in ``order``
    position = torch.arange(flat.numel(), device=flat.device) - torch.repeat_interleave(starts, counts)
    fits = position < torch.repeat_interleave(kept, counts)
    assignment = order[fits]
    return DispatchPlan(assignment, assignment // k, kept, counts - kept)
