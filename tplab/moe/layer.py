"""A mixture-of-experts feed-forward layer, unsplit: the reference the expert-parallel version must match.

    y = Σ_{i in top-k(x)} G_i(x) E_i(x)  [+ shared expert(x)]

The router (router.py) picks k of E experts per token; the tokens are grouped by expert (dispatch.py), each
expert runs on its rows (experts.py), and the rows come back scaled by their gate and summed per token. An
optional *shared expert* sees every token (Qwen-MoE, DeepSeek-MoE, LLaMA-4: 1 shared + 128 routed), with an
optional sigmoid gate of its own (Qwen-MoE). Each forward records what the batch did to the experts in
``layer.last``: tokens kept and dropped per expert (the imbalance), and the auxiliary loss when training.
"""

from __future__ import annotations

import torch
from torch import nn

from tplab.moe import dispatch
from tplab.moe.experts import Expert, run_experts
from tplab.moe.router import Router, load_balancing_loss


class MoE(nn.Module):
    def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int = 2, *, activation: str = "swiglu",
                 order: str = "softmax_then_topk", renormalize: bool = True, noise: bool = False,
                 capacity_factor: float | None = None, shared_ffn: int | None = None, shared_gate: bool = False,
                 router_dtype: torch.dtype | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.hidden, self.num_experts, self.top_k, self.capacity_factor = hidden, num_experts, top_k, capacity_factor
        self.router = Router(hidden, num_experts, top_k, order=order, renormalize=renormalize, noise=noise,
                             compute_dtype=router_dtype, dtype=dtype)
        self.experts = nn.ModuleList(Expert(hidden, ffn, activation, dtype=dtype) for _ in range(num_experts))
        self.shared = Expert(hidden, shared_ffn, activation, dtype=dtype) if shared_ffn else None
        self.shared_gate = nn.Linear(hidden, 1, bias=False, dtype=dtype) if shared_ffn and shared_gate else None
        self.last: dict = {}

    def shared_output(self, x):  # (n, h) -> (n, h) or None
        if self.shared is None:
            return None
        out = self.shared(x)
        return out if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * out

    def forward(self, x):  # (..., h) -> (..., h)
        shape = x.shape
        x = x.reshape(-1, self.hidden)
        routing = self.router(x)
        limit = dispatch.capacity(self.capacity_factor, x.shape[0], self.top_k, self.num_experts)
        plan = dispatch.plan(routing.experts, self.num_experts, limit)
        rows = run_experts(self.experts, x[plan.token], plan.kept)
        gates = routing.weights.reshape(-1)[plan.assignment]
        y = torch.zeros_like(x).index_add(0, plan.token, rows * gates[:, None])
        shared = self.shared_output(x)
        if shared is not None:
            y = y + shared
        self.last = {"kept": plan.kept, "dropped": plan.dropped, "capacity": limit,
                     "aux_loss": load_balancing_loss(routing) if self.training else None}
        return y.reshape(shape)


def parameter_counts(hidden: int, ffn: int, num_experts: int, top_k: int, *, shared_ffn: int = 0,
                     activation: str = "swiglu") -> dict:
    """Parameters of one MoE feed-forward layer: all of them, and the *active* ones a token uses (its k
    experts, the shared expert, the router). SwiGLU experts have 3·h·ffn weights, GELU ones 2·h·ffn."""
    per_ffn = (3 if activation == "swiglu" else 2) * hidden
    router = hidden * num_experts
    total = num_experts * per_ffn * ffn + per_ffn * shared_ffn + router
    active = top_k * per_ffn * ffn + per_ffn * shared_ffn + router
    return {"total": total, "active": active, "active_share": active / total}
