"""tplab.sequence — sequence-parallel attention: the tokens split over ranks, the weights replicated.

    layout.py          which tokens a rank holds: contiguous chunks, or zig-zag (chunks i and 2p-1-i)
                       that balance causal attention; shard(), positions()
    gather.py          all-gather along the sequence (backward: reduce-scatter); the course project's CPU staging
    allgather_kv.py    all-gather K and V, attend with my queries (the course project's scheme); head_groups=G:
                       the heads gathered in G groups, each attended as soon as it arrives
    online_softmax.py  softmax over key blocks that arrive one by one (FlashAttention's recurrence), merged
                       through each block's log-sum-exp
    ring.py            ring attention: K/V blocks passed around, next transfer started before compute
    streamed_kv.py     every rank's K/V block sent to every rank at once (a shard exchange: messages, or the
                       GPUs' copy engines), each folded into the online softmax as soon as it lands
    fused_kv.py        FusedKV: Q/K/V in one GEMM whose epilogue writes K and V into every rank's memory (GPU,
                       inference; tplab.gpu_collectives.matmul_allgather): the all-gather run under the GEMM
    streams.py         a second CUDA stream for the transfers, so they overlap the compute (nothing on the CPU)
    ulysses.py         DeepSpeed Ulysses: all-to-all tokens <-> heads (tplab.collectives.alltoall)
    checks.py          bad input: the same clear error on every rank
    layer.py           SequenceParallelBlock: the course project's layer, equal to the unsplit Block; unsplit_layer
    scaling.py         timing, strong and weak scaling, per-rank causal work (notebook 05, GPU script)
    exactness.py       every scheme and layer against the unsplit computation, bytes vs formulas (notebook 05)
    pictures.py        who computes which part of causal attention (contiguous vs zig-zag)

Every scheme takes this rank's q (b, n, s/p, d), k, v (b, n_kv, s/p, d) and returns its output rows
(b, n, s/p, d), exactly what full attention gives for those tokens:

    from tplab.sequence import shard, ring_attention
    q_mine = shard(q, comm.rank, comm.size, layout="zigzag", dim=2)            # (and k, v)
    out_mine = ring_attention(q_mine, k_mine, v_mine, comm, causal=True, layout="zigzag")

                  bytes per rank                    memory (K, V)   gradients   needs
    allgather_kv  2 (p-1)/p · b s h_kv              O(s)            yes         -
    ring          2 (p-1)/p · b s h_kv              O(s/p)          no          -
    ulysses       (p-1)/p² · b s (2h + 2h_kv)       O(s)·n/p heads  yes         heads divisible by p
    streamed_kv   2 (p-1)/p · b s h_kv              O(s)            no          -
(tplab.cost.sequence_parallel has the formulas; the Communicator counts the real bytes.)
"""

from tplab.sequence.allgather_kv import allgather_kv_attention, attend_local
from tplab.sequence.checks import SequenceParallelError
from tplab.sequence.gather import exchange_allgather_first_dim, gather_sequence, staged_allgather_first_dim
from tplab.sequence.layer import SCHEMES, SequenceParallelBlock, unsplit_layer
from tplab.sequence.layout import LAYOUTS, gathered_positions, positions, shard, to_global_order
from tplab.sequence.ring import ring_attention
from tplab.sequence.streamed_kv import streamed_kv_attention
from tplab.sequence.ulysses import heads_to_sequence, sequence_to_heads, ulysses_attention

__all__ = [
    "LAYOUTS",
    "SCHEMES",
    "SequenceParallelBlock",
    "SequenceParallelError",
    "allgather_kv_attention",
    "attend_local",
    "exchange_allgather_first_dim",
    "gather_sequence",
    "gathered_positions",
    "heads_to_sequence",
    "positions",
    "ring_attention",
    "sequence_to_heads",
    "shard",
    "staged_allgather_first_dim",
    "streamed_kv_attention",
    "to_global_order",
    "ulysses_attention",
    "unsplit_layer",
]
