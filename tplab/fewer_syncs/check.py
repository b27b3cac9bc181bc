"""The notebook's correctness check, run on every rank: each pattern on real ranks against its simulation,
the all-TP model against the unsplit GPT, and the all-reduces counted against the formulas.

    rows = check_on_ranks()          # collective: cluster.run(check_on_ranks)[0]
"""

from __future__ import annotations

import torch

from tplab.fewer_syncs.model import PATTERNS, FewerSyncsGPT, dense_gpt, syncs_per_forward, weight_grad_syncs
from tplab.fewer_syncs.ranks import RealRanks, SimulatedRanks
from tplab.layers import mappings


def _relative(a, b) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


def _run(model, tokens, targets):
    """Logits, and the all-reduces counted in the forward pass, the backward pass, and for weights."""
    mappings.calls.clear()
    logits, loss = model(tokens, targets)
    forward = mappings.calls["allreduce"]
    loss.backward()
    return logits, (forward, mappings.calls["allreduce"] - forward, mappings.calls["weight_grad_allreduce"])


def check_on_ranks(patterns=None, n_head=None, head_dim=8, vocab_size=65, comm=None) -> list[dict]:
    """One row per pattern, the same on every rank. float64, so differences show the arithmetic's order
    only (~1e-15), not a different computation."""
    from tplab.comm import world

    comm = comm or world()
    p = comm.size
    n_head = n_head or (4 if 4 % p == 0 else p)
    tokens = torch.randint(0, vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(tokens, -1, dims=1)
    rows = []
    for name, pattern in (patterns or PATTERNS).items():
        dense = dense_gpt(len(pattern), vocab_size, 32, n_head, n_head * head_dim, dtype=torch.float64)
        real_logits, counted = _run(FewerSyncsGPT(dense, pattern, RealRanks(comm)), tokens, targets)
        sim_logits, sim_counted = _run(FewerSyncsGPT(dense, pattern, SimulatedRanks(p)), tokens, targets)
        row = {"config": name, "pattern": ",".join(pattern), "p": p,
               "forward_allreduces": counted[0], "backward_allreduces": counted[1],
               "weight_grad_allreduces": counted[2], "formula": syncs_per_forward(pattern),
               "formula_weights": weight_grad_syncs(pattern), "simulation_counts_the_same": counted == sim_counted,
               "real_vs_simulated": _relative(real_logits, sim_logits), "tp_vs_unsplit_gpt": float("nan")}
        if set(pattern) == {"tp"}:  # all TP: exactly the unsplit GPT (with nanoGPT's tied LM head)
            dense.lm_head.weight = dense.wte.weight
            with torch.no_grad():
                row["tp_vs_unsplit_gpt"] = _relative(real_logits, dense(tokens))
        worst = comm.allgather_object(row["real_vs_simulated"])
        row["real_vs_simulated"] = max(worst)
        rows.append(row)
    return rows
