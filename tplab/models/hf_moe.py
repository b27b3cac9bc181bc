"""Hugging Face mixture-of-experts models into tplab's GPT with MoE feed-forward layers (tplab.moe.MoE).

    model = from_hf_mixtral(hf)        # MixtralForCausalLM: same weights, same logits; block.mlp is a tplab MoE
    model = from_hf_qwen2_moe(hf)      # Qwen2MoeForCausalLM: routed experts + a gated shared expert
    sharded = parallelize(hf, comm)    # heads over the ranks (TP), experts over the ranks (EP)

Both are Llama with the MLP replaced by a sparse mixture: a router (E x h, no bias) whose softmax -- taken in
float32 whatever the model's dtype -- keeps the top k experts, and E SwiGLU experts. Transformers 5 stores the
experts fused, as 3-D parameters: ``gate_up_proj`` (E, 2·ffn, h), the gate's rows first, and ``down_proj``
(E, h, ffn); they are cut into one tplab Expert each.
- Mixtral renormalizes the k weights to sum to 1; 8 experts, top-2 in the released models.
- Qwen-MoE renormalizes only with ``norm_topk_prob``, adds a shared expert (its own MLP size) scaled by a
  sigmoid gate, may keep some layers dense (``mlp_only_layers``, ``decoder_sparse_step``), and has biases on
  q, k and v but not on the output projection: tplab's GPT has biases everywhere or nowhere, so the output
  projection and dense MLPs get biases of zero (the same function).
A sliding attention window is refused (tplab's attention is causal over the whole sequence).
"""

from __future__ import annotations

import torch

from tplab.models.gpt import GPT, GPTConfig
from tplab.models.hf import _rope_theta
from tplab.moe import MoE


def _llama_like(hf_model, *, ffn: int, bias: bool) -> GPT:
    """tplab's GPT with the embedding, norms, attention and LM head of a Llama-like HF model (MLPs left)."""
    c = hf_model.config
    if c.hidden_act != "silu":
        raise ValueError(f"unsupported activation {c.hidden_act!r}: these experts are SwiGLU (silu)")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head_dim * c.num_attention_heads != c.hidden_size:
        raise ValueError(f"head_dim {head_dim} x {c.num_attention_heads} heads != hidden_size {c.hidden_size}")
    window = getattr(c, "sliding_window", None)
    windowed = getattr(c, "use_sliding_window", window is not None) and window is not None
    if windowed and window < c.max_position_embeddings:
        raise ValueError(f"sliding_window = {window}: tplab's attention has no sliding window")
    m = hf_model.model
    model = GPT(GPTConfig(
        vocab_size=c.vocab_size, block_size=c.max_position_embeddings, n_layer=c.num_hidden_layers,
        n_head=c.num_attention_heads, n_kv_head=c.num_key_value_heads, n_embd=c.hidden_size, ffn_size=ffn,
        mlp="swiglu", norm="rmsnorm", norm_eps=c.rms_norm_eps, norm_dtype=torch.float32, position="rope",
        rope_theta=_rope_theta(c), bias=bias, tie_embeddings=bool(c.tie_word_embeddings),
        dtype=m.embed_tokens.weight.dtype))
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.zero_()  # every bias HF has not got stays zero
        model.wte.weight.copy_(m.embed_tokens.weight)
        for ours, theirs in zip(model.blocks, m.layers):
            ours.norm1.load_state_dict(theirs.input_layernorm.state_dict())
            ours.norm2.load_state_dict(theirs.post_attention_layernorm.state_dict())
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                for kind, tensor in getattr(theirs.self_attn, name).named_parameters():
                    getattr(getattr(ours.attention, name), kind).copy_(tensor)
        model.norm_f.load_state_dict(m.norm.state_dict())
        model.lm_head.weight.copy_(hf_model.lm_head.weight)
    return model


def _copy_experts(moe: MoE, hf_block, ffn: int) -> None:
    moe.router.gate.weight.copy_(hf_block.gate.weight)
    for e, expert in enumerate(moe.experts):
        expert.gate.weight.copy_(hf_block.experts.gate_up_proj[e, :ffn])
        expert.up.weight.copy_(hf_block.experts.gate_up_proj[e, ffn:])
        expert.down.weight.copy_(hf_block.experts.down_proj[e])


def from_hf_mixtral(hf_model) -> GPT:
    """A tplab GPT whose blocks' feed-forward layers are MoE layers, with a ``MixtralForCausalLM``'s weights."""
    c = hf_model.config
    model = _llama_like(hf_model, ffn=c.intermediate_size, bias=False)
    with torch.no_grad():
        for ours, theirs in zip(model.blocks, hf_model.model.layers):
            ours.mlp = MoE(c.hidden_size, c.intermediate_size, c.num_local_experts, c.num_experts_per_tok,
                           activation="swiglu", order="softmax_then_topk", renormalize=True,
                           router_dtype=torch.float32, dtype=model.config.dtype)
            _copy_experts(ours.mlp, theirs.mlp, c.intermediate_size)
    return model


def from_hf_qwen2_moe(hf_model) -> GPT:
    """The same for a ``Qwen2MoeForCausalLM``: routed experts, the gated shared expert, dense layers kept dense."""
    c = hf_model.config
    model = _llama_like(hf_model, ffn=c.intermediate_size, bias=bool(c.qkv_bias))
    with torch.no_grad():
        for ours, theirs in zip(model.blocks, hf_model.model.layers):
            if not hasattr(theirs.mlp, "experts"):  # a dense layer (mlp_only_layers, decoder_sparse_step)
                for name, hf_name in [("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")]:
                    getattr(ours.mlp, name).weight.copy_(getattr(theirs.mlp, hf_name).weight)
                continue
            ours.mlp = MoE(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                           activation="swiglu", order="softmax_then_topk", renormalize=bool(c.norm_topk_prob),
                           shared_ffn=c.shared_expert_intermediate_size, shared_gate=True,
                           router_dtype=torch.float32, dtype=model.config.dtype)
            _copy_experts(ours.mlp, theirs.mlp, c.moe_intermediate_size)
            shared = theirs.mlp.shared_expert
            ours.mlp.shared.gate.weight.copy_(shared.gate_proj.weight)
            ours.mlp.shared.up.weight.copy_(shared.up_proj.weight)
            ours.mlp.shared.down.weight.copy_(shared.down_proj.weight)
            ours.mlp.shared_gate.weight.copy_(theirs.mlp.shared_expert_gate.weight)
    return model
