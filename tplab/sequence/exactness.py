"""Checks the notebook runs on every rank: each scheme against full attention, each layer against the
unsplit one, with the bytes the Communicator counted next to the formula. Rows are the same on every rank
(errors and bytes are the maxima over ranks). ``comm`` defaults to ``tplab.comm.world()``, so a notebook
can run them as they are: ``cluster.run(check_schemes)``.

    check_schemes(comm)   every scheme x causal/full x contiguous/zig-zag, float64, GQA (n = 2p, n_kv = p)
    check_layers(comm)    SequenceParallelBlock vs the unsplit layer, every scheme and layout
"""

from __future__ import annotations

import torch

from tplab.comm import world
from tplab.cost.sequence_parallel import attention_bytes, attention_messages
from tplab.layers.attend import attend
from tplab.models.gpt import Block, GPTConfig
from tplab.sequence.layer import SCHEMES, SequenceParallelBlock, unsplit_layer
from tplab.sequence.layout import LAYOUTS, shard


def _randn(*shape, seed):  # the same float64 tensor on every rank
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def check_schemes(comm=None, *, batch=2, head_dim=8, seq_chunks=4, seed=0) -> list[dict]:
    comm = world() if comm is None else comm
    p, rank = comm.size, comm.rank
    heads, kv_heads, seq_len = 2 * p, p, 2 * p * seq_chunks  # Ulysses: heads divisible by p; zig-zag: s by 2p
    q = _randn(batch, heads, seq_len, head_dim, seed=seed)  # (b, n, s, d)
    k, v = (_randn(batch, kv_heads, seq_len, head_dim, seed=seed + i) for i in (1, 2))  # (b, n_kv, s, d)
    rows = []
    for causal in (True, False):
        full = attend(q, k, v, causal=causal)  # (b, n, s, d): the unsplit attention
        for layout in LAYOUTS:
            mine = [shard(t, rank, p, layout, dim=2) for t in (q, k, v)]
            for scheme, attention in SCHEMES.items():
                comm.reset_counters()
                with torch.no_grad():
                    out = attention(*mine, comm, causal=causal, layout=layout)
                error = float((out - shard(full, rank, p, layout, dim=2)).abs().max())
                sent = comm.allgather_object((error, comm.bytes_sent, comm.messages_sent))
                rows.append({"scheme": scheme, "causal": causal, "layout": layout,
                             "max_error": max(e for e, _, _ in sent),
                             "bytes_counted": max(b for _, b, _ in sent),
                             "bytes_formula": attention_bytes(scheme, batch, seq_len, heads * head_dim, p,
                                                              kv_hidden=kv_heads * head_dim, bytes_per_element=8),
                             "messages_counted": max(m for _, _, m in sent),
                             "messages_formula": attention_messages(scheme, p)})
    return rows


def check_layers(comm=None, *, seed=0) -> list[dict]:
    """The layer on s/p tokens per rank against the unsplit layer (causal: the model's own ``Block``)."""
    comm = world() if comm is None else comm
    p, rank = comm.size, comm.rank
    torch.manual_seed(seed)  # the same weights on every rank
    block = Block(GPTConfig(n_embd=8 * p, n_head=2 * p, dtype=torch.float64))
    x = _randn(2, 4 * p, 8 * p, seed=seed + 1)  # (b, s, h)
    rows = []
    with torch.no_grad():
        for causal in (True, False):
            expected = block(x) if causal else unsplit_layer(block, causal=False)(x)
            for layout in LAYOUTS:
                for scheme in SCHEMES:
                    y = SequenceParallelBlock(block, comm, scheme=scheme, layout=layout, causal=causal)(
                        shard(x, rank, p, layout))
                    error = float((y - shard(expected, rank, p, layout)).abs().max())
                    rows.append({"scheme": scheme, "causal": causal, "layout": layout,
                                 "max_error": max(comm.allgather_object(error))})
    return rows
