"""tplab.moe — mixture-of-experts feed-forward layers and expert parallelism (notebook 09).

    router.py           Router: H(x) = xW (+ noise), top-k gating in both orders; load_balancing_loss (Switch)
    experts.py          Expert (SwiGLU or GELU) and run_experts (each expert on its rows)
    dispatch.py         the dispatch plan: assignments grouped by expert, capacity and dropped tokens
    layer.py            MoE: the unsplit layer, with an optional shared expert (the reference)
    exchange.py         all-to-all-v as an autograd function (backward: the exchange the other way)
    expert_parallel.py  ExpertParallelMoE: experts over the ranks, dispatch and combine by all-to-all-v;
                        traffic(): its bytes and messages per rank
    replicated.py       ReplicatedTokensMoE: EP inside a TP model (each rank's slice of replicated tokens)
    imbalance.py        tokens per expert and per rank, max/mean imbalance, makespan, what capacity drops
    train.py            train_router: a tiny MoE language model trained briefly, with or without noise and the
                        auxiliary loss, recording its balance
"""

from tplab.moe.expert_parallel import ExpertParallelMoE, expert_bounds, traffic
from tplab.moe.experts import Expert, run_experts
from tplab.moe.layer import MoE
from tplab.moe.replicated import ReplicatedTokensMoE
from tplab.moe.router import Router, load_balancing_loss

__all__ = ["Expert", "ExpertParallelMoE", "MoE", "ReplicatedTokensMoE", "Router", "expert_bounds",
           "load_balancing_loss", "run_experts", "traffic"]
