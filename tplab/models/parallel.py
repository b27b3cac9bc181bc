"""Shard tplab's GPT for tensor parallelism: every rank's forward returns the same full logits.

    sharded = parallelize(model, comm)   # a sharded copy; the unsplit model is left as it was
    logits = sharded(tokens)             # equal to model(tokens), on every rank

What is split (Megatron's recipe): the token embedding by vocabulary rows (VocabParallelEmbedding), each
block's attention by heads and its MLP by hidden columns, the LM head by vocabulary (logits gathered).
Replicated: position embeddings and the norms (cheap, and they need whole rows). Hugging Face's
GPT2LMHeadModel and LlamaForCausalLM are converted to tplab's GPT first (hf.py), then split the same way,
MixtralForCausalLM and Qwen2MoeForCausalLM too (hf_moe.py: their mixture-of-experts layers split by experts,
tplab.moe),
and answer as Hugging Face models do (hf_sharded.py): ``sharded(ids).logits``, ``sharded.generate(...)``.

Collectives per forward pass, L blocks:

    tensor parallel (TP)        embedding 1 all-reduce, each block 2 all-reduces, logits 1 all-gather
    sequence parallel (SP)      embedding 1 reduce-scatter, each block 2 all-gathers + 2 reduce-scatters,
                                then 1 all-gather of the sequence before the LM head + 1 of the logits

Sequence parallelism (Korthikanti et al. 2022) keeps the activations *between* the blocks split along the
sequence, (s/p, b, h) on each rank: the norms and residual adds run on s/p tokens, so their activations
take 1/p of the memory. Attention and MLP see the whole sequence (all-gathered before them) and leave
their sum reduce-scattered. An all-gather plus a reduce-scatter move the bytes of one all-reduce: the
same traffic. The weights are the same either way: ``sharded.sequence_parallel`` switches at run time
(decoding one token at a time cannot be split over p ranks: switch it off there).

Gradients: the split weights get exactly the matching slices of the unsplit model's gradients. The
replicated ones (norms, position table) get the full gradient on every rank under TP; under SP each
rank's is the part from its own tokens, and the sum over ranks is the full one (Megatron all-reduces
them before the optimizer step).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from tplab.layers import ParallelAttention, ParallelMLP
from tplab.layers.attend import past_length
from tplab.layers.attention import heads_per_rank
from tplab.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tplab.layers.mappings import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from tplab.models.gpt import GPT, Block, GPTConfig
from tplab.moe import ExpertParallelMoE, MoE, ReplicatedTokensMoE


def check_splittable(config: GPTConfig, tp: int, dense_mlp: bool = True) -> None:
    """A clear error, naming every dimension at fault, when the model cannot be split over ``tp`` ranks.
    ``dense_mlp=False``: the feed-forward layers are mixtures of experts, split by experts (any number)."""
    problems = []
    try:
        heads_per_rank(config.n_head, config.kv_heads, tp)
    except ValueError as e:
        problems.append(str(e))
    sizes = [("vocabulary size", config.vocab_size)] + [("MLP hidden size (ffn_size)", config.ffn)] * dense_mlp
    for what, size in sizes:
        if size % tp:
            problems.append(f"{what} = {size} is not divisible by the tensor-parallel size {tp}")
    if problems:
        raise ValueError(f"this model cannot be split over {tp} ranks: " + "; ".join(problems))


class ParallelBlock(nn.Module):
    def __init__(self, block: Block, comm, algorithm="auto", sequence_parallel=False):
        super().__init__()
        a, m = block.attention, block.mlp
        self.norm1, self.norm2 = copy.deepcopy(block.norm1), copy.deepcopy(block.norm2)
        self.attention = ParallelAttention.from_dense(
            a.q_proj, a.k_proj, a.v_proj, a.o_proj, a.n_head, comm, num_kv_heads=a.n_kv_head, algorithm=algorithm,
            rotary=copy.deepcopy(a.rotary), sequence_parallel=sequence_parallel)
        if isinstance(m, MoE):  # a mixture of experts: expert-parallel, on each rank's slice of the tokens
            self.mlp = ReplicatedTokensMoE(ExpertParallelMoE.from_dense(m, comm), comm,
                                           sequence_parallel=sequence_parallel)
        else:
            self.mlp = ParallelMLP.from_dense(m.up, m.down, comm, gate=m.gate, activation=m.activation,
                                              algorithm=algorithm, sequence_parallel=sequence_parallel)

    def forward(self, x, cache=None, mask=None):  # x: (b, s, h) replicated, or (s/p, b, h) under sequence
        # parallelism; mask: an extra attention mask over the whole sequence (attend)
        x = x + self.attention(self.norm1(x), cache, mask)
        return x + self.mlp(self.norm2(x))


class ParallelGPT(nn.Module):
    def __init__(self, model: GPT, comm, algorithm="auto", sequence_parallel=False):
        super().__init__()
        self.config, self.comm, self.algorithm = model.config, comm, algorithm
        self.wte = VocabParallelEmbedding.from_embedding(model.wte, comm, algorithm=algorithm)
        self.wpe = copy.deepcopy(model.wpe)
        self.blocks = nn.ModuleList(ParallelBlock(b, comm, algorithm) for b in model.blocks)
        self.norm_f = copy.deepcopy(model.norm_f)
        self.lm_head = ParallelLMHead.from_linear(model.lm_head, comm, gather_output=True, algorithm=algorithm)
        if self.config.tie_embeddings:  # my vocabulary rows of the one table: the same slice both ways
            self.lm_head.weight = self.wte.weight
        self.sequence_parallel = sequence_parallel

    @property
    def sequence_parallel(self) -> bool:
        return self._sequence_parallel

    @sequence_parallel.setter
    def sequence_parallel(self, on: bool) -> None:  # the same weights; only the communication changes
        self._sequence_parallel = bool(on)
        for block in self.blocks:
            block.attention.sequence_parallel = block.mlp.sequence_parallel = bool(on)

    def forward(self, tokens, caches=None):  # (b, s) integers, the same on every rank -> (b, s, vocab)
        past, s = past_length(caches[0] if caches else None), tokens.shape[1]
        if past + s > self.config.block_size:
            raise ValueError(f"{past + s} positions exceed block_size {self.config.block_size}")
        if not self.sequence_parallel:
            x = self.wte(tokens)  # (b, s, h): g all-reduces the vocabulary shards' lookups
            if self.wpe is not None:
                x = x + self.wpe(torch.arange(past, past + s, device=tokens.device))
        else:
            x = self._embed_my_slice_of_the_sequence(tokens, past)  # (s/p, b, h)
        for i, block in enumerate(self.blocks):
            x = block(x, caches[i] if caches else None)
        x = self.norm_f(x)
        if not self.sequence_parallel:
            return self.lm_head(x)  # column-parallel over the vocabulary, logits all-gathered
        x = gather_from_sequence_parallel_region(x, self.comm, self.algorithm).transpose(0, 1)  # (b, s, h)
        logits = self.lm_head.local(x)  # (b, s, vocab/p): the gather above plays f's part
        return gather_from_tensor_parallel_region(logits, self.comm, self.algorithm)  # (b, s, vocab)

    def _embed_my_slice_of_the_sequence(self, tokens, past):
        p, s = self.comm.size, tokens.shape[1]
        if s % p:
            raise ValueError(f"sequence parallelism splits the sequence over the {p} ranks: its length {s} is "
                             f"not divisible by {p} (pad it, or set sequence_parallel = False, e.g. to decode "
                             "one token at a time)")
        partial = self.wte.local(tokens.T)  # (s, b, h): my vocabulary rows' lookups, zeros elsewhere
        x = reduce_scatter_to_sequence_parallel_region(partial, self.comm, self.algorithm)  # (s/p, b, h)
        if self.wpe is not None:  # the positions of my slice
            first = past + self.comm.rank * (s // p)
            x = x + self.wpe(torch.arange(first, first + s // p, device=tokens.device))[:, None, :]
        return x


HUGGING_FACE_MODELS = ("GPT2LMHeadModel", "LlamaForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM")


def as_tplab_gpt(model) -> GPT:
    """tplab's GPT itself, or a Hugging Face GPT-2 / Llama converted to one (same weights, same logits)."""
    name = type(model).__name__
    if name == "GPT2LMHeadModel":
        from tplab.models.hf import from_hf_gpt2

        return from_hf_gpt2(model)
    if name == "LlamaForCausalLM":
        from tplab.models.hf import from_hf_llama

        return from_hf_llama(model)
    if name == "MixtralForCausalLM":  # attention by heads (TP), the experts over the ranks (EP)
        from tplab.models.hf_moe import from_hf_mixtral

        return from_hf_mixtral(model)
    if name == "Qwen2MoeForCausalLM":
        from tplab.models.hf_moe import from_hf_qwen2_moe

        return from_hf_qwen2_moe(model)
    if not isinstance(model, GPT):
        raise TypeError(f"parallelize knows tplab's GPT and Hugging Face's GPT2LMHeadModel, LlamaForCausalLM, "
                        f"MixtralForCausalLM and Qwen2MoeForCausalLM; "
                        f"got {name}")
    return model


def parallelize(model, comm, sequence_parallel: bool = False, algorithm="auto"):
    """A tensor-parallel copy of ``model`` over the ranks of ``comm``: call it on every rank with the same
    model. Clear errors, on every rank, for shapes that cannot be split (heads, KV heads, vocabulary, MLP size).

    tplab's GPT gives a ``ParallelGPT``: ``sharded(tokens)`` is the logits tensor, ``generate(sharded, ...)``
    decodes. Hugging Face's GPT2LMHeadModel or LlamaForCausalLM gives a ``ShardedCausalLM`` (hf_sharded.py)
    that answers as the Hugging Face model does: ``sharded(ids).logits`` and ``sharded.generate(ids,
    max_new_tokens=k, do_sample=False)`` (greedy only), with the ParallelGPT inside as ``sharded.gpt``."""
    gpt = as_tplab_gpt(model)
    check_splittable(gpt.config, comm.size, dense_mlp=not all(isinstance(b.mlp, MoE) for b in gpt.blocks))
    sharded = ParallelGPT(gpt, comm, algorithm, sequence_parallel=sequence_parallel)
    if type(model).__name__ in HUGGING_FACE_MODELS:
        from tplab.models.hf_sharded import ShardedCausalLM  # (imports transformers: only for its models)

        return ShardedCausalLM(sharded, model)
    return sharded
