"""A sharded Hugging Face causal LM that answers like the model it came from.

    sharded = parallelize(hf_model, comm)                              # GPT2LMHeadModel or LlamaForCausalLM
    sharded(input_ids).logits                                          # HF's logits, on every rank
    sharded.generate(input_ids, max_new_tokens=20, do_sample=False)    # HF's greedy tokens: prompt + new

Inside is tplab's ``ParallelGPT`` (``sharded.gpt``), the converted model split over the ranks; this class
only speaks Hugging Face's language around it: the output object (the type the Hugging Face model returns,
with only ``logits`` set: ``past_key_values`` is None, the KV cache lives inside ``generate``) and
``generate``'s arguments.
``generate`` is greedy decoding only: sampling, beams, penalties, forced or suppressed tokens, padding
(an attention mask with zeros) and score dictionaries raise an error that names the option (hf_greedy.py).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import (
    CausalLMOutputWithCrossAttentions,
    CausalLMOutputWithPast,
    MoeCausalLMOutputWithPast,
)

from tplab.models.gpt import generate as greedy_generate
from tplab.models.hf_greedy import greedy_settings


# The output type each Hugging Face model's forward returns (only .logits is filled in here)
OUTPUT_TYPES = {"GPT2LMHeadModel": CausalLMOutputWithCrossAttentions, "LlamaForCausalLM": CausalLMOutputWithPast,
                "MixtralForCausalLM": MoeCausalLMOutputWithPast, "Qwen2MoeForCausalLM": MoeCausalLMOutputWithPast}


class ShardedCausalLM(nn.Module):
    def __init__(self, gpt, hf_model):  # gpt: hf_model converted and split, a ParallelGPT (parallel.py)
        super().__init__()
        self.gpt = gpt
        self.config, self.generation_config = hf_model.config, hf_model.generation_config  # Hugging Face's
        self.output_type = OUTPUT_TYPES[type(hf_model).__name__]

    @property
    def sequence_parallel(self) -> bool:
        return self.gpt.sequence_parallel

    @sequence_parallel.setter
    def sequence_parallel(self, on: bool) -> None:
        self.gpt.sequence_parallel = on

    def forward(self, input_ids, attention_mask=None, return_dict=None, **unsupported):
        """Logits (b, s, vocab) for ``input_ids`` (b, s), the same on every rank, in HF's output object."""
        given = sorted(name for name, value in unsupported.items() if value is not None)
        if given:
            raise NotImplementedError(f"a tplab-sharded model's forward takes input_ids and an all-ones "
                                      f"attention_mask only; not {given}")
        if attention_mask is not None and not bool((attention_mask == 1).all()):
            raise NotImplementedError("an attention_mask with zeros (padding) is not supported")
        if return_dict is False:
            raise NotImplementedError("return_dict=False (a tuple) is not supported: use the output's .logits")
        return self.output_type(logits=self.gpt(input_ids))

    @torch.no_grad()
    def generate(self, input_ids, **kwargs) -> torch.Tensor:
        """Hugging Face's ``generate(input_ids, max_new_tokens=k, do_sample=False)``: the prompt followed by the
        greedy tokens, (b, s + k) or shorter when every row has produced an end-of-sequence token (rows that
        ended earlier are filled with the pad token, as Hugging Face does). Call it on every rank."""
        settings = greedy_settings(self.generation_config, input_ids, kwargs)
        return greedy_generate(self.gpt, input_ids, settings.max_new_tokens, use_cache=settings.use_cache,
                               eos_token_id=settings.eos_token_id, pad_token_id=settings.pad_token_id)
