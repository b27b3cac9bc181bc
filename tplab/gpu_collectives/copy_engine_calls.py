"""The handles of one CopyEngineExchange call (tplab.gpu_collectives.copy_engine_exchange explains the
whole): a gather's shards as they land, a scatter's partial sums as they are pushed; and the copy itself."""

from __future__ import annotations

from tplab.comm.shard_agreement import check_all_sent, check_send
from tplab.gpu_collectives.copy_engine import MEMCPY_DEVICE_TO_DEVICE
from tplab.toolkit.arrays import external_stream


class CopyEngineGather:
    def __init__(self, exchange, stream, shard, landed, events, published, captured: bool):
        self.order = [exchange.rank, *events]               # mine, then the peers from r+1 on
        self._exchange, self._stream, self._shard, self._landed = exchange, stream, shard, landed
        self._events, self._published = events, published
        self.captured = captured                            # (its events exist inside that capture only)

    def shard(self, q: int):
        if q == self._exchange.rank:
            return self._shard
        self._stream.wait_event(self._events[q])             # (the caller's stream waits, not the host)
        return self._landed[q]

    def done(self, stream=None) -> None:
        """The caller's stream (or ``stream``) waits for every pull, asked for or not."""
        stream = stream or self._stream
        for event in self._events.values():
            stream.wait_event(event)
        stream.wait_event(self._published)                  # (one rank: nothing else joins the publisher back,
        if self._exchange._open.get("gather") is self:      #  and a capture must end with every stream joined)
            del self._exchange._open["gather"]


class CopyEngineScatter:
    def __init__(self, exchange, stream, half: int, shape, dtype):
        self._exchange, self._stream, self._half, self._shape, self._dtype = exchange, stream, half, shape, dtype
        self._slots = exchange._slots(exchange.rank, half, shape, dtype)
        self._outgoing, self._sent, self._pushed = {}, set(), []
        self._met = None       # graphed: the event of the meeting before the first push (every lane waits for it)

    def _meet(self, stream) -> None:
        """Graphed (see the module docstring): before this scatter's first write into a peer's slots, a
        barrier on ``stream`` -- every peer has summed its earlier scatters' slots. Once per scatter."""
        ex = self._exchange
        if self._met is None:
            ex._barrier(ex.scatter_barriers, stream, 0)
            self._met = stream.record_event()
        else:
            stream.wait_event(self._met)

    def out_for(self, q: int):
        """Where rank q's partial goes: my own slot for q = rank; else a local tensor that ``send`` pushes
        with a copy engine, or (``pushes="gemm"``) slot r of rank q's own memory, which the GEMM writes over
        NVLink as it finishes each tile -- nothing left to send."""
        import torch

        ex = self._exchange
        if q == ex.rank:
            return self._slots[q]
        if q not in self._outgoing:
            if ex.pushes == "gemm" and ex.meets_first and self._met is None:
                self._meet(self._stream)            # (the GEMM on the caller's stream writes into rank q's memory)
            self._outgoing[q] = (ex._slots(q, self._half, self._shape, self._dtype)[ex.rank] if ex.pushes == "gemm"
                                 else torch.empty(self._shape, dtype=self._dtype, device=f"cuda:{ex.device}"))
        return self._outgoing[q]

    def send(self, q: int) -> None:
        ex = self._exchange
        check_send(q, ex, self._sent, self._outgoing)
        self._sent.add(q)
        if ex.pushes == "gemm":
            return                                                     # (written in place, over NVLink)
        partial = self._outgoing[q]
        stream = ex.pushers[len(self._pushed) % len(ex.pushers)]       # in the order the GEMMs wrote them
        stream.wait_stream(self._stream)                               # the GEMM that wrote it
        if ex.meets_first:
            self._meet(stream)
        target = ex.scatter_memory.data_pointer(q) + (self._half * ex.size + ex.rank) * ex.slot
        _copy(target, partial.data_ptr(), partial.numel() * partial.element_size(), stream, ex.piece)
        partial.record_stream(stream)
        self._pushed.append(stream.record_event())

    def finish(self):
        ex = self._exchange
        check_all_sent(ex, self._sent)
        for event in self._pushed:
            self._stream.wait_event(event)
        ex._closing_barrier(ex.scatter_barriers, self._stream, self._half)   # every push has landed everywhere
        ex._open.pop("scatter", None)
        return self._slots.sum(dim=0)                                   # (bfloat16: summed in float32)


def _copy(dst: int, src: int, nbytes: int, stream, piece: int = 0) -> None:
    """Copy ``nbytes`` on ``stream`` (a copy engine's work), in pieces of ``piece`` bytes if > 0: other streams'
    copies and memsets, which queue for the same engines, then wait for a piece instead of the whole copy."""
    import cupy

    step = piece or nbytes
    for start in range(0, nbytes, max(step, 1)):
        cupy.cuda.runtime.memcpyAsync(dst + start, src + start, min(step, nbytes - start), MEMCPY_DEVICE_TO_DEVICE,
                                      stream.cuda_stream)


def _cupy_stream(stream):
    return external_stream(stream.cuda_stream)
