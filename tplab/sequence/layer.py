"""A sequence-parallel transformer layer (the course project's structure), built on the unsplit ``Block``.

Sequence parallelism splits the *tokens*, not the weights: every rank holds the whole layer and s/p
tokens of each sequence. Everything a token does on its own needs no communication; only attention
mixes tokens:

    x (b, s/p, h)  my tokens
    ├─ norm1, K/V, then Q (RoPE)          local (per token; rotary angles from global positions)
    ├─ attention                          the scheme: all-gather K/V | ring | Ulysses | streamed K/V
    │                                     <- the only comm (the all-gathers start before Q is computed)
    ├─ output projection, residual        local
    └─ norm2, MLP, residual               local (per token)
    y (b, s/p, h)  my tokens of the output

so the layer equals the unsplit ``tplab.models.gpt.Block`` on the full sequence, token for token.
Compare tensor parallelism (tplab.layers): weights split p ways, two all-reduces of b·s·h per layer.
Here: weights replicated, per layer only the attention scheme's bytes (tplab.cost.sequence_parallel).

    block = Block(GPTConfig(n_embd=64, n_head=4))            # the same weights on every rank
    layer = SequenceParallelBlock(block, comm, scheme="ring", layout="zigzag")
    y_mine = layer(shard(x, comm.rank, comm.size, "zigzag"))   # == shard(block(x), ...)
"""

from __future__ import annotations

import torch
from torch import nn

from tplab.sequence.allgather_kv import allgather_kv_attention, attend_local, start_kv_gathers
from tplab.sequence.layout import my_chunks
from tplab.sequence.ring import ring_attention, start_ring
from tplab.sequence.streamed_kv import start_streamed_kv, streamed_kv_attention
from tplab.sequence.ulysses import ulysses_attention

SCHEMES = {"allgather_kv": allgather_kv_attention, "ring": ring_attention, "ulysses": ulysses_attention,
           "streamed_kv": streamed_kv_attention}
STARTS = {"allgather_kv": start_kv_gathers, "streamed_kv": start_streamed_kv,  # K/V leave before Q is computed
          "ring": start_ring}


def attention_scheme(name: str):
    if name not in SCHEMES:
        raise ValueError(f"unknown sequence-parallel scheme {name!r}: choose one of {list(SCHEMES)}")
    return SCHEMES[name]


class SequenceParallelBlock(nn.Module):
    """``block``: a ``tplab.models.gpt.Block`` (its modules are used, not copied). ``options`` go to the
    attention scheme (all-gather K/V: ``algorithm``, ``gather``, ``head_groups``, ``side_stream``; streamed K/V
    and ring: ``exchange``; all: ``check``). K and V are computed before Q: the all-gather, streamed K/V and
    ring schemes start moving them, and compute Q (on a GPU, where the transfers run on other streams or copy
    engines: while they travel). All-gather K/V on GPUs, inference: ``fused_kv=FusedKV(...)`` (fused_kv.py) makes Q, K
    and V in one GEMM that writes K and V into every rank's memory as it computes them."""

    def __init__(self, block: nn.Module, comm, *, scheme: str = "allgather_kv", layout: str = "contiguous",
                 causal: bool = True, **options):
        super().__init__()
        self.attend = attention_scheme(scheme)
        self.block, self.comm, self.scheme, self.layout, self.causal = block, comm, scheme, layout, causal
        self.fused_kv = options.pop("fused_kv", None)
        if self.fused_kv is not None:   # (the same on every rank: the same arguments)
            f = self.fused_kv
            gathers_otherwise = options.get("head_groups", 1) != 1 or options.get("side_stream") or options.get("gather")
            if (scheme != "allgather_kv" or f.attention is not block.attention or gathers_otherwise
                    or (f.rank, f.size) != (comm.rank, comm.size)):
                raise ValueError("fused_kv: a FusedKV made from this block's attention, for the all-gather scheme "
                                 "over the same ranks as comm, with no other way to gather (head_groups, "
                                 f"side_stream, gather); got scheme {scheme!r}, rank {f.rank} of {f.size} vs "
                                 f"{comm.rank} of {comm.size}")
        self.options = options

    def attention(self, x):  # x: (b, s/p, h) my tokens, after norm1
        a = self.block.attention
        b, s_local, _ = x.shape
        if self.fused_kv is not None:  # Q, and everyone's K and V, from one GEMM that sends as it computes
            q, k_all, v_all = self.fused_kv(x, check=self.options.get("check", True))
            y = attend_local(q, k_all, v_all, self.comm.rank, self.comm.size, causal=self.causal, layout=self.layout)
            return a.o_proj(y.transpose(1, 2).reshape(b, s_local, a.n_head * a.head_dim))
        k = self.rotated(a.k_proj(x).view(b, s_local, a.n_kv_head, a.head_dim).transpose(1, 2))  # (b, n_kv, s/p, d)
        v = a.v_proj(x).view(b, s_local, a.n_kv_head, a.head_dim).transpose(1, 2)
        if self.scheme in STARTS:  # K and V leave first; Q is computed while they travel
            queries = torch.empty((b, a.n_head, s_local, a.head_dim), dtype=k.dtype, device="meta")  # q's shape
            travelling = STARTS[self.scheme](k, v, self.comm, queries=queries, layout=self.layout, **self.options)
            y = travelling.attend(self.queries(x), causal=self.causal)
        else:
            y = self.attend(self.queries(x), k, v, self.comm, causal=self.causal, layout=self.layout, **self.options)
        return a.o_proj(y.transpose(1, 2).reshape(b, s_local, a.n_head * a.head_dim))  # (b, s/p, h)

    def queries(self, x):  # (b, s/p, h) -> (b, n, s/p, d), rotated
        a = self.block.attention
        b, s_local, _ = x.shape
        return self.rotated(a.q_proj(x).view(b, s_local, a.n_head, a.head_dim).transpose(1, 2))

    def rotated(self, t):
        """RoPE (if the block has it) by *global* positions: each of my chunks holds consecutive
        positions, starting at chunk index x chunk length."""
        rotary = getattr(self.block.attention, "rotary", None)
        if rotary is None:
            return t
        chunks = my_chunks(self.comm.rank, self.comm.size, self.layout)
        length = t.shape[2] // len(chunks)
        return torch.cat([rotary.rotate(piece, first_position=c * length)
                          for c, piece in zip(chunks, t.split(length, dim=2))], dim=2)

    def forward(self, x):  # (b, s/p, h)
        x = x + self.attention(self.block.norm1(x))
        return x + self.block.mlp(self.block.norm2(x))  # (b, s/p, h)


def unsplit_layer(block: nn.Module, *, causal: bool = True) -> SequenceParallelBlock:
    """The same layer on one rank over the whole sequence (a communicator of one: nothing to gather):
    the course project's "1 GPU" baseline, causal or not. With ``causal=True`` it computes ``block(x)``."""
    from mpi4py import MPI

    from tplab.comm import MPIComm

    return SequenceParallelBlock(block, MPIComm(MPI.COMM_SELF), causal=causal, check=False)
