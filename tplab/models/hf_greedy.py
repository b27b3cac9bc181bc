"""Which Hugging Face ``generate`` calls tplab can answer with HF's own tokens: greedy decoding only.

``greedy_settings`` reads the keyword arguments of ``generate`` on top of the model's ``generation_config``
(the arguments win, as in Hugging Face) and returns what tplab's greedy loop needs: how many new tokens,
the end-of-sequence ids and the padding id. Everything that would make Hugging Face return other tokens
(sampling, beams, penalties, forced or suppressed tokens, padding in the prompt...) or another type (a
dict of scores) is refused with an error that names it: silently giving different tokens would be worse.

Supported: ``max_new_tokens``, ``max_length``, ``do_sample=False``, ``eos_token_id``, ``pad_token_id``,
``use_cache``, an ``attention_mask`` of ones (no padding). Options that only tune sampling (temperature,
top_k, top_p...) are ignored, as Hugging Face ignores them under greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Options that change greedy tokens (or what generate returns), with the value that leaves them off. None,
# and an empty list, are off too (transformers 5 leaves every unset option None; 4.x wrote these values).
CHANGES_THE_TOKENS = {
    "do_sample": False, "num_beams": 1, "num_beam_groups": 1, "penalty_alpha": None, "dola_layers": None,
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "force_words_ids": None, "constraints": None,
    "min_length": 0, "min_new_tokens": 0, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
    "exponential_decay_length_penalty": None, "guidance_scale": 1.0, "max_time": None, "stop_strings": None,
    "num_return_sequences": 1, "return_dict_in_generate": False, "token_healing": False,
    "watermarking_config": None, "assistant_model": None, "streamer": None, "logits_processor": None,
    "stopping_criteria": None, "prefix_allowed_tokens_fn": None, "synced_gpus": False,
    "past_key_values": None, "inputs_embeds": None, "position_ids": None, "generation_config": None,
}
SAMPLING_ONLY = {"temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h"}
HANDLED = {"max_new_tokens", "max_length", "eos_token_id", "pad_token_id", "use_cache", "attention_mask"}


@dataclass
class GreedySettings:
    max_new_tokens: int
    eos_token_id: list[int] | None
    pad_token_id: int | None
    use_cache: bool


def _is_off(name, value) -> bool:
    if value is None or (isinstance(value, (list, tuple, dict)) and not value):
        return True
    return name in CHANGES_THE_TOKENS and value == CHANGES_THE_TOKENS[name]


def _ids(value) -> list[int] | None:
    if value is None:
        return None
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def greedy_settings(generation_config, prompt: torch.Tensor, kwargs: dict) -> GreedySettings:
    unknown = set(kwargs) - set(CHANGES_THE_TOKENS) - SAMPLING_ONLY - HANDLED
    if unknown:
        raise TypeError(f"generate() of a tplab-sharded model does not know {sorted(unknown)}; it decodes greedily "
                        f"and takes {sorted(HANDLED | {'do_sample'})}")
    if prompt.dim() != 2 or prompt.is_floating_point():
        raise ValueError(f"input_ids must be a (batch, length) tensor of token ids; got shape {tuple(prompt.shape)}")

    def setting(name):  # the call's argument, else the model's generation_config, as in Hugging Face
        return kwargs[name] if name in kwargs else getattr(generation_config, name, None)

    if setting("do_sample"):
        raise NotImplementedError("sampling (do_sample=True) is not supported: tplab's sharded generate is greedy "
                                  "only; pass do_sample=False (this model's generation_config may sample by default)")
    for name in CHANGES_THE_TOKENS:
        if not _is_off(name, setting(name)):
            raise NotImplementedError(f"generate option {name}={setting(name)!r} is not supported by tplab's sharded "
                                      "generate (greedy decoding only: no beams, penalties, forced or suppressed "
                                      "tokens, streamers or score dictionaries); leave it unset")
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise NotImplementedError("an attention_mask with zeros (padding) is not supported: tplab's sharded model "
                                  "attends to every token; pass prompts of equal length, unpadded")

    eos = _ids(setting("eos_token_id"))
    pad = setting("pad_token_id")
    if pad is None and eos:
        pad = eos[0]  # what Hugging Face pads ended rows with when the model names no pad token
    if pad is not None and eos is not None and pad not in eos and bool((prompt == pad).any()):
        # Hugging Face would read those tokens as padding and mask them: other tokens than ours
        raise NotImplementedError(f"the prompt contains pad_token_id {pad}, which Hugging Face treats as padding; "
                                  "padding is not supported (pass pad_token_id=None or unpadded prompts)")

    if setting("max_new_tokens") is not None:
        new = int(setting("max_new_tokens"))
    elif setting("max_length") is not None:
        new = int(setting("max_length")) - prompt.shape[1]
    else:
        raise ValueError("pass max_new_tokens (the model's generation_config sets neither it nor max_length)")
    use_cache = setting("use_cache")
    return GreedySettings(max(new, 0), eos, None if pad is None else int(pad), True if use_cache is None else use_cache)
