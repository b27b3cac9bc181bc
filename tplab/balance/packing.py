"""Several sequences in one forward pass: padded to a rectangle, or packed into one row.

    padded   (b, L): every sequence filled up to the longest with a pad token. Right padding and a
             causal mask keep the real tokens exact (no real token looks ahead at a pad), but the
             b·L - sum(s) pad positions are computed and thrown away: the *padding waste*.
    packed   (1, T), T = sum(s): the sequences laid end to end. Positions restart at 0 for each, and a
             block-diagonal causal mask lets a token see only the earlier tokens *of its own sequence*:

                 lengths 3, 2      mask (1 = may attend)      positions
                                   1 . . . .                  0 1 2 0 1
                                   1 1 . . .
                                   1 1 1 . .
                                   . . . 1 .
                                   . . . 1 1

             No waste in the linear layers. (This dense mask still computes all T² attention scores;
             FlashAttention's variable-length kernels skip the empty blocks.)

    batch = make_batch([tokens_a, tokens_b], "pack")   # tokens: 1-D int tensors
    logits = forward(model, batch)                      # GPT or its tensor-parallel copy
    per_sequence = batch.split(logits)                  # [(s_a, vocab), (s_b, vocab)] == separate runs

``embed``, ``run_block`` and ``head`` are the same forward pass in three pieces, for pipeline stages.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("single", "pad", "pack")


def block_diagonal_causal_mask(lengths) -> torch.Tensor:
    """(T, T) bool, True where query i may attend key j: same sequence and j <= i."""
    owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.as_tensor(lengths, dtype=torch.long))
    same_sequence = owner[:, None] == owner[None, :]
    return same_sequence & torch.ones(len(owner), len(owner), dtype=torch.bool).tril()


def packed_positions(lengths) -> torch.Tensor:
    """(T,) position of every packed token within its own sequence: 0, 1, ..., s_0-1, 0, 1, ..."""
    return torch.cat([torch.arange(int(s)) for s in lengths]) if len(lengths) else torch.zeros(0, dtype=torch.long)


@dataclass
class Batch:
    """One forward pass's input. tokens (b, L); positions (L,); mask (L, L) bool or None (plain causal)."""

    mode: str
    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | None
    lengths: list[int]

    @property
    def real_tokens(self) -> int:
        return int(sum(self.lengths))

    @property
    def slots(self) -> int:
        """Positions the model computes (real + padding)."""
        return int(self.tokens.numel())

    @property
    def padding_waste(self) -> float:
        return 1 - self.real_tokens / self.slots if self.slots else 0.0

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        """The model's output (b, L, ...) cut back into one (s_i, ...) tensor per sequence."""
        if self.mode == "pack":
            return list(out[0].split(self.lengths))
        return [out[i, :s] for i, s in enumerate(self.lengths)]


def make_batch(token_list, mode: str = "pack", pad_id: int = 0) -> Batch:
    """A Batch from 1-D token tensors. "single" requires exactly one sequence."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    lengths = [int(t.numel()) for t in token_list]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"a batch needs one or more non-empty sequences, got lengths {lengths}")
    if mode == "single":
        if len(lengths) != 1:
            raise ValueError(f"mode 'single' takes one sequence, got {len(lengths)}")
        return Batch(mode, token_list[0].reshape(1, -1), torch.arange(lengths[0]), None, lengths)
    if mode == "pad":
        longest = max(lengths)
        tokens = torch.full((len(lengths), longest), pad_id, dtype=torch.long)
        for i, t in enumerate(token_list):
            tokens[i, : t.numel()] = t
        return Batch(mode, tokens, torch.arange(longest), None, lengths)
    tokens = torch.cat([t.reshape(-1) for t in token_list]).reshape(1, -1)
    return Batch(mode, tokens, packed_positions(lengths), block_diagonal_causal_mask(lengths), lengths)


# ---- the forward pass, in the pieces a pipeline stage needs ----------------------------------------------


def embed(model, tokens, positions) -> torch.Tensor:
    """Token embeddings, plus learned position embeddings if the model has them: (b, L) -> (b, L, h).
    (Rotary models rotate q and k inside attention instead; their packed tokens keep positions 0..T-1,
    which changes nothing: a rotary score depends only on the distance between two tokens.)"""
    if len(positions) and int(positions.max()) >= model.config.block_size:
        raise ValueError(f"position {int(positions.max())} exceeds the model's block_size {model.config.block_size}")
    x = model.wte(tokens)
    wpe = getattr(model, "wpe", None)
    return x if wpe is None else x + wpe(positions)


def run_block(block, x, mask=None) -> torch.Tensor:
    """One transformer block (dense or tensor-parallel); ``mask`` None means plain causal, else it goes to
    the block's attention (``tplab.layers.attend``) together with the causal mask."""
    return block(x) if mask is None else block(x, mask=mask)


def head(model, x) -> torch.Tensor:
    """Final norm and LM head: (b, L, h) -> (b, L, vocab)."""
    return model.lm_head(model.norm_f(x))


@torch.no_grad()
def forward(model, batch: Batch) -> torch.Tensor:
    """Logits (b, L, vocab) of a Batch; for "single" and "pad" this is exactly ``model(batch.tokens)``."""
    x = embed(model, batch.tokens, batch.positions)
    for block in model.blocks:
        x = run_block(block, x, batch.mask)
    return head(model, x)


def make_batches(lengths, max_tokens: int | None = None, batch_size: int | None = None,
                 sort: bool = False) -> list[list[int]]:
    """Group sequence indices into batches of at most ``batch_size`` sequences and/or ``max_tokens``
    real tokens (a longer sequence gets a batch of its own). ``sort``: longest first, so that sequences
    of similar length share a batch (less padding: length bucketing); otherwise arrival order."""
    if max_tokens is None and batch_size is None:
        raise ValueError("give max_tokens and/or batch_size")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)) if sort else range(len(lengths))
    batches, current, tokens = [], [], 0
    for i in order:
        full = (batch_size is not None and len(current) >= batch_size) or (
            max_tokens is not None and current and tokens + lengths[i] > max_tokens)
        if full:
            batches.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += int(lengths[i])
    if current:
        batches.append(current)
    return batches
