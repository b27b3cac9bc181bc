"""Hugging Face models into tplab's GPT (then ``parallelize`` shards them like any tplab GPT).

    from transformers import GPT2LMHeadModel
    hf = GPT2LMHeadModel.from_pretrained("gpt2")     # any GPT-2 checkpoint you have locally
    model = from_hf_gpt2(hf)                         # same weights, same logits, tplab's modules
    sharded = parallelize(model, comm)

GPT-2 maps one to one onto gpt.py: learned positions, LayerNorm, GELU (its tanh approximation), biases,
an LM head tied to the token embedding. Its projections are ``Conv1D`` modules, which store the weight
as (in, out): transposed, relative to ``nn.Linear``. The attention's q, k and v come fused in one
``c_attn`` (h -> 3h) and are cut apart here.
"""

from __future__ import annotations

import torch
from torch import nn

from tplab.models.gpt import GPT, GPTConfig


def _linear_from_conv1d(conv, rows=None) -> nn.Linear:
    """nn.Linear computing what HF's Conv1D computes (optionally only output features ``rows``)."""
    weight, bias = conv.weight.detach().T, conv.bias.detach()  # (out, in), (out,)
    if rows is not None:
        weight, bias = weight[rows], bias[rows]
    linear = nn.Linear(weight.shape[1], weight.shape[0], dtype=weight.dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    return linear


def from_hf_gpt2(hf_model) -> GPT:
    """A tplab GPT with the weights of a Hugging Face ``GPT2LMHeadModel``."""
    c = hf_model.config
    if c.n_inner not in (None, 4 * c.n_embd):
        raise ValueError(f"tplab's GPT has an MLP of 4 x hidden; this model's is {c.n_inner}")
    if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise ValueError(f"unsupported activation {c.activation_function!r}")
    dtype = hf_model.transformer.wte.weight.dtype
    model = GPT(GPTConfig(vocab_size=c.vocab_size, block_size=c.n_positions, n_layer=c.n_layer, n_head=c.n_head,
                          n_embd=c.n_embd, mlp="gelu" if c.activation_function == "gelu" else "gelu_tanh",
                          norm="layernorm", bias=True, dtype=dtype))
    h = c.n_embd
    t = hf_model.transformer
    with torch.no_grad():
        model.wte.weight.copy_(t.wte.weight)
        model.wpe.weight.copy_(t.wpe.weight)
        for ours, theirs in zip(model.blocks, t.h):
            for norm, hf_norm in [(ours.norm1, theirs.ln_1), (ours.norm2, theirs.ln_2)]:
                norm.load_state_dict(hf_norm.state_dict())
                norm.eps = hf_norm.eps
            a = ours.attention
            a.q_proj = _linear_from_conv1d(theirs.attn.c_attn, slice(0, h))
            a.k_proj = _linear_from_conv1d(theirs.attn.c_attn, slice(h, 2 * h))
            a.v_proj = _linear_from_conv1d(theirs.attn.c_attn, slice(2 * h, 3 * h))
            a.o_proj = _linear_from_conv1d(theirs.attn.c_proj)
            ours.mlp.up = _linear_from_conv1d(theirs.mlp.c_fc)
            ours.mlp.down = _linear_from_conv1d(theirs.mlp.c_proj)
        model.norm_f.load_state_dict(t.ln_f.state_dict())
        model.norm_f.eps = t.ln_f.eps
        model.lm_head.weight.copy_(hf_model.lm_head.weight)
    return model
