"""A small GPT in one readable file (after nanoGPT): the unsplit reference the tensor-parallel version
must match exactly. GQA, SwiGLU, RMSNorm and rotary-position switches make it a Llama too.

    config = GPTConfig(vocab_size=64, n_layer=2, n_head=4, n_embd=32)
    model = GPT(config)
    logits = model(tokens)               # tokens (b, s) -> logits (b, s, vocab)
    generate(model, tokens, 10)          # greedy, with a KV cache: (b, s + 10)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tplab.layers.attend import attend, extend_cache, past_length
from tplab.layers.norms import RMSNorm
from tplab.layers.rotary import RotaryEmbedding


@dataclass
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 32  # longest sequence
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int | None = None  # None: n_head (multi-head attention); fewer: grouped-query attention
    n_embd: int = 32
    ffn_size: int | None = None  # the MLP's hidden size; None: 4 x n_embd (GPT-2); Llama's is its own
    mlp: str = "gelu"  # "gelu_tanh" (GPT-2's tanh approximation) or "swiglu" (Llama)
    norm: str = "layernorm"  # or "rmsnorm" (Llama)
    norm_eps: float | None = None  # None: 1e-5 (LayerNorm), 1e-6 (RMSNorm)
    norm_dtype: torch.dtype | None = None  # RMSNorm computed in this dtype (Llama: float32); None: the model's
    position: str = "learned"  # "learned" (GPT-2: a table of block_size rows) or "rope" (Llama)
    rope_theta: float = 10000.0
    tie_embeddings: bool = False  # the LM head reuses the token embedding (GPT-2, small Llamas)
    bias: bool = True
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        for name, value, allowed in [("mlp", self.mlp, ("gelu", "gelu_tanh", "swiglu")),
                                     ("norm", self.norm, ("layernorm", "rmsnorm")),
                                     ("position", self.position, ("learned", "rope"))]:
            if value not in allowed:
                raise ValueError(f"GPTConfig.{name} = {value!r}: one of {allowed}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if self.norm_dtype is not None and self.norm != "rmsnorm":
            raise ValueError("norm_dtype applies to RMSNorm only")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def ffn(self) -> int:
        return self.ffn_size or 4 * self.n_embd

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        eps = 1e-6 if config.norm_eps is None else config.norm_eps
        return RMSNorm(config.n_embd, eps=eps, compute_dtype=config.norm_dtype, dtype=config.dtype)
    return nn.LayerNorm(config.n_embd, eps=1e-5 if config.norm_eps is None else config.norm_eps, dtype=config.dtype)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        h, d = config.n_embd, config.n_embd // config.n_head
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, d
        self.q_proj = nn.Linear(h, config.n_head * d, bias=config.bias, dtype=config.dtype)
        self.k_proj = nn.Linear(h, self.n_kv_head * d, bias=config.bias, dtype=config.dtype)
        self.v_proj = nn.Linear(h, self.n_kv_head * d, bias=config.bias, dtype=config.dtype)
        self.o_proj = nn.Linear(config.n_head * d, h, bias=config.bias, dtype=config.dtype)
        self.rotary = RotaryEmbedding(d, config.rope_theta) if config.position == "rope" else None

    def forward(self, x, cache=None, mask=None):  # (b, s, h); cache: this layer's dict of past keys and values
        b, s, h = x.shape
        q = self.q_proj(x).view(b, s, self.n_head, self.head_dim).transpose(1, 2)  # (b, n, s, d)
        k = self.k_proj(x).view(b, s, self.n_kv_head, self.head_dim).transpose(1, 2)  # (b, kv, s, d)
        v = self.v_proj(x).view(b, s, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.rotary is not None:  # rotate q and k by their positions (after those already cached)
            q, k = self.rotary(q, k, first_position=past_length(cache))
        k, v = extend_cache(cache, k, v)  # (b, kv, past + s, d)
        y = attend(q, k, v, causal=True, mask=mask)  # (b, n, s, d)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        h, ffn = config.n_embd, config.ffn
        self.activation = config.mlp
        self.up = nn.Linear(h, ffn, bias=config.bias, dtype=config.dtype)
        self.gate = nn.Linear(h, ffn, bias=config.bias, dtype=config.dtype) if config.mlp == "swiglu" else None
        self.down = nn.Linear(ffn, h, bias=config.bias, dtype=config.dtype)

    def forward(self, x):  # (b, s, h)
        if self.gate is None:
            approximate = "tanh" if self.activation == "gelu_tanh" else "none"
            return self.down(nn.functional.gelu(self.up(x), approximate=approximate))
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))  # (b, s, h)


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.norm1, self.attention = make_norm(config), Attention(config)
        self.norm2, self.mlp = make_norm(config), MLP(config)

    def forward(self, x, cache=None, mask=None):  # mask: an extra attention mask (attend), e.g. packing's
        x = x + self.attention(self.norm1(x), cache, mask)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd, dtype=config.dtype)
        if config.position == "learned":
            self.wpe = nn.Embedding(config.block_size, config.n_embd, dtype=config.dtype)
        else:
            self.wpe = None  # rotary: positions rotate q and k inside attention
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm_f = make_norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False, dtype=config.dtype)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # one (vocab, h) table, read both ways

    def forward(self, tokens, caches=None):  # (b, s) integers; caches: one dict per block, or None
        past = past_length(caches[0] if caches else None)
        if past + tokens.shape[1] > self.config.block_size:
            raise ValueError(f"{past + tokens.shape[1]} positions exceed block_size {self.config.block_size}")
        x = self.wte(tokens)  # (b, s, h)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(past, past + tokens.shape[1], device=tokens.device))
        for i, block in enumerate(self.blocks):
            x = block(x, caches[i] if caches else None)
        return self.lm_head(self.norm_f(x))  # (b, s, vocab)


@torch.no_grad()
def generate(model, tokens, max_new_tokens: int, use_cache: bool = True, eos_token_id=None, pad_token_id=None):
    """Greedy decoding: append the most likely next token ``max_new_tokens`` times. With the KV cache
    each step feeds only the newest token (the keys and values of the others are kept); without it,
    each step recomputes the whole sequence. Works for GPT and its tensor-parallel copy alike; a
    sequence-parallel copy runs the steps whose length splits over the ranks (the prompt) sequence-
    parallel and the others (one new token) tensor-parallel, with the same weights.

    ``eos_token_id`` (an id or a list of ids) ends a row as Hugging Face's greedy ``generate`` does: once
    a row has produced one, it is filled with ``pad_token_id``, and decoding stops when every row has
    ended (the result is then shorter than s + max_new_tokens)."""
    caches = [{} for _ in model.blocks] if use_cache else None
    sequence_parallel = getattr(model, "sequence_parallel", False)
    eos = _as_id_tensor(eos_token_id, tokens.device)
    if eos is not None and pad_token_id is None:
        raise ValueError("eos_token_id needs a pad_token_id: the token that fills the rows that have ended")
    unfinished = torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    out, step_input = tokens, tokens
    try:
        for _ in range(max_new_tokens):
            inputs = step_input if use_cache else out
            if sequence_parallel:
                model.sequence_parallel = inputs.shape[1] % model.comm.size == 0
            logits = model(inputs, caches)  # (b, s, vocab)
            next_token = logits[:, -1].argmax(dim=-1, keepdim=True)  # (b, 1)
            if eos is not None:  # the same logits on every rank: every rank stops at the same step
                next_token = torch.where(unfinished[:, None], next_token, pad_token_id)
                unfinished &= ~torch.isin(next_token[:, 0], eos)
            out = torch.cat([out, next_token], dim=1)
            step_input = next_token
            if not unfinished.any():
                break
    finally:
        if sequence_parallel:
            model.sequence_parallel = True
    return out


def _as_id_tensor(ids, device):
    """None, or the token ids as a 1-D tensor (one id or a list of them)."""
    if ids is None:
        return None
    return torch.as_tensor([ids] if isinstance(ids, int) else list(ids), device=device)
