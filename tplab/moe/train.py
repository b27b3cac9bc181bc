"""A short training run that shows what noise and the auxiliary loss do to a router's balance.

The model is tiny on purpose (it runs in seconds on a CPU rank): a character's embedding plus the previous
character's, one MoE layer, an LM head predicting the next character. Its router starts near uniform and,
trained on the language-model loss alone, drifts towards a few favourite experts; the Switch Transformer's
auxiliary loss (``aux_coef``, 0.01 in the paper) and noisy top-k gating (``noise``) push back. ``history``
records, every ``every`` steps, the loss and the max/mean tokens per expert on a fixed held-out batch.
"""

from __future__ import annotations

import torch
from torch import nn

from tplab.moe.imbalance import max_over_mean, route_counts
from tplab.moe.layer import MoE


class TinyMoELM(nn.Module):
    def __init__(self, vocab: int, hidden: int = 32, experts: int = 8, top_k: int = 2, *, noise: bool = False):
        super().__init__()
        self.now, self.before = nn.Embedding(vocab, hidden), nn.Embedding(vocab, hidden)
        self.moe = MoE(hidden, 2 * hidden, experts, top_k, activation="gelu", noise=noise)
        self.head = nn.Linear(hidden, vocab)

    def hidden_states(self, ids):  # (b, s) -> (b, s, h): what the router sees
        previous = torch.cat([ids[:, :1], ids[:, :-1]], dim=1)
        return self.now(ids) + self.before(previous)

    def forward(self, ids):
        x = self.hidden_states(ids)
        return self.head(x + self.moe(x))


def train_router(ids: torch.Tensor, *, steps: int = 200, batch: int = 16, block: int = 64, aux_coef: float = 0.0,
                 noise: bool = False, experts: int = 8, top_k: int = 2, lr: float = 3e-3, every: int = 20,
                 seed: int = 0) -> tuple[TinyMoELM, list[dict]]:
    """Train on the 1-D token ids (e.g. Tiny Shakespeare's characters); returns the model and its history."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    vocab = int(ids.max()) + 1
    model = TinyMoELM(vocab, experts=experts, top_k=top_k, noise=noise)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    held_out = ids[-(8 * block):].reshape(8, block)  # the same tokens at every measurement
    history, last_loss = [], None
    for step in range(steps + 1):
        if step % every == 0 or step == steps:
            model.eval()
            counts = route_counts(model.moe, model.hidden_states(held_out).detach())["kept"]
            history.append({"step": step, "aux_coef": aux_coef, "noise": noise,
                            "imbalance": max_over_mean(counts), "tokens_per_expert": counts.tolist()})
        if step == steps:
            if last_loss is not None:
                history[-1]["loss"] = last_loss  # the last training batch's loss
            break  # (left in eval mode: no noise when it is measured afterwards)
        model.train()
        starts = torch.randint(0, len(ids) - block - 1 - 8 * block, (batch,), generator=g)
        x = torch.stack([ids[s:s + block] for s in starts])
        y = torch.stack([ids[s + 1:s + block + 1] for s in starts])
        logits = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
        total = loss + aux_coef * model.moe.last["aux_loss"]
        optimizer.zero_grad()
        total.backward()
        optimizer.step()
        last_loss = float(loss.detach())
        history[-1].setdefault("loss", last_loss)
    return model, history
