"""Moving token shards between ranks while they compute: what async tensor parallelism needs of a transport.

Under sequence parallelism (Megatron's layout: activations (s, b, h) split along s between layers, rank r
holding rows r·s/p .. (r+1)·s/p) a column-parallel GEMM needs every rank's rows (an all-gather before it)
and a row-parallel GEMM leaves every rank a partial sum of every row (a reduce-scatter after it). Cut
both collectives into their p shards and each shard can move while another shard's GEMM runs:

    gathered = exchange.start_gather(x_shard)    # every rank's shard starts moving to every rank
    for q in gathered.order:                      # mine first (it is here), then r+1, r+2, ... in turn
        y[rows of q] = gathered.shard(q) @ W      # waits for shard q only
    gathered.done()

    exchange.start_gather(x_shard, out=all_shards).done()   # an all-gather: shard q lands in all_shards[q]
                                                            # ((p, *shard.shape), contiguous; mine copied in)

    scatter = exchange.start_scatter(like)        # like: one shard's shape and dtype
    for q in peers:                               # each peer's rows first, then mine
        W_q(scatter.out_for(q))                   # write rank q's partial where the exchange wants it
        scatter.send(q)                           # it is written: start moving it to rank q (once per peer)
    W_r(scatter.out_for(rank))                    # my own rows' partial
    y_shard = scatter.finish()                    # mine + what every peer sent me, summed over ranks

    passing = exchange.start_pass(block)          # a ring's step: my block to the right, the left's to me
    block = passing.wait()                        # the block from the left (tplab.sequence.ring_pass)

Three exchanges implement this:

    MessageExchange(comm)     any tplab communicator with point-to-point (MPI on CPU ranks): isend/irecv
                              of every shard at once; ``shard(q)`` waits for q's message. Host memory.
    CopyEngineExchange(...)   (tplab.gpu_collectives.copy_engine_exchange) GPUs of one node: the copy
                              engines pull shards out of, and push partials into, the peers' memory over
                              NVLink, so the GEMMs keep every SM; the GPU waits on CUDA events and barriers,
                              never the host.
    NullExchange(rank, size)  nothing moves (every shard "landed" is my own): the decomposed layer's own
                              cost -- its smaller GEMMs, its reduction -- next to the plain layer's compute.

Every rank makes the same starts in the same order (like any collective); shards are equal in size. Each
start first agrees on the host (one small allgather: which call, which shape, any rank's problem), so bad
input is an error on every rank; ``refuse(what, problem)`` is that agreement for a caller's own checks.
After an error between a start and its end, ``abandon()`` finishes what is in flight.
"""

from __future__ import annotations

import torch

from tplab.comm.base import Unsupported
from tplab.comm.shard_agreement import agree_on_shards, check_all_sent, check_send, out_problem

FIRST_TAG, TAGS = 1000, 30000  # call n's messages carry tag FIRST_TAG + n % TAGS: no call takes another's


def _bytes(t: torch.Tensor):
    """A tensor's memory as a numpy uint8 array (shared, not copied): any dtype travels, bfloat16 too."""
    return t.reshape(-1).view(torch.uint8).numpy()


class MessageExchange:
    """Shards as messages of a point-to-point communicator (host memory: CPU tensors). Collective to make:
    it talks on a duplicate of ``comm`` (a message space of its own), so no other message meets its tags.
    ``duplicate=False``: on ``comm`` itself (its counters count the bytes), for an exchange that lives for
    one call, whose messages are all received before the next call's are sent."""

    def __init__(self, comm, *, duplicate: bool = True):
        if not comm.point_to_point:
            raise ValueError(f"MessageExchange needs a communicator with point-to-point messages, not {comm!r}")
        try:
            comm = comm.with_timeout(comm.timeout) if duplicate else comm
        except Unsupported:
            pass    # (a transport without duplicates: its own messages then share the tags' space)
        self.comm, self.rank, self.size = comm, comm.rank, comm.size
        self.calls, self._in_flight, self._abandoned = 0, [], []

    def _peers(self) -> list[int]:
        return [(self.rank + i) % self.size for i in range(1, self.size)]  # r+1 first: peers spread the load

    def _agree(self, what, t, problem="") -> int:
        """The agreement; returns this call's message tag."""
        if not problem and t.device.type != "cpu":
            problem = f"host tensors only (on GPUs use CopyEngineExchange), not a tensor on {t.device}"
        self.calls += 1
        agree_on_shards(self.comm.allgather_object, f"MessageExchange.{what}", self.calls, t.shape, t.dtype, problem)
        return FIRST_TAG + self.calls % TAGS

    def refuse(self, what: str, problem: str, like=None) -> None:
        """This rank cannot make its next call (``problem``): agree on it, so that every rank raises."""
        self._agree(what, torch.empty(0) if like is None else like, problem)

    def start_gather(self, shard: torch.Tensor, out: torch.Tensor | None = None) -> "MessageGather":
        tag = self._agree("start_gather", shard, out_problem(shard, out, self.size))
        shard = shard.contiguous()
        if out is not None:
            out[self.rank].copy_(shard)
        landed = {q: torch.empty_like(shard) if out is None else out[q] for q in self._peers()}
        receives = {q: self.comm.irecv(_bytes(buf), q, tag) for q, buf in landed.items()}
        sends = [self.comm.isend(_bytes(shard), q, tag) for q in self._peers()]
        self._in_flight.append(MessageGather(self, shard, landed, receives, sends))
        return self._in_flight[-1]

    def start_scatter(self, like: torch.Tensor) -> "MessageScatter":
        tag = self._agree("start_scatter", like)
        slots = torch.empty((self.size, *like.shape), dtype=like.dtype)  # slot q: rank q's partial of my rows
        receives = [self.comm.irecv(_bytes(slots[q]), q, tag) for q in self._peers()]
        self._in_flight.append(MessageScatter(self, slots, receives, tag))
        return self._in_flight[-1]

    def start_pass(self, block: torch.Tensor) -> "MessagePass":
        tag = self._agree("start_pass", block)
        block, left, right = block.contiguous(), (self.rank - 1) % self.size, (self.rank + 1) % self.size
        incoming = torch.empty_like(block)
        requests = [self.comm.irecv(_bytes(incoming), left, tag), self.comm.isend(_bytes(block), right, tag)]
        self._in_flight.append(MessagePass(self, incoming, requests))
        return self._in_flight[-1]

    def abandon(self) -> None:
        """After an error mid-block: forget the calls in flight without waiting for them (a peer that failed
        too never sends what they wait for). Their buffers are kept, since MPI may still write into them;
        their messages carry their own calls' tags, which no later call takes."""
        self._abandoned += self._in_flight
        self._in_flight = []


class MessageGather:
    def __init__(self, exchange, shard, landed, receives, sends):
        self.order = [exchange.rank, *receives]          # mine, then the peers from r+1 on
        self._exchange, self._rank, self._shard = exchange, exchange.rank, shard
        self._landed, self._receives, self._sends = landed, receives, sends

    def shard(self, q: int) -> torch.Tensor:
        if q == self._rank:
            return self._shard
        self._receives[q].wait()
        return self._landed[q]

    def wait_posted(self) -> None:
        for request in [*self._receives.values(), *self._sends]:
            request.wait()

    def done(self) -> None:
        self.wait_posted()
        self._exchange._in_flight = [c for c in self._exchange._in_flight if c is not self]


class MessagePass:
    def __init__(self, exchange, incoming, requests):
        self._exchange, self._incoming, self._requests = exchange, incoming, requests

    def wait(self) -> torch.Tensor:
        for request in self._requests:
            request.wait()
        self._exchange._in_flight = [c for c in self._exchange._in_flight if c is not self]
        return self._incoming


class MessageScatter:
    def __init__(self, exchange: MessageExchange, slots, receives, tag):
        self._exchange, self._slots, self._receives, self._tag = exchange, slots, receives, tag
        self._outgoing, self._sends = {}, {}

    def out_for(self, q: int) -> torch.Tensor:
        if q == self._exchange.rank:
            return self._slots[q]
        return self._outgoing.setdefault(q, torch.empty_like(self._slots[0]))

    def send(self, q: int) -> None:
        check_send(q, self._exchange, self._sends, self._outgoing)
        self._sends[q] = self._exchange.comm.isend(_bytes(self._outgoing[q]), q, self._tag)

    def wait_posted(self) -> None:
        for request in [*self._receives, *self._sends.values()]:
            request.wait()

    def finish(self) -> torch.Tensor:
        check_all_sent(self._exchange, self._sends)
        self.wait_posted()
        self._exchange._in_flight = [c for c in self._exchange._in_flight if c is not self]
        return self._slots.sum(dim=0)


class NullExchange:
    """The exchange's work without the transfers (for timing, like NullComm): every rank's shard is this
    rank's own, sends go nowhere, and ``finish`` still sums p slots, as the real exchanges do."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self._slots = rank, size, {}

    def start_gather(self, shard, out=None):
        if out is not None:
            out.copy_(shard.expand(self.size, *shard.shape))
        return _NullGather(self.rank, self.size, shard)

    def start_scatter(self, like):
        key = (tuple(like.shape), like.dtype, like.device)
        if key not in self._slots:
            self._slots[key] = torch.zeros((self.size, *like.shape), dtype=like.dtype, device=like.device)
        return _NullScatter(self._slots[key], self.rank)

    def start_pass(self, block):
        return _NullPass(block)

    def refuse(self, what: str, problem: str, like=None) -> None:
        from tplab.comm.base import CollectiveArgumentError

        raise CollectiveArgumentError(f"{what}: rank {self.rank}: {problem}")

    def abandon(self) -> None:
        pass


class _NullGather:
    def __init__(self, rank, size, shard):
        self.order, self._shard = [(rank + i) % size for i in range(size)], shard

    def shard(self, q):
        return self._shard

    def done(self):
        pass


class _NullPass:
    def __init__(self, block):
        self._block = block

    def wait(self):
        return self._block


class _NullScatter:
    def __init__(self, slots, rank):
        self._slots, self._rank = slots, rank

    def out_for(self, q):
        return self._slots[self._rank if q == self._rank else (self._rank + 1) % len(self._slots)]

    def send(self, q):
        pass

    def finish(self):
        return self._slots.sum(dim=0)
