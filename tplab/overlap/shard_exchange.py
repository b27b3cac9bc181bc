"""Moving token shards between ranks while they compute: what async tensor parallelism needs of a transport.

Under sequence parallelism (Megatron's layout: activations (s, b, h) split along s between layers, rank r
holding rows r·s/p .. (r+1)·s/p) a column-parallel GEMM needs every rank's rows (an all-gather before it)
and a row-parallel GEMM leaves every rank a partial sum of every row (a reduce-scatter after it). Cut
both collectives into their p shards and each shard can move while another shard's GEMM runs:

    gathered = exchange.start_gather(x_shard)    # every rank's shard starts moving to every rank
    for q in gathered.order:                      # mine first (it is already here), then as they land
        y[rows of q] = gathered.shard(q) @ W      # waits for shard q only
    gathered.done()

    scatter = exchange.start_scatter(like)        # like: one shard's shape and dtype
    for q in peers:                               # each peer's rows first, then mine
        W_q(scatter.out_for(q))                   # write rank q's partial where the exchange wants it
        scatter.send(q)                           # it is written: start moving it to rank q
    W_r(scatter.out_for(rank))                    # my own rows' partial
    y_shard = scatter.finish()                    # mine + what every peer sent me, summed over ranks

Three exchanges implement this:

    MessageExchange(comm)     any tplab communicator with point-to-point (MPI on CPU ranks): isend/irecv
                              of every shard at once; ``shard(q)`` waits for q's message. Host memory.
    CopyEngineExchange(...)   (tplab.gpu_collectives.copy_engine_exchange) GPUs of one node: the copy
                              engines pull shards out of, and push partials into, the peers' memory over
                              NVLink, so the GEMMs keep every SM; waits are CUDA events, nothing waits
                              on the host.
    NullExchange(rank, size)  nothing moves (every shard "landed" is my own): the decomposed layer's own
                              cost -- its smaller GEMMs, its reduction -- next to the plain layer's compute.

Every rank calls the same starts in the same order (like any collective); shards are equal in size.
"""

from __future__ import annotations

import torch

from tplab.comm.shard_agreement import agree_on_shards

GATHER_TAG, SCATTER_TAG = 7101, 7102  # (a gather and a scatter of the MLP are in flight at once)


def _bytes(t: torch.Tensor):
    """A tensor's memory as a numpy uint8 array (shared, not copied): any dtype travels, bfloat16 too."""
    return t.reshape(-1).view(torch.uint8).numpy()


class MessageExchange:
    """Shards as messages of a point-to-point communicator (host memory: CPU tensors)."""

    def __init__(self, comm):
        if not comm.point_to_point:
            raise ValueError(f"MessageExchange needs a communicator with point-to-point messages, not {comm!r}")
        self.comm, self.rank, self.size = comm, comm.rank, comm.size

    def _peers(self) -> list[int]:
        return [(self.rank + i) % self.size for i in range(1, self.size)]  # r+1 first: peers spread the load

    def _agree(self, t, what) -> None:
        problem = "" if t.device.type == "cpu" else \
            f"host tensors only (on GPUs use CopyEngineExchange), not a tensor on {t.device}"
        agree_on_shards(self.comm.allgather_object, f"MessageExchange.{what}", t.shape, t.dtype, problem)

    def start_gather(self, shard: torch.Tensor) -> "MessageGather":
        self._agree(shard, "start_gather")
        shard = shard.contiguous()
        landed = {q: torch.empty_like(shard) for q in self._peers()}
        receives = {q: self.comm.irecv(_bytes(buf), q, GATHER_TAG) for q, buf in landed.items()}
        sends = [self.comm.isend(_bytes(shard), q, GATHER_TAG) for q in self._peers()]
        return MessageGather(self.rank, shard, landed, receives, sends)

    def start_scatter(self, like: torch.Tensor) -> "MessageScatter":
        self._agree(like, "start_scatter")
        slots = torch.empty((self.size, *like.shape), dtype=like.dtype)  # slot q: rank q's partial of my rows
        receives = [self.comm.irecv(_bytes(slots[q]), q, SCATTER_TAG) for q in self._peers()]
        return MessageScatter(self, slots, receives)


class MessageGather:
    def __init__(self, rank, shard, landed, receives, sends):
        self.order = [rank, *receives]                   # mine, then the peers from r+1 on
        self._rank, self._shard, self._landed, self._receives, self._sends = rank, shard, landed, receives, sends

    def shard(self, q: int) -> torch.Tensor:
        if q == self._rank:
            return self._shard
        self._receives[q].wait()
        return self._landed[q]

    def done(self) -> None:
        for request in [*self._receives.values(), *self._sends]:
            request.wait()


class MessageScatter:
    def __init__(self, exchange: MessageExchange, slots, receives):
        self._exchange, self._slots, self._receives = exchange, slots, receives
        self._outgoing, self._sends = {}, []

    def out_for(self, q: int) -> torch.Tensor:
        if q == self._exchange.rank:
            return self._slots[q]
        return self._outgoing.setdefault(q, torch.empty_like(self._slots[0]))

    def send(self, q: int) -> None:
        self._sends.append(self._exchange.comm.isend(_bytes(self._outgoing[q]), q, SCATTER_TAG))

    def finish(self) -> torch.Tensor:
        for request in [*self._receives, *self._sends]:
            request.wait()
        return self._slots.sum(dim=0)


class NullExchange:
    """The exchange's work without the transfers (for timing, like NullComm): every rank's shard is this
    rank's own, sends go nowhere, and ``finish`` still sums p slots, as the real exchanges do."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self._slots = rank, size, {}

    def start_gather(self, shard):
        return _NullGather(self.rank, self.size, shard)

    def start_scatter(self, like):
        key = (tuple(like.shape), like.dtype, like.device)
        if key not in self._slots:
            self._slots[key] = torch.zeros((self.size, *like.shape), dtype=like.dtype, device=like.device)
        return _NullScatter(self._slots[key], self.rank)


class _NullGather:
    def __init__(self, rank, size, shard):
        self.order, self._shard = [(rank + i) % size for i in range(size)], shard

    def shard(self, q):
        return self._shard

    def done(self):
        pass


class _NullScatter:
    def __init__(self, slots, rank):
        self._slots, self._rank = slots, rank

    def out_for(self, q):
        return self._slots[self._rank if q == self._rank else (self._rank + 1) % len(self._slots)]

    def send(self, q):
        pass

    def finish(self):
        return self._slots.sum(dim=0)
