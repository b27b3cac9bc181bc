"""Shard tplab's GPT for tensor parallelism: every rank's forward returns the same full logits.

    sharded = parallelize(model, comm)   # a sharded copy; the unsplit model is left as it was
    logits = sharded(tokens)             # equal to model(tokens), on every rank

What is split (Megatron's recipe): the token embedding by vocabulary rows (VocabParallelEmbedding), each
block's attention by heads and its MLP by hidden columns, the LM head by vocabulary (logits gathered).
Replicated: position embeddings and the norms (cheap, and they need whole rows). Per forward pass:
2 all-reduces per block, 1 for the embedding, 1 all-gather of the logits.
"""

from __future__ import annotations

import copy

from torch import nn

from tplab.layers import ParallelAttention, ParallelMLP
from tplab.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tplab.models.gpt import GPT, Block


class ParallelBlock(nn.Module):
    def __init__(self, block: Block, comm, algorithm="auto"):
        super().__init__()
        a, m = block.attention, block.mlp
        self.norm1, self.norm2 = copy.deepcopy(block.norm1), copy.deepcopy(block.norm2)
        self.attention = ParallelAttention.from_dense(a.q_proj, a.k_proj, a.v_proj, a.o_proj, a.n_head, comm,
                                                      num_kv_heads=a.n_kv_head, algorithm=algorithm)
        self.mlp = ParallelMLP.from_dense(m.up, m.down, comm, gate=m.gate, activation=m.activation,
                                          algorithm=algorithm)

    def forward(self, x, cache=None):
        x = x + self.attention(self.norm1(x), cache)
        return x + self.mlp(self.norm2(x))


class ParallelGPT(nn.Module):
    def __init__(self, model: GPT, comm, algorithm="auto"):
        super().__init__()
        self.config, self.comm = model.config, comm
        self.wte = VocabParallelEmbedding.from_embedding(model.wte, comm, algorithm=algorithm)
        self.wpe = copy.deepcopy(model.wpe)
        self.blocks = nn.ModuleList(ParallelBlock(b, comm, algorithm) for b in model.blocks)
        self.norm_f = copy.deepcopy(model.norm_f)
        self.lm_head = ParallelLMHead.from_linear(model.lm_head, comm, gather_output=True, algorithm=algorithm)

    forward = GPT.forward  # the same computation; only the modules differ


def parallelize(model: GPT, comm, sequence_parallel: bool = False, algorithm="auto") -> ParallelGPT:
    """A tensor-parallel copy of ``model`` over the ranks of ``comm`` (collective: call it on every rank
    with the same model). Clear errors for shapes that cannot be split (heads, KV heads, vocabulary)."""
    if sequence_parallel:
        raise NotImplementedError("sequence parallelism for whole models needs sequence-parallel attention "
                                  "(not yet); ParallelMLP(sequence_parallel=True) exists")
    if type(model).__name__ == "GPT2LMHeadModel":  # a Hugging Face GPT-2: convert, then shard
        from tplab.models.hf import from_hf_gpt2

        model = from_hf_gpt2(model)
    if not isinstance(model, GPT):
        raise TypeError(f"parallelize knows tplab's GPT and Hugging Face's GPT2LMHeadModel; "
                        f"got {type(model).__name__}")
    return ParallelGPT(model, comm, algorithm)
