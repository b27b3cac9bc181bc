"""A character-level GPT whose blocks follow a pattern of block types: the student project's experiment.

    ranks = SimulatedRanks(4)                     # or RealRanks(tplab.comm.world())
    model = FewerSyncsGPT.create(["spd", "parallel"] * 2, ranks, vocab_size=65)
    logits, loss = model(tokens, targets)         # tokens (b, s) -> logits (b, s, vocab)

The four configurations of the student project (4 layers, 4 heads, 128 dimensions) are ``PATTERNS``. A pattern is
grouped into stages: each 'tp' and 'spd' entry is a block of its own, each run of consecutive
'parallel' entries one ParallelRun. Embeddings, final norm and LM head are replicated, as in the project
(a 65-character vocabulary is not worth splitting): they cost no communication.

All-reduces per forward pass, each moving one (b, s, h) activation (``syncs_per_forward``):

    2 per 'tp' block  +  1 per 'spd' block  +  1 per run of 'parallel' blocks

and as many in the backward pass (each f of the forward is an all-reduce there), plus, in the backward
pass of every 'spd' block and every block of a parallel run, one small all-reduce of the gradients of
the replicated norms and biases it applied on each rank's own stream (``weight_grad_syncs``).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.nn import functional as F

from tplab.fewer_syncs.parallel_block import ParallelRun
from tplab.fewer_syncs.shard import BlockShard
from tplab.fewer_syncs.spd_block import SPDBlock
from tplab.fewer_syncs.tp_block import TPBlock

BLOCK_TYPES = ("tp", "spd", "parallel")

# the student project's four Shakespeare configurations, by its names, and the syncs it counts for them
PATTERNS = {
    "baseline": ["tp"] * 4,
    "distributed": ["spd"] * 4,
    "spd-parallel": ["spd", "parallel"] * 2,
    "parallel-only": ["parallel"] * 4,
}
PROJECT_SYNC_COUNTS = {"baseline": 8, "distributed": 4, "spd-parallel": 4, "parallel-only": 2}


def check_pattern(pattern) -> list[str]:
    pattern = list(pattern)
    if not pattern:
        raise ValueError("a block pattern needs at least one block")
    unknown = sorted({b for b in pattern if b not in BLOCK_TYPES})
    if unknown:
        raise ValueError(f"unknown block type(s) {unknown}: each entry is one of {BLOCK_TYPES}")
    return pattern


def stages_of(pattern) -> list[tuple[str, int]]:
    """[(block type, how many)]: runs of 'parallel' grouped, every other block on its own."""
    stages = []
    for kind, run in itertools.groupby(check_pattern(pattern)):
        n = len(list(run))
        stages += [(kind, n)] if kind == "parallel" else [(kind, 1)] * n
    return stages


def syncs_per_forward(pattern) -> int:
    """All-reduces of activations in one forward pass (as many again in the backward pass)."""
    per_stage = {"tp": 2, "spd": 1, "parallel": 1}
    return sum(per_stage[kind] for kind, _ in stages_of(pattern))


def weight_grad_syncs(pattern) -> int:
    """Small all-reduces of replicated weights' gradients in one backward pass (0 for TP blocks)."""
    return sum(1 for b in check_pattern(pattern) if b != "tp")


def nanogpt_init(model: nn.Module, n_layer: int, seed: int) -> None:
    """nanoGPT's initialisation, drawn from ``seed``: N(0, 0.02) weights, zero biases, and the residual
    projections (attention output, MLP down) scaled by 1/sqrt(2 n_layer)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                residual = name.endswith(("o_proj", "down"))
                std = 0.02 / (2 * n_layer) ** 0.5 if residual else 0.02
                module.weight.copy_(torch.empty_like(module.weight).normal_(0.0, std, generator=g))
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()


def dense_gpt(n_layer, vocab_size, block_size=256, n_head=4, n_embd=128, seed=1337, dtype=torch.float32):
    """The unsplit tplab GPT whose weights a FewerSyncsGPT is cut from (nanoGPT-initialised)."""
    from tplab.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                       n_embd=n_embd, bias=True, dtype=dtype)
    model = GPT(config)
    nanogpt_init(model, n_layer, seed)
    return model


class FewerSyncsGPT(nn.Module):
    def __init__(self, dense, pattern, ranks):
        super().__init__()
        self.pattern, self.ranks = check_pattern(pattern), ranks
        if len(self.pattern) != len(dense.blocks):
            raise ValueError(f"the pattern has {len(self.pattern)} blocks, the model {len(dense.blocks)}")
        self.block_size = dense.config.block_size
        self.wte = nn.Embedding.from_pretrained(dense.wte.weight.detach().clone(), freeze=False)
        self.wpe = nn.Embedding.from_pretrained(dense.wpe.weight.detach().clone(), freeze=False)
        dense_blocks, self.stages = iter(dense.blocks), nn.ModuleList()
        for kind, n in stages_of(self.pattern):
            if kind == "parallel":
                self.stages.append(ParallelRun.from_dense([next(dense_blocks) for _ in range(n)], ranks))
            else:
                self.stages.append({"tp": TPBlock, "spd": SPDBlock}[kind].from_dense(next(dense_blocks), ranks))
        self.norm_f = nn.LayerNorm(dense.config.n_embd, dtype=dense.config.dtype)
        self.norm_f.load_state_dict(dense.norm_f.state_dict())
        self.lm_head = nn.Linear(dense.config.n_embd, dense.config.vocab_size, bias=False, dtype=dense.config.dtype)
        self.lm_head.weight = self.wte.weight  # tied, as in nanoGPT

    @classmethod
    def create(cls, pattern, ranks, vocab_size, block_size=256, n_head=4, n_embd=128, seed=1337,
               dtype=torch.float32) -> "FewerSyncsGPT":
        """A fresh model: the same weights for the same seed, whatever the ranks (simulated or real)."""
        dense = dense_gpt(len(check_pattern(pattern)), vocab_size, block_size, n_head, n_embd, seed, dtype)
        return cls(dense, pattern, ranks)

    def forward(self, tokens, targets=None):  # tokens (b, s) integers
        if tokens.shape[1] > self.block_size:
            raise ValueError(f"{tokens.shape[1]} positions exceed block_size {self.block_size}")
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)  # (b, s, h)
        for stage in self.stages:
            x = stage(x)  # (b, s, h), the same on every rank between stages
        logits = self.lm_head(self.norm_f(x))  # (b, s, vocab)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    # ---- what the optimizer needs to know --------------------------------------------------------------
    def sharded_parameters(self):
        """Parameters that hold this process's shards (different on every real rank)."""
        return [p for m in self.modules() if isinstance(m, BlockShard) for p in m.parameters()]

    def replicated_parameters(self):
        """Parameters every rank holds whole (with the same gradient once the backward pass is done)."""
        sharded = {id(p) for p in self.sharded_parameters()}
        return [p for p in self.parameters() if id(p) not in sharded]

    def num_parameters(self) -> int:
        """Parameters of the whole (unsplit) model, whatever this process holds."""
        local = sum(p.numel() for p in self.sharded_parameters())
        total = self.ranks.sum_over_ranks(torch.tensor(float(local)))
        return int(total) + sum(p.numel() for p in self.replicated_parameters())
