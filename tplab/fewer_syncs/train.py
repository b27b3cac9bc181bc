"""Training a FewerSyncsGPT on Tiny Shakespeare, nanoGPT's shakespeare_char recipe.

    data = CharData(tiny_shakespeare())
    rows = train(["spd"] * 4, data, TrainConfig(steps=2000), SimulatedRanks(4), device="cuda")

Defaults are nanoGPT's config/train_shakespeare_char.py where the student project says nothing, at its size
(4 layers, 4 heads, 128 dimensions, 2000 steps): AdamW (betas 0.9/0.99, weight decay 0.1 on matrices
and embeddings), learning rate 1e-3 with 100 warm-up steps and a cosine decay to 1e-4 at the last
step, gradient clipping at 1.0, batches of 64 windows of 256 characters. No dropout (nanoGPT's recipe
for this model size turns it off; it would also make simulated and real ranks draw different masks).

On real ranks (RealRanks) every rank draws the same batches and holds its own shards; the global
gradient norm sums the shards' squares over the ranks, so clipping, and every step, is the same as with
simulated ranks. Validation (and training) loss are estimated on the same batches for every model.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch

from tplab.fewer_syncs.model import FewerSyncsGPT, syncs_per_forward, weight_grad_syncs
from tplab.layers import mappings


@dataclass
class TrainConfig:
    steps: int = 2000
    batch_size: int = 64
    block_size: int = 256
    n_head: int = 4
    n_embd: int = 128
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple = (0.9, 0.99)
    grad_clip: float = 1.0
    eval_interval: int = 250
    eval_iters: int = 200
    seed: int = 1337
    dtype: torch.dtype = torch.float32


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then a cosine from learning_rate down to min_lr at the last step (nanoGPT's)."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_steps + 1)
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def make_optimizer(model, cfg: TrainConfig, device) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = torch.device(device).type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=cfg.betas, fused=fused or None)


def _norm(grads) -> torch.Tensor:
    if not grads:
        return torch.zeros(())
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6: a few fused kernels
        return torch.nn.utils.get_total_norm(grads).double().cpu()
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).double().cpu()


def clip_grad_norm(model, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_ over the *whole* model: the sharded parameters' squares are summed
    over the ranks (one scalar all-reduce on real ranks), the replicated ones counted once."""
    sharded = [p.grad for p in model.sharded_parameters() if p.grad is not None]
    replicated = [p.grad for p in model.replicated_parameters() if p.grad is not None]
    squares = model.ranks.sum_over_ranks(_norm(sharded).square().reshape(1))
    norm = float((squares + _norm(replicated).square()).sqrt())
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        for g in sharded + replicated:
            g.mul_(scale)
    return norm


@torch.no_grad()
def estimate_loss(model, data, cfg: TrainConfig, step: int, device) -> dict:
    """Mean loss over eval_iters batches per split; the batches depend on (seed, step) only, so every
    model is measured on the same text."""
    model.eval()
    out = {}
    for k, split in enumerate(("train", "val")):
        g = torch.Generator().manual_seed(cfg.seed * 1000003 + 2 * step + k)
        losses = [float(model(*data.batch(split, cfg.batch_size, cfg.block_size, g, device))[1])
                  for _ in range(cfg.eval_iters)]
        out[f"{split}_loss"] = sum(losses) / len(losses)
    model.train()
    return out


def _synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def train(pattern, data, cfg: TrainConfig, ranks, device="cpu", name=None, progress=None) -> list[dict]:
    """Train one configuration; returns one row per evaluation (step 0, every eval_interval, the end).
    Asserts the first step's counted all-reduces against the formulas. ``progress(row)`` is called with
    each row as it is made."""
    model = FewerSyncsGPT.create(pattern, ranks, data.vocab_size, cfg.block_size, cfg.n_head, cfg.n_embd,
                                 cfg.seed, cfg.dtype).to(device)
    optimizer = make_optimizer(model, cfg, device)
    batches = torch.Generator().manual_seed(cfg.seed)  # the same batches on every rank and for every model
    name = name or "-".join(pattern)
    rows, timed_seconds, timed_steps = [], 0.0, 0
    counted = {}
    for step in range(cfg.steps + 1):
        if step % cfg.eval_interval == 0 or step == cfg.steps:
            row = {"config": name, "pattern": ",".join(pattern), "p": ranks.size, "step": step,
                   "lr": learning_rate(min(step, cfg.steps - 1), cfg), **estimate_loss(model, data, cfg, step, device),
                   "ms_per_step": 1e3 * timed_seconds / timed_steps if timed_steps else float("nan")}
            rows.append(row)
            if progress:
                progress(row)
        if step == cfg.steps:
            break
        _synchronize(device)
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg)
        x, y = data.batch("train", cfg.batch_size, cfg.block_size, batches, device)
        if step == 0:
            mappings.calls.clear()
        _, loss = model(x, y)
        if step == 0:
            counted["forward"] = mappings.calls["allreduce"]
        loss.backward()
        if step == 0:
            counted["backward"] = mappings.calls["allreduce"] - counted["forward"]
            counted["weights"] = mappings.calls["weight_grad_allreduce"]
            _check_counts(pattern, counted)
        if cfg.grad_clip:
            clip_grad_norm(model, cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _synchronize(device)
        if step >= 10:  # the first steps warm up kernels and allocators: not timed
            timed_seconds += time.perf_counter() - started
            timed_steps += 1
    for row in rows:
        row.update(syncs_forward=counted["forward"], syncs_backward=counted["backward"],
                   weight_grad_syncs=counted["weights"], parameters=model.num_parameters(),
                   **{k: v for k, v in asdict(cfg).items() if k in ("steps", "batch_size", "block_size",
                                                                    "n_head", "n_embd", "eval_iters")},
                   n_layer=len(pattern), device=str(torch.device(device)))
    return rows


def _check_counts(pattern, counted):
    expected = {"forward": syncs_per_forward(pattern), "backward": syncs_per_forward(pattern),
                "weights": weight_grad_syncs(pattern)}
    if counted != expected:
        raise AssertionError(f"pattern {pattern}: counted all-reduces {counted}, the formulas say {expected}")
