"""Ring attention (Liu et al., arXiv 2310.01889): K/V blocks travel around the ring, never all at once.

The all-gather scheme (allgather_kv.py) holds the whole K and V on every rank: O(s) memory. Ring
attention keeps only two K/V blocks (the one being used, the one arriving) and folds each block into an
online softmax (online_softmax.py) as it passes by:

    kv = my (k, v)
    for step in 0 .. p-1:
        start sending kv to the right, receiving the next block from the left     (nonblocking)
        fold my queries against kv into the online softmax                          (compute)
        wait for the transfer; kv = the block that arrived
    out = the merged attention of every block

The transfer of the next block is started *before* the compute on the current one, so the two can
overlap: when one block's attention takes longer than one block's trip, communication is hidden. The
first block leaves as soon as K and V exist (``start_ring``): in the layer it travels while Q is computed.
What moves a block is the transport's business (ring_pass.py): messages on the communicator (host MPI
moves most bytes inside its calls, ``test`` and ``wait``; NCCL send/recv run on a second CUDA stream,
streams.py, the compute stream waiting for a block's arrival only when it needs it), or a shard
exchange's ``start_pass`` (on the GPUs of one node, the copy engines pull the left neighbour's block,
with no SM taken from the attention).

Each block's attention is one fused kernel that returns the block's log-sum-exp next to its output
(``attend_with_lse``: cuDNN's or FlashAttention's kernel on a GPU); the online softmax merges the (out, lse)
pairs, so no block's (s/p)² scores are written to memory. On a GPU a step is a few calls from the host, and on
some hosts those calls take longer than the step's kernels: so a block travels token-major, as the
projections lay K and V out (``kv_block``: stacking them is a plain copy), and each query chunk's last merge
writes straight into the layout the output projection reads (``output_like``).

A rank whose compute fails mid-ring still passes on the blocks it owes, computing nothing, before it raises
(``RingAttention._pass_on``): its peers never wait for a block that would not come, and their results are exact.

Bytes sent per rank: p-1 blocks of 2·b·(s/p)·h_kv·bytes = 2 (p-1)/p · b·s·h_kv·bytes, the same as the
all-gather (tplab.cost.sequence_parallel), in p-1 messages (k and v travel together).

Causal: my chunk of queries against a chunk of keys is one of three cases (layout.py: chunks have equal
length) —  entirely in the past: no mask;  the same chunk: the triangular mask;  entirely in the future:
skipped. The blocks still travel the whole ring (every rank needs some of them); the skipped compute is
what makes the contiguous layout unbalanced and the zig-zag layout balanced.

Forward only: gradients would need a second ring that carries dK, dV back (not written here). Calling
it on tensors that require grad raises instead of returning silently wrong gradients.
"""

from __future__ import annotations

import functools
import time

import torch

from tplab.sequence.allgather_kv import repeat_kv
from tplab.sequence.checks import check_attention_inputs
from tplab.sequence.layout import my_chunks
from tplab.sequence.online_softmax import OnlineSoftmax
from tplab.sequence.ring_pass import MessagePasses


def causal_relation(query_chunk: int, key_chunk: int) -> str:
    """'past', 'diagonal' or 'future': where a chunk of keys lies for a chunk of queries."""
    if key_chunk < query_chunk:
        return "past"
    return "diagonal" if key_chunk == query_chunk else "future"


def kv_block(k, v) -> torch.Tensor:
    """k, v (b, n_kv, s/p, d) -> one block (2, b, s/p, n_kv, d) that travels as one message: token-major, as
    the K and V projections lay them out (the (b, n_kv, s/p, d) views of them are transposes), so stacking
    them is a plain copy, not a transposing one (0.08 ms instead of 0.19 at the course project's size on an
    H100), and the attention kernels read the block's views as they read the projections'."""
    return torch.stack([k.transpose(1, 2), v.transpose(1, 2)])


def output_like(q) -> torch.Tensor:
    """An empty (b, n, s/p, d) tensor for the attention's result, laid out (b, s/p, n, d) in memory: what the
    output projection reads as (b, s/p, n·d) with no copy (the last merge of each query chunk writes there)."""
    b, n, s_local, d = q.shape
    return torch.empty((b, s_local, n, d), dtype=q.dtype, device=q.device).transpose(1, 2)


@functools.lru_cache(maxsize=256)
def last_blocks(query_chunks: tuple, owners: tuple, p: int, layout: str, causal: bool) -> tuple:
    """For each of my query chunks (their indices), the owner of the last block in ``owners`` (the order the
    blocks are folded in) that holds keys it sees: after that block nothing more is merged into that chunk,
    so its merge may write the result (fold_block's ``final``). Under a causal mask that can be an early
    block: in the zig-zag layout, rank r's first chunk sees no block after rank 0's."""
    def sees(query_chunk, owner):
        return not causal or any(causal_relation(query_chunk, key_chunk) != "future"
                                 for key_chunk in my_chunks(owner, p, layout))
    return tuple([owner for owner in owners if sees(query_chunk, owner)][-1] for query_chunk in query_chunks)


def fold_block(softmax, queries, kv, key_chunks, *, causal: bool, stats: dict, final=()) -> None:
    """Fold one rank's keys and values ``kv`` (a kv_block: (2, b, s/p, n_kv, d)), the sequence chunks
    ``key_chunks``, into the online softmax of each of my query chunks (``queries``: [(chunk index, (b, n, L,
    d)), ...]), skipping chunk pairs entirely in the future; counts the query-key pairs scored in ``stats``.
    ``final``: one bool per query chunk, true where no later block holds keys that chunk sees (last_blocks),
    so that its last merge writes the result's dtype, where the result goes (empty: none is final)."""
    finals = final or [False] * len(queries)
    heads, length = queries[0][1].shape[1], queries[0][1].shape[2]
    keys, values = (repeat_kv(t, heads) for t in kv.transpose(2, 3).unbind(0))  # (b, n, s/p, d) views
    if len(key_chunks) == 1:   # (few tensor operations on the way: on a GPU the ring's pace is often the host's)
        chunks = [(key_chunks[0], keys, values)]
    else:
        chunks = list(zip(key_chunks, keys.split(length, dim=2), values.split(length, dim=2)))
    for (query_chunk, q_chunk), acc, last in zip(queries, softmax, finals):
        visible = [(k_chunk, v_chunk, causal_relation(query_chunk, key_chunk) if causal else "past")
                   for key_chunk, k_chunk, v_chunk in chunks]
        visible = [chunk for chunk in visible if chunk[2] != "future"]  # future keys: nothing to compute
        for i, (k_chunk, v_chunk, relation) in enumerate(visible):
            acc.update(q_chunk, k_chunk, v_chunk, causal_diagonal=relation == "diagonal",
                       final=last and i == len(visible) - 1)
            stats["scores"] += length * length / (2 if relation == "diagonal" else 1)


def refuse_gradients(*tensors, scheme: str = "ring attention") -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise NotImplementedError(f"{scheme} is forward-only here (its backward would send dK and dV back to "
                                  "the blocks' owners): use torch.no_grad(), or the allgather_kv or ulysses "
                                  "scheme for gradients")


class RingAttention:
    """This rank's K and V on their trip around the ring; ``attend(q)`` folds in each block as it passes.
    Made by ``start_ring``, which starts the first transfer (the layer computes Q while it travels)."""

    def __init__(self, k, v, comm, exchange, layout):
        self.rank, self.size, self.layout = comm.rank, comm.size, layout
        self.passes = MessagePasses(comm) if exchange is None else exchange
        self.kv = kv_block(k, v)  # (2, b, s/p, n_kv, d): one message per step
        self.passing = self.passes.start_pass(self.kv) if self.size > 1 else None  # the first block leaves now

    def attend(self, q, *, causal: bool = True, stats: dict | None = None) -> torch.Tensor:
        """My queries (b, n, s/p, d) against every rank's block  ->  (b, n, s/p, d)."""
        p, rank, kv = self.size, self.rank, self.kv
        stats = {} if stats is None else stats
        for key in ("scores", "compute_s", "wait_s"):
            stats.setdefault(key, 0)
        try:
            refuse_gradients(q, scheme="ring attention")
            mine = my_chunks(rank, p, self.layout)
            length = q.shape[2] // len(mine)  # tokens per chunk
            queries = list(zip(mine, q.split(length, dim=2)))  # [(chunk index, (b, n, L, d)), ...]
            y = output_like(q)
            softmax = [OnlineSoftmax(q_chunk, out=y_chunk)
                       for (_, q_chunk), y_chunk in zip(queries, y.split(length, dim=2))]
            owners = [(rank - step) % p for step in range(p)]  # whose tokens' keys and values we hold, step by step
            last = last_blocks(tuple(mine), tuple(owners), p, self.layout, bool(causal))
            for step, owner in enumerate(owners):
                if 0 < step < p - 1:  # start moving the next block now, so it can travel while we compute
                    self.passing = self.passes.start_pass(kv)
                started = time.perf_counter()
                try:
                    fold_block(softmax, queries, kv, my_chunks(owner, p, self.layout), causal=causal, stats=stats,
                               final=[owner == owner_of_last for owner_of_last in last])
                except BaseException:
                    self._pass_on(kv, step)   # (then this rank raises; its peers' ring ends as it would have)
                    raise
                stats["compute_s"] += time.perf_counter() - started
                if step < p - 1:
                    started = time.perf_counter()
                    kv = self.passing.wait()  # (GPU: the compute stream waits for the block, not the host)
                    stats["wait_s"] += time.perf_counter() - started
        except BaseException:
            self.passes.abandon()  # (a peer that failed too may never send: nothing more waits for it)
            raise
        for acc in softmax:
            acc.result()  # (each chunk's result in y: written there by its last merge, or copied in)
        return y  # (b, n, s/p, d)

    def _pass_on(self, kv, step: int) -> None:
        """This rank's compute failed at ``step``: pass on, without computing, every block still owed to the
        right neighbour, so that the peers' ring ends as it would have, their results exact: no peer waits for
        a block that would never come. What fails on the way is dropped: the caller raises the compute's error."""
        try:
            if step < self.size - 1:
                kv = self.passing.wait()
                for _ in range(step + 1, self.size - 1):
                    self.passing = self.passes.start_pass(kv)
                    kv = self.passing.wait()
        except BaseException:  # noqa: BLE001 - the compute's error is the one to raise
            pass


def start_ring(k, v, comm, *, queries, layout: str = "contiguous", exchange=None, check: bool = True) -> RingAttention:
    """Start this rank's k, v (b, n_kv, s/p, d) around the ring. ``queries``: q, or a tensor of q's shape and
    dtype on the meta device (the layer computes q while the first block travels). ``exchange``: a shard
    exchange whose ``start_pass`` moves each step's block (ring_pass.py; default: messages on ``comm``);
    ``check``: agree on the shapes first."""
    refuse_gradients(k, v)
    if check:
        check_attention_inputs(queries, k, v, comm, layout)
    return RingAttention(k, v, comm, exchange, layout)


def ring_attention(q, k, v, comm, *, causal: bool = True, layout: str = "contiguous", exchange=None,
                   check: bool = True, stats: dict | None = None) -> torch.Tensor:
    """q (b, n, s/p, d), k, v (b, n_kv, s/p, d): this rank's tokens  ->  (b, n, s/p, d).

    ``exchange``: what moves the blocks (default: messages on ``comm``; ring_pass.py). ``stats`` (a dict,
    optional) accumulates what this rank did: ``scores`` (query-key pairs computed, per batch and head),
    ``compute_s`` and ``wait_s`` (seconds on the host clock: meaningful on the CPU; on a GPU the kernels
    run asynchronously)."""
    refuse_gradients(q, k, v)
    ring = start_ring(k, v, comm, queries=q, layout=layout, exchange=exchange, check=check)
    return ring.attend(q, causal=causal, stats=stats)
