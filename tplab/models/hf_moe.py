"""Hugging Face Mixtral into tplab's GPT with mixture-of-experts feed-forward layers (tplab.moe.MoE).

    from transformers import MixtralForCausalLM
    model = from_hf_mixtral(hf)                      # same weights, same logits; block.mlp is a tplab MoE
    sharded = parallelize(hf, comm)                  # heads over the ranks (TP), experts over the ranks (EP)

Mixtral is Llama with its MLP replaced by a sparse mixture: a router (E x h, no bias) whose softmax -- taken in
float32 whatever the model's dtype -- keeps the top k experts and renormalizes their weights, and E SwiGLU
experts. Transformers 5 stores the experts fused, as 3-D parameters: ``gate_up_proj`` (E, 2·ffn, h), the gate's
rows first, and ``down_proj`` (E, h, ffn); they are cut into one tplab Expert each. A sliding attention
window is refused (tplab's attention is causal over the whole sequence).
"""

from __future__ import annotations

import torch

from tplab.models.gpt import GPT, GPTConfig
from tplab.models.hf import _rope_theta
from tplab.moe import MoE


def from_hf_mixtral(hf_model) -> GPT:
    """A tplab GPT whose blocks' feed-forward layers are MoE layers, with a ``MixtralForCausalLM``'s weights."""
    c = hf_model.config
    if c.hidden_act != "silu":
        raise ValueError(f"unsupported activation {c.hidden_act!r}: Mixtral's experts are SwiGLU (silu)")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head_dim * c.num_attention_heads != c.hidden_size:
        raise ValueError(f"head_dim {head_dim} x {c.num_attention_heads} heads != hidden_size {c.hidden_size}")
    if getattr(c, "sliding_window", None) is not None and c.sliding_window < c.max_position_embeddings:
        raise ValueError(f"sliding_window = {c.sliding_window}: tplab's attention has no sliding window")
    m = hf_model.model
    dtype = m.embed_tokens.weight.dtype
    model = GPT(GPTConfig(
        vocab_size=c.vocab_size, block_size=c.max_position_embeddings, n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads, n_kv_head=c.num_key_value_heads, n_embd=c.hidden_size,
        ffn_size=c.intermediate_size, mlp="swiglu", norm="rmsnorm", norm_eps=c.rms_norm_eps,
        norm_dtype=torch.float32, position="rope", rope_theta=_rope_theta(c), bias=False,
        tie_embeddings=bool(c.tie_word_embeddings), dtype=dtype))
    ffn = c.intermediate_size
    with torch.no_grad():
        model.wte.weight.copy_(m.embed_tokens.weight)
        for ours, theirs in zip(model.blocks, m.layers):
            ours.norm1.load_state_dict(theirs.input_layernorm.state_dict())
            ours.norm2.load_state_dict(theirs.post_attention_layernorm.state_dict())
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(ours.attention, name).load_state_dict(getattr(theirs.self_attn, name).state_dict())
            moe = MoE(c.hidden_size, ffn, c.num_local_experts, c.num_experts_per_tok, activation="swiglu",
                      order="softmax_then_topk", renormalize=True, router_dtype=torch.float32, dtype=dtype)
            moe.router.gate.weight.copy_(theirs.mlp.gate.weight)
            for e, expert in enumerate(moe.experts):
                expert.gate.weight.copy_(theirs.mlp.experts.gate_up_proj[e, :ffn])
                expert.up.weight.copy_(theirs.mlp.experts.gate_up_proj[e, ffn:])
                expert.down.weight.copy_(theirs.mlp.experts.down_proj[e])
            ours.mlp = moe
        model.norm_f.load_state_dict(m.norm.state_dict())
        model.lm_head.weight.copy_(hf_model.lm_head.weight)
    return model
