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

Overlap (``head_groups=G``): as written above the attention waits for the whole exchange. But attention
is independent per head, so the K/V heads can travel in G groups, and each group's attention can start
as soon as its own K and V have arrived; on a GPU the gathers go on a side stream (streams.py):

    side stream      [gather K_0, V_0][gather K_1, V_1] ... [gather K_G-1, V_G-1]
    compute stream   [Q (the layer's), ...][attend group 0][attend group 1] ... [attend group G-1]
                                            ^ waits for K_0, V_0 only

Only group 0's gather is exposed, and not even that where there is compute to do before the attention
(layer.py starts the gathers before it computes Q). Same bytes, G times as many messages, the same output
(up to rounding: a kernel may sum in another order for fewer heads); on the CPU the same code runs in
program order, with no streams.
``head_groups=1`` (the default) is the scheme as written above: no side stream, one K and one V gather.
``side_stream=True`` puts even one group's gathers on the side stream, so that they travel while the layer
computes Q. It is meant for gathers that take no SM: through the copy engines (``exchange_allgather_first_dim``
with a ``CopyEngineExchange``) the course project's layer took 0.15-0.2 ms less on 4 H200s (5.09-5.23 ms
against 5.30-5.37, two rounds; the same code varied by up to 0.24 ms between runs there). A gather that
is a kernel (the peer-memory all-gather) then competes with the Q projection for the SMs, and the layer
was 0.1 ms slower.
"""

from __future__ import annotations

import torch

from tplab.layers.attend import attend
from tplab.sequence.checks import SequenceParallelError, check_attention_inputs, check_head_groups
from tplab.sequence.gather import gather_sequence
from tplab.sequence.layout import chunk_length, my_chunks, to_global_order
from tplab.sequence.streams import SideStream


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


class KVGathers:
    """Every rank's K and V on their way, head group by head group; ``attend(q)`` uses each group as it
    arrives. Made by ``start_kv_gathers``."""

    def __init__(self, k, v, comm, *, layout, head_groups, algorithm, gather, check, side_stream=None):
        self.rank, self.size, self.layout, self.kv_heads = comm.rank, comm.size, layout, k.shape[1]
        # one group: the scheme on the compute stream (unless side_stream); more: the gathers on a side stream
        on_side = head_groups > 1 if side_stream is None else side_stream
        self.side = SideStream(k.device if on_side else torch.device("cpu"))  # (a CPU "stream": program order)
        per_group = k.shape[1] // head_groups
        self.groups = []  # (K/V heads, K (b, n_kv/G, s, d), V, "arrived" event)
        with self.side.after_compute(k, v):
            for g in range(head_groups):
                heads = slice(g * per_group, (g + 1) * per_group)
                k_all = gather_sequence(k[:, heads], comm, dim=2, algorithm=algorithm, gather=gather, check=check)
                v_all = gather_sequence(v[:, heads], comm, dim=2, algorithm=algorithm, gather=gather, check=check)
                self.groups.append((heads, k_all, v_all, self.side.record()))

    def attend(self, q, *, causal: bool = True) -> torch.Tensor:
        """My queries (b, n, s/p, d) against every key  ->  (b, n, s/p, d)."""
        per_kv = q.shape[1] // self.kv_heads  # GQA: query heads per K/V head (a group's are consecutive)
        pieces = []
        for heads, k_all, v_all, arrived in self.groups:
            self.side.wait(arrived, k_all, v_all)  # this group's K and V are here; later groups may still travel
            q_group = q[:, heads.start * per_kv: heads.stop * per_kv]  # (b, n/G, s/p, d)
            pieces.append(attend_local(q_group, k_all, v_all, self.rank, self.size, causal=causal,
                                       layout=self.layout))
        self.side.fence()  # the gathers' memory is reused on the side stream only after this compute
        if len(pieces) == 1:
            return pieces[0]
        # (b, n, s/p, d), laid out as (b, s/p, n, d) in memory: what the output projection reads, with no copy
        return torch.cat([piece.transpose(1, 2) for piece in pieces], dim=2).transpose(1, 2)


def start_kv_gathers(k, v, comm, *, queries, layout: str = "contiguous", head_groups: int = 1,
                     algorithm: str = "ring", gather=None, check: bool = True,
                     side_stream: bool | None = None) -> KVGathers:
    """Start the all-gathers of this rank's k, v (b, n_kv, s/p, d) in ``head_groups`` groups of heads.
    ``queries``: q, or a tensor of q's shape and dtype on the meta device when q is not computed yet
    (the layer computes it while K and V travel): with ``check``, the shapes are agreed on first.
    ``side_stream``: the gathers on the side stream (None: only for more than one head group)."""
    check_head_groups(head_groups, k.shape[1])
    if not (side_stream is None or isinstance(side_stream, bool)):   # (the same on every rank: the same options)
        raise SequenceParallelError(f"side_stream={side_stream!r}: True, False or None (a side stream only for "
                                    "more than one head group)")
    if check:
        check_attention_inputs(queries, k, v, comm, layout)
    return KVGathers(k, v, comm, layout=layout, head_groups=head_groups, algorithm=algorithm, gather=gather,
                     check=check, side_stream=side_stream)


def allgather_kv_attention(q, k, v, comm, *, causal: bool = True, layout: str = "contiguous",
                           algorithm: str = "ring", gather=None, head_groups: int = 1,
                           check: bool = True, side_stream: bool | None = None) -> torch.Tensor:
    """q (b, n, s/p, d), k, v (b, n_kv, s/p, d): this rank's tokens  ->  (b, n, s/p, d).

    ``algorithm``: tplab's all-gather algorithm; ``gather``: another way to move the bytes (gather.py:
    the course project's CPU staging, or the vendor's all-gather); ``head_groups``: gather (and attend)
    in that many groups of K/V heads, overlapped on a GPU (a divisor of n_kv); ``side_stream``: the gathers
    on the side stream even for one group (module docstring); ``check``: agree on shapes first (one small
    uncounted exchange), so bad input is the same clear error on every rank."""
    gathers = start_kv_gathers(k, v, comm, queries=q, layout=layout, head_groups=head_groups,
                               algorithm=algorithm, gather=gather, check=check, side_stream=side_stream)
    return gathers.attend(q, causal=causal)
