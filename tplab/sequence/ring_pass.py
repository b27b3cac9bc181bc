"""One step of the ring: every rank sends the block it holds to the right and receives the next from the left.

Ring attention (ring.py) needs one operation of its transport, p-1 times per call:

    passing = passes.start_pass(block)    # my block leaves for the right; the left's block starts arriving
    ...compute on block...                # (the transfer travels meanwhile)
    block = passing.wait()                # the block from the left (on a GPU: the caller's stream waits)

Two implementations of ``start_pass``:

    MessagePasses(comm)     two messages on a point-to-point communicator (isend right, irecv left): host MPI,
                            or NCCL send/recv (tplab.comm.nccl), there on a second CUDA stream (streams.py) so
                            that the transfer runs beside the compute
    a shard exchange        ``exchange.start_pass``: CopyEngineExchange (the GPUs of one node: the copy engines
                            pull the left neighbour's block over NVLink, no SM taken from the attention, no host
                            wait), or NullExchange (nothing moves: the ring's compute alone, for timing)
"""

from __future__ import annotations

import torch

from tplab.sequence.streams import SideStream


class MessagePasses:
    """The ring's steps of one call as messages on ``comm`` (tags 0, 1, 2, ...: one per step)."""

    def __init__(self, comm):
        self.comm, self.steps = comm, 0
        self.left, self.right = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size

    def start_pass(self, block: torch.Tensor) -> "MessagePass":
        side = SideStream(block.device)  # GPU: the transfers' stream; CPU: does nothing
        with side.after_compute(block):  # (GPU: once the block is ready; queued on the side stream)
            incoming = torch.empty_like(block)
            transfer = [self.comm.irecv(incoming, self.left, tag=self.steps),
                        self.comm.isend(block, self.right, tag=self.steps)]
            transfer[0].test()  # nudge: MPI starts moving the bytes; a transport that batches nonblocking
            #                     operations until a wait or test (tplab.comm.nccl) issues them now
        self.steps += 1
        return MessagePass(self.comm, side, transfer, side.record(), incoming)

    def abandon(self) -> None:
        pass  # (each call has its own tags: a later call never meets this one's messages)


class MessagePass:
    def __init__(self, comm, side, transfer, arrived, incoming):
        self.comm, self.side, self.transfer, self.arrived, self.incoming = comm, side, transfer, arrived, incoming

    def wait(self) -> torch.Tensor:
        self.comm.waitall(self.transfer)  # (GPU transports: queued, not done; the next line orders the GPU)
        self.side.wait(self.arrived, self.incoming)  # the compute stream uses the block only once it has arrived
        return self.incoming
