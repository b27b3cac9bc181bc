"""EmulatedNetwork: pretend the ranks sit on several machines joined by a slower network.

On one machine every message goes through shared memory, so an algorithm that saves network traffic
(hierarchical allreduce, say) shows no gain. EmulatedNetwork wraps any Communicator, groups its ranks
into emulated nodes of ``ranks_per_node`` consecutive ranks, and makes every message pay for the link
it would take:

    one message of n bytes between nodes    latency + n / bandwidth              (the a + n b of the
    one message of n bytes inside a node    intra_latency + n / intra_bandwidth   cost model)

Defaults: 5 us and 25 GB/s between nodes (a 200 Gb/s InfiniBand NIC); nothing extra inside a node
(the inner transport's own shared-memory time is already real).

The model is store-and-forward at the sender: the sender waits the message's time, then hands it to
the inner transport, which delivers it at shared-memory speed. In ``sendrecv`` both partners wait for
their own outgoing message at the same time, so a pairwise exchange costs one message time, as on a
full-duplex link, and so does one step of a ring.

    net = EmulatedNetwork(world(), ranks_per_node=4, bandwidth=10e9)
    tplab.allreduce(x, net, algorithm="hierarchical")
    net.inter_node_bytes, net.charged_seconds          # what crossed the network, what it cost

Counters (reset by ``reset_counters``): ``bytes_sent`` and ``messages_sent`` as on any Communicator,
plus ``inter_node_bytes``, ``inter_node_messages`` and ``charged_seconds`` (the time the model made
this rank's sends wait). ``split``, ``split_by_node`` and ``with_timeout`` give EmulatedNetworks over
the inner communicator's splits, whose ranks keep the emulated nodes they had here.

What the model leaves out (it is a teaching model, not a network simulator):
- contention: ranks of one node that send across at the same time each get the full bandwidth, as if
  every rank had its own NIC. A real node shares one or a few, so algorithms in which all ranks of a
  node cross the network at once look better here than they are.
- overlap: ``isend`` is charged at the call, which blocks the caller, where a real NIC would move the
  data while the rank computes.
- the receiver: it is never charged; a message it posts late costs nothing extra.
- the MPI library's own collectives (``builtin_*``): their messages travel inside the library, past
  the model, so they raise NotImplementedError instead of running uncharged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tplab.comm.base import Communicator, checked_ranks_per_node
from tplab.comm.wrapped import Wrapped

SPIN_SECONDS = 100e-6  # time.sleep may overshoot by tens of microseconds: spin through the last stretch


@dataclass(frozen=True)
class Link:
    latency: float  # seconds per message
    bandwidth: float  # bytes per second (float("inf"): free)

    def __post_init__(self):
        if not (self.latency >= 0 and self.bandwidth > 0):
            raise ValueError(f"a link needs latency >= 0 and bandwidth > 0, not {self}")

    def seconds(self, nbytes: int) -> float:
        return self.latency + nbytes / self.bandwidth


def wait_precisely(seconds: float) -> None:
    """Block for ``seconds``: sleep through the bulk (leaving the core to other ranks), spin the end."""
    if seconds <= 0:
        return
    deadline = time.perf_counter() + seconds
    if seconds > SPIN_SECONDS:
        time.sleep(seconds - SPIN_SECONDS)
    while time.perf_counter() < deadline:
        pass


class EmulatedNetwork(Wrapped):
    def __init__(self, inner: Communicator, ranks_per_node: int, latency: float = 5e-6,
                 bandwidth: float = 25e9, intra_latency: float = 0.0, intra_bandwidth: float = float("inf")):
        super().__init__(inner)
        if checked_ranks_per_node(ranks_per_node) is None:
            raise ValueError("EmulatedNetwork needs ranks_per_node: how many consecutive ranks form a node")
        self.ranks_per_node = ranks_per_node
        self.network = Link(latency, bandwidth)
        self.within_node = Link(intra_latency, intra_bandwidth)
        self.reset_counters()

    # ---- the model -------------------------------------------------------------------------------------
    def message_seconds(self, nbytes: int, dest: int) -> float:
        """What the model charges for ``nbytes`` from this rank to ``dest``."""
        crosses = self.node_of(dest) != self.node_of(self.rank)
        return (self.network if crosses else self.within_node).seconds(nbytes)

    def _count(self, buf, dest) -> None:
        super()._count(buf, dest)  # (and, through a node split, the parent's counters)
        if self.node_of(dest) != self.node_of(self.rank):
            self.inter_node_bytes += int(buf.nbytes)
            self.inter_node_messages += 1
        self.charged_seconds += self.message_seconds(buf.nbytes, dest)

    def reset_counters(self) -> None:
        super().reset_counters()
        self.inter_node_bytes = 0
        self.inter_node_messages = 0
        self.charged_seconds = 0.0

    # ---- point-to-point: the sender waits, then the inner transport delivers --------------------------
    def _send(self, buf, dest, tag):
        wait_precisely(self.message_seconds(buf.nbytes, dest))
        self.inner._send(buf, dest, tag)

    def _sendrecv(self, sendbuf, dest, recvbuf, source, tag):
        # my outgoing message only: the partner waits for its own at the same time (full duplex)
        wait_precisely(self.message_seconds(sendbuf.nbytes, dest))
        self.inner._sendrecv(sendbuf, dest, recvbuf, source, tag)

    def _isend(self, buf, dest, tag):
        wait_precisely(self.message_seconds(buf.nbytes, dest))  # charged now: no overlap in this model
        return self.inner._isend(buf, dest, tag)

    # ---- sub-communicators: same model, same emulated node for every rank ------------------------------
    def _same_network_over(self, inner: Communicator) -> "EmulatedNetwork":
        # one rank per node for a moment: the caller gives it the real layout with _inherit_nodes
        return EmulatedNetwork(inner, 1, self.network.latency, self.network.bandwidth,
                               self.within_node.latency, self.within_node.bandwidth)

    def split(self, color: int, key: int | None = None) -> "EmulatedNetwork":
        return self._inherit_nodes(self._same_network_over(self.inner.split(color, key)))

    def with_timeout(self, timeout: float | None, poll_pause: float | None = None) -> "EmulatedNetwork":
        twin = self.inner.with_timeout(timeout, poll_pause)
        return self._inherit_nodes(self._same_network_over(twin), range(self.size))

    def free(self) -> None:
        self.inner.free()

    # ---- the library's own collectives cannot be charged ------------------------------------------------
    def _bypasses_the_model(self, name: str):
        raise NotImplementedError(
            f"EmulatedNetwork cannot run {name}: the MPI library's own collectives move their messages "
            "inside the library, past the emulated network, so they cannot be charged. Use a hand-written "
            f"algorithm (algorithm='ring', 'hierarchical', ...), or call net.inner.{name} for the real thing.")

    def builtin_allreduce(self, x, op="sum"):
        self._bypasses_the_model("builtin_allreduce")

    def builtin_reduce_scatter(self, x, op="sum"):
        self._bypasses_the_model("builtin_reduce_scatter")

    def builtin_allgather(self, x):
        self._bypasses_the_model("builtin_allgather")

    def builtin_broadcast(self, x, root=0):
        self._bypasses_the_model("builtin_broadcast")

    def builtin_reduce(self, x, op="sum", root=0):
        self._bypasses_the_model("builtin_reduce")

    def __repr__(self) -> str:
        return (f"<EmulatedNetwork rank {self.rank} of {self.size}, node {self.node_of(self.rank)}: "
                f"{self.network.latency * 1e6:g} us + n / {self.network.bandwidth / 1e9:g} GB/s between nodes>")
