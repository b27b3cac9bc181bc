"""Notebook 09's check of a sharded Hugging Face Mixtral, on every rank (``cluster.run(check_mixtral)``).

A small random MixtralForCausalLM (no download), float64 with Hugging Face's eager experts (its default
experts kernel has no float64), split by ``parallelize``: attention heads over the ranks (TP), experts over
the ranks (EP). Returns one row, the same on every rank: the largest relative difference of the logits,
whether greedy generation gave Hugging Face's tokens, and how the experts were split.
"""

from __future__ import annotations

import torch

from tplab.comm import world
from tplab.models.parallel import parallelize


def check_mixtral(comm=None, *, experts=5, new_tokens=8, seed=7) -> dict:
    from transformers import MixtralConfig, MixtralForCausalLM

    comm = world() if comm is None else comm
    p = comm.size
    config = MixtralConfig(vocab_size=8 * p, hidden_size=8 * p, intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=2 * p, num_key_value_heads=p, max_position_embeddings=64,
                           num_local_experts=experts, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0)
    config._experts_implementation = "eager"
    torch.manual_seed(seed)  # the same model on every rank
    hf = MixtralForCausalLM(config).to(torch.float64).eval()
    sharded = parallelize(hf, comm)
    tokens = torch.randint(0, 8 * p, (2, 7), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        want, got = hf(tokens).logits, sharded(tokens).logits
    error = float((got - want).abs().max() / want.abs().max())
    prompt = tokens[:1, :4]
    same = torch.equal(sharded.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                        pad_token_id=0),
                       hf.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                   pad_token_id=0))
    bounds = sharded.gpt.blocks[0].mlp.ep.bounds
    return {"ranks": p, "experts": experts,
            "experts_per_rank": "/".join(str(bounds[j + 1] - bounds[j]) for j in range(p)),
            "max_rel_logit_error": max(comm.allgather_object(error)),
            "greedy_tokens_equal_hf": all(comm.allgather_object(same))}
