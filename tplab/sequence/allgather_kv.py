"""Sequence-parallel attention by all-gathering K and V (the course project's scheme).

Each rank holds s/p tokens. Attention mixes every token with every other, but only through K and V:
a query needs all keys and values, never the other queries. So

    q, k, v  (b, n, s/p, d)       my tokens' projections, no communication
    K = all-gather(k)  (b, n_kv, s, d)     the two all-gathers of the scheme
    V = all-gather(v)
    out = softmax(q Kᵀ / √d) V    (b, n, s/p, d)   my queries against every key

Bytes sent per rank (ring all-gather): 2 (p-1)/p · b·s·h_kv · bytes (tplab.cost.sequence_parallel; h_kv = n_kv·d).
Memory: the full K and V on every rank, O(s) — what ring attention (ring.py) avoids.

Causal attention: a query at position t sees keys 0..t. For each of my chunks (layout.py) the keys it
may see are a prefix of the sequence ending at the chunk's last token, so the chunk attends to that
prefix with the causal mask aligned to the bottom right (``tplab.layers.attend.attend``). Keys after
the chunk are never touched: under the contiguous layout rank i works on (i + 1/2)·(s/p)² score pairs,
rank 0 least and rank p-1 most; under the zig-zag layout every rank does the same.

Differentiable: the all-gathers' backward is a reduce-scatter (gather.py), so gradients reach every
rank's q, k, v (and the weights that made them) exactly.
"""

from __future__ import annotations

import torch

from tplab.layers.attend import attend
from tplab.sequence.checks import check_attention_inputs
from tplab.sequence.gather import gather_sequence
from tplab.sequence.layout import chunk_length, my_chunks, to_global_order


def repeat_kv(k: torch.Tensor, num_heads: int) -> torch.Tensor:
    """GQA: (b, n_kv, s, d) -> (b, n, s, d), each KV head serving n/n_kv query heads (after the wire)."""
    group = num_heads // k.shape[1]
    return k if group == 1 else k.repeat_interleave(group, dim=1)


def attend_local(q, k_all, v_all, rank: int, p: int, *, causal: bool = True, layout: str = "contiguous"):
    """My queries (b, n, s/p, d) against all keys and values (b, n_kv, s, d) gathered in rank order.
    No communication: this is the compute a rank does after the all-gathers."""
    seq_len = k_all.shape[2]
    k_all = repeat_kv(to_global_order(k_all, p, layout, dim=2), q.shape[1])  # (b, n, s, d), sequence order
    v_all = repeat_kv(to_global_order(v_all, p, layout, dim=2), q.shape[1])  # (once for all my chunks)
    if not causal:
        return attend(q, k_all, v_all, causal=False)
    length = chunk_length(seq_len, p, layout)
    pieces = []
    for chunk, q_chunk in zip(my_chunks(rank, p, layout), q.split(length, dim=2)):
        end = (chunk + 1) * length  # keys after my chunk's last token are in its future: never touched
        pieces.append(attend(q_chunk, k_all[:, :, :end], v_all[:, :, :end], causal=True))  # (b, n, L, d)
    return torch.cat(pieces, dim=2)


def allgather_kv_attention(q, k, v, comm, *, causal: bool = True, layout: str = "contiguous",
                           algorithm: str = "ring", gather=None, check: bool = True) -> torch.Tensor:
    """q (b, n, s/p, d), k, v (b, n_kv, s/p, d): this rank's tokens  ->  (b, n, s/p, d).

    ``algorithm``: tplab's all-gather algorithm; ``gather``: another way to move the bytes (gather.py:
    the course project's CPU staging, or the vendor's all-gather); ``check``: agree on shapes first (one small
    uncounted exchange), so bad input is the same clear error on every rank."""
    if check:
        check_attention_inputs(q, k, v, comm, layout)
    k_all = gather_sequence(k, comm, dim=2, algorithm=algorithm, gather=gather, check=check)  # (b, n_kv, s, d)
    v_all = gather_sequence(v, comm, dim=2, algorithm=algorithm, gather=gather, check=check)
    return attend_local(q, k_all, v_all, comm.rank, comm.size, causal=causal, layout=layout)
