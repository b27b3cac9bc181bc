"""Hugging Face models into tplab's GPT (then ``parallelize`` shards them like any tplab GPT).

    from transformers import GPT2LMHeadModel
    hf = GPT2LMHeadModel.from_pretrained("gpt2")     # any GPT-2 checkpoint you have locally
    model = from_hf_gpt2(hf)                         # same weights, same logits, tplab's modules
    sharded = parallelize(model, comm)

GPT-2 maps one to one onto gpt.py: learned positions, LayerNorm, GELU (its tanh approximation), biases,
an LM head tied to the token embedding. Its projections are ``Conv1D`` modules, which store the weight
as (in, out): transposed, relative to ``nn.Linear``. The attention's q, k and v come fused in one
``c_attn`` (h -> 3h) and are cut apart here.

Llama (``from_hf_llama``) maps onto the same file with its switches on: rotary positions (no position
table), RMSNorm computed in float32 as Hugging Face does, SwiGLU with Llama's own MLP size, no biases,
grouped-query attention, the LM head tied to the embedding or not. Its projections are ``nn.Linear``
already. What tplab's GPT does not have is refused with a clear error (scaled RoPE variants, a head size
other than hidden / heads, other activations).
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
    if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise ValueError(f"unsupported activation {c.activation_function!r}")
    dtype = hf_model.transformer.wte.weight.dtype
    model = GPT(GPTConfig(vocab_size=c.vocab_size, block_size=c.n_positions, n_layer=c.n_layer, n_head=c.n_head,
                          n_embd=c.n_embd, ffn_size=c.n_inner, norm_eps=c.layer_norm_epsilon,
                          mlp="gelu" if c.activation_function == "gelu" else "gelu_tanh", norm="layernorm",
                          bias=True, tie_embeddings=c.tie_word_embeddings, dtype=dtype))
    h = c.n_embd
    t = hf_model.transformer
    with torch.no_grad():
        model.wte.weight.copy_(t.wte.weight)
        model.wpe.weight.copy_(t.wpe.weight)
        for ours, theirs in zip(model.blocks, t.h):
            for norm, hf_norm in [(ours.norm1, theirs.ln_1), (ours.norm2, theirs.ln_2)]:
                norm.load_state_dict(hf_norm.state_dict())
            a = ours.attention
            a.q_proj = _linear_from_conv1d(theirs.attn.c_attn, slice(0, h))
            a.k_proj = _linear_from_conv1d(theirs.attn.c_attn, slice(h, 2 * h))
            a.v_proj = _linear_from_conv1d(theirs.attn.c_attn, slice(2 * h, 3 * h))
            a.o_proj = _linear_from_conv1d(theirs.attn.c_proj)
            ours.mlp.up = _linear_from_conv1d(theirs.mlp.c_fc)
            ours.mlp.down = _linear_from_conv1d(theirs.mlp.c_proj)
        model.norm_f.load_state_dict(t.ln_f.state_dict())
        model.lm_head.weight.copy_(hf_model.lm_head.weight)
    return model


def _rope_theta(c) -> float:
    """RoPE's base θ from a LlamaConfig (transformers 5: rope_parameters; 4.x: rope_theta, rope_scaling)."""
    params = dict(getattr(c, "rope_parameters", None) or {})
    scaling = getattr(c, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type != "default":
        raise ValueError(f"RoPE type {rope_type!r} (scaled rotary embeddings) is not in tplab's GPT; only 'default'")
    return float(params.get("rope_theta", getattr(c, "rope_theta", 10000.0)))


def from_hf_llama(hf_model) -> GPT:
    """A tplab GPT with the weights of a Hugging Face ``LlamaForCausalLM`` (same logits)."""
    c = hf_model.config
    if c.hidden_act != "silu":
        raise ValueError(f"unsupported activation {c.hidden_act!r}: Llama's MLP is SwiGLU (silu)")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head_dim * c.num_attention_heads != c.hidden_size:
        raise ValueError(f"head_dim {head_dim} x {c.num_attention_heads} heads != hidden_size {c.hidden_size}: "
                         "tplab's GPT needs head_dim = hidden_size / num_attention_heads")
    if bool(c.attention_bias) != bool(getattr(c, "mlp_bias", False)):
        raise ValueError("tplab's GPT has biases everywhere or nowhere: attention_bias must equal mlp_bias")
    m = hf_model.model
    model = GPT(GPTConfig(
        vocab_size=c.vocab_size, block_size=c.max_position_embeddings, n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads, n_kv_head=c.num_key_value_heads, n_embd=c.hidden_size,
        ffn_size=c.intermediate_size, mlp="swiglu", norm="rmsnorm", norm_eps=c.rms_norm_eps,
        norm_dtype=torch.float32, position="rope", rope_theta=_rope_theta(c), bias=bool(c.attention_bias),
        tie_embeddings=bool(c.tie_word_embeddings), dtype=m.embed_tokens.weight.dtype))
    with torch.no_grad():
        model.wte.weight.copy_(m.embed_tokens.weight)
        for ours, theirs in zip(model.blocks, m.layers):
            ours.norm1.load_state_dict(theirs.input_layernorm.state_dict())
            ours.norm2.load_state_dict(theirs.post_attention_layernorm.state_dict())
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(ours.attention, name).load_state_dict(getattr(theirs.self_attn, name).state_dict())
            for name, theirs_name in [("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")]:
                getattr(ours.mlp, name).load_state_dict(getattr(theirs.mlp, theirs_name).state_dict())
        model.norm_f.load_state_dict(m.norm.state_dict())
        model.lm_head.weight.copy_(hf_model.lm_head.weight)
    return model
