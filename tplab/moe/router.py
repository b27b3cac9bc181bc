"""The router of a mixture-of-experts layer: which k of the E experts each token goes to, and with what weight.

    H(x) = x W_g  (+ ε · softplus(x W_noise), ε ~ N(0, 1), while training: noisy top-k)
    G(x) = Softmax(KeepTopK(H(x), k))                       order="topk_then_softmax" (Shazeer et al. 2017)
    G(x) = KeepTopK(Softmax(H(x)), k)  [/ its sum]          order="softmax_then_topk" (Switch, Qwen-MoE;
                                                            renormalize=True: Mixtral, GShard)

The two orders pick the same experts (softmax keeps the order); they differ in the weights: the first
sums to 1 over the k chosen experts, the second is the chosen experts' share of the whole softmax (unless
renormalized, which is the first again, up to rounding). Hugging Face computes Mixtral's softmax in float32
whatever the model's dtype: ``compute_dtype=torch.float32`` does the same, so a float64 copy matches it.

Load balancing. Left alone, a router sends most tokens to a few experts (they get better, so they get more).
Noise spreads the choice while training; the auxiliary loss of the Switch Transformer (Fedus et al. 2021)
pushes the fraction of tokens f_e and the mean probability P_e of every expert towards 1/E:

    aux = E · Σ_e f_e · P_e        (1 when perfectly balanced; E when every token picks one expert)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

ORDERS = ("softmax_then_topk", "topk_then_softmax")


@dataclass
class Routing:
    logits: torch.Tensor   # (n, E) H(x)
    probs: torch.Tensor    # (n, E) softmax over all experts (for the auxiliary loss and the plots)
    weights: torch.Tensor  # (n, k) G(x) at the chosen experts, in x's dtype
    experts: torch.Tensor  # (n, k) int64: the chosen experts, best first


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, *, order: str = "softmax_then_topk",
                 renormalize: bool = True, noise: bool = False, compute_dtype: torch.dtype | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        if order not in ORDERS:
            raise ValueError(f"router order {order!r}: one of {ORDERS}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k = {top_k} must be between 1 and the number of experts {num_experts}")
        self.num_experts, self.top_k, self.order, self.renormalize = num_experts, top_k, order, renormalize
        self.compute_dtype = compute_dtype
        self.gate = nn.Linear(hidden, num_experts, bias=False, dtype=dtype)
        self.noise = nn.Linear(hidden, num_experts, bias=False, dtype=dtype) if noise else None
        if noise:
            nn.init.zeros_(self.noise.weight)  # starts as plain top-k; learns how much noise helps

    def forward(self, x) -> Routing:  # x: (n, h)
        logits = self.gate(x)
        if self.noise is not None and self.training:
            logits = logits + torch.randn_like(logits) * nn.functional.softplus(self.noise(x))
        z = logits if self.compute_dtype is None else logits.to(self.compute_dtype)
        probs = torch.softmax(z, dim=-1)
        if self.order == "softmax_then_topk":
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
            if self.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            top, experts = torch.topk(z, self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)
        return Routing(logits, probs, weights.to(x.dtype), experts)


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """The Switch Transformer's auxiliary loss E · Σ_e f_e · P_e over these tokens (f_e: the share of the
    n·k assignments that went to expert e; P_e: the mean router probability of e). 1 when balanced."""
    n, num_experts = routing.probs.shape
    if n == 0:
        return routing.probs.sum() * 0.0
    counts = torch.bincount(routing.experts.reshape(-1), minlength=num_experts).to(routing.probs.dtype)
    f = counts / routing.experts.numel()
    return num_experts * (f * routing.probs.mean(dim=0)).sum()
