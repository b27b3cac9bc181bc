"""All-gather K and V, and attend to each rank's block as soon as it lands: the ring's compute, the
all-gather's wire.

The all-gather scheme (allgather_kv.py) waits for every rank's K and V before its one attention call.
Ring attention (ring.py) folds one block at a time into an online softmax, but a block reaches me only
after it has passed every rank between its owner and me: p-1 transfers one after another, each waiting
for the one before. Here every rank sends its block to every peer at once (a shard exchange: the same
bytes as the all-gather), and my queries fold in the blocks in the order they are asked for -- mine
first (it is here), then r+1, r+2, ... -- each as soon as it has landed:

    gathered = exchange.start_gather(kv_block(k, v))    every block starts moving to every rank
    (the layer computes Q here, while the blocks travel)
    for owner in r, r+1, ..., r-1:
        fold my queries against gathered.shard(owner) into the online softmax    (waits for that block only)
    out = the merged attention of every block

What travels and how is the exchange's business (tplab.comm.shard_exchange): ``MessageExchange`` sends
isend/irecv messages (CPU ranks; the default, over the scheme's communicator), and on the GPUs of one node
``tplab.gpu_collectives.CopyEngineExchange`` has the copy engines pull every peer's block over NVLink,
with no SM taken from the attention, the GPU waiting on CUDA events, never the host.

Bytes per rank: 2 (p-1)/p · b·s·h_kv, as the all-gather, in p-1 messages (k and v travel together).
Memory: every block lands (O(s), as the all-gather). Causal masks and layouts as in ring attention
(ring.fold_block). Forward only, like the ring.
"""

from __future__ import annotations

import weakref

import torch

from tplab.sequence.checks import check_attention_inputs
from tplab.sequence.layout import my_chunks
from tplab.sequence.online_softmax import OnlineSoftmax
from tplab.sequence.ring import fold_block, kv_block, last_blocks, output_like, refuse_gradients


# communicator -> its message exchange (see default_exchange). The exchange refers to its communicator, so
# an entry lives as long as the process: weak keys only keep a new communicator from taking a dead one's entry.
_default_exchanges = weakref.WeakKeyDictionary()


def default_exchange(comm):
    """The exchange a scheme uses when none is given: messages on ``comm`` itself (its counters count the
    bytes), one per communicator and kept with it, so that every call takes a tag of its own and the buffers
    of a call abandoned after an error stay alive while MPI may still write into them. One rank: nothing
    moves."""
    from tplab.comm.shard_exchange import MessageExchange, NullExchange

    if comm.size == 1:
        return NullExchange(0, 1)
    if comm not in _default_exchanges:
        _default_exchanges[comm] = MessageExchange(comm, duplicate=False)
    return _default_exchanges[comm]


class StreamedKV:
    """Every rank's K and V on their way to every rank; ``attend(q)`` folds each block in as it lands.
    Made by ``start_streamed_kv``."""

    def __init__(self, k, v, comm, exchange, layout):
        self.rank, self.size, self.layout = comm.rank, comm.size, layout
        self.exchange = default_exchange(comm) if exchange is None else exchange
        kv = kv_block(k, v)  # (2, b, s/p, n_kv, d): one block per rank
        numbering = (getattr(self.exchange, "rank", self.rank), getattr(self.exchange, "size", self.size))
        if numbering != (self.rank, self.size):  # block q must be rank q's tokens: one numbering for both
            self.exchange.refuse("start_gather", f"the exchange numbers this rank {numbering[0]} of {numbering[1]}, "
                                 f"the communicator {self.rank} of {self.size}", like=kv)
        self.gathered = self.exchange.start_gather(kv)

    def attend(self, q, *, causal: bool = True, stats: dict | None = None) -> torch.Tensor:
        """My queries (b, n, s/p, d) against every rank's block  ->  (b, n, s/p, d)."""
        stats = {} if stats is None else stats
        stats.setdefault("scores", 0)
        try:
            refuse_gradients(q, scheme="streamed K/V attention")
            mine = my_chunks(self.rank, self.size, self.layout)
            length = q.shape[2] // len(mine)
            queries = list(zip(mine, q.split(length, dim=2)))  # [(chunk index, (b, n, L, d)), ...]
            y = output_like(q)
            softmax = [OnlineSoftmax(q_chunk, out=y_chunk)
                       for (_, q_chunk), y_chunk in zip(queries, y.split(length, dim=2))]
            last = last_blocks(tuple(mine), tuple(self.gathered.order), self.size, self.layout, bool(causal))
            for owner in self.gathered.order:  # mine first, then r+1, r+2, ...
                fold_block(softmax, queries, self.gathered.shard(owner), my_chunks(owner, self.size, self.layout),
                           causal=causal, stats=stats, final=[owner == owner_of_last for owner_of_last in last])
        except BaseException:
            # a peer that failed too may never send its block: do not wait for it; the exchange keeps this
            # call's buffers (MPI may still write into them) and refuses or skips what the call left open
            self.exchange.abandon()
            raise
        self.gathered.done()
        for acc in softmax:
            acc.result()  # (each chunk's result in y: written there by its last merge, or copied in)
        return y  # (b, n, s/p, d)


def start_streamed_kv(k, v, comm, *, queries, layout: str = "contiguous", exchange=None,
                      check: bool = True) -> StreamedKV:
    """Start moving this rank's k, v (b, n_kv, s/p, d) to every rank. ``queries``: q, or a tensor of q's
    shape and dtype on the meta device (the layer computes q while the blocks travel). ``exchange``: a
    shard exchange (default: messages over ``comm``); ``check``: agree on the shapes first."""
    refuse_gradients(k, v, scheme="streamed K/V attention")
    if check:
        check_attention_inputs(queries, k, v, comm, layout)
    return StreamedKV(k, v, comm, exchange, layout)


def streamed_kv_attention(q, k, v, comm, *, causal: bool = True, layout: str = "contiguous", exchange=None,
                          check: bool = True, stats: dict | None = None) -> torch.Tensor:
    """q (b, n, s/p, d), k, v (b, n_kv, s/p, d): this rank's tokens  ->  (b, n, s/p, d). ``stats``: the
    query-key pairs this rank scored (``scores``, per batch row and head), as ring attention counts them."""
    refuse_gradients(q, scheme="streamed K/V attention")
    streamed = start_streamed_kv(k, v, comm, queries=q, layout=layout, exchange=exchange, check=check)
    return streamed.attend(q, causal=causal, stats=stats)
