"""The Communicator: the one contract every transport implements, and all the rest of tplab talks to.

A Communicator is a group of ``size`` processes; this process is ``rank``. What it offers:

    point-to-point      send, recv, sendrecv, isend, irecv (+ Request.wait), barrier: what tplab's hand-written
                        algorithms (tplab.collectives) are made of. A transport that only runs whole
                        collectives (peer-memory kernels, torch.distributed, the null communicator) sets
                        ``point_to_point = False``; every algorithm name then runs its own collectives.
    its own collectives builtin_allreduce, builtin_reduce_scatter, builtin_allgather, builtin_broadcast,
                        builtin_reduce: the library's (MPI's, NCCL's) or the transport's kernels; the
                        "builtin" algorithm, and what "auto" runs where ``prefers_builtin`` is True.
    agreement           agree(description): do all ranks pass the same arguments? (tplab.collectives asks
                        before any data moves; a host all-gather by default, a GPU-side comparison where the
                        transport has one)
    plans               plan(collective, x, op, algorithm): a persistent fast path for arrays like x, or None
    bookkeeping         bytes_sent, messages_sent, reset_counters()   (what the algorithm really moved)
    metadata            allgather_object (pickled, uncounted: argument checks, not data)
    topology            node_of(rank), split_by_node() -> (ranks on my node, my peers on other nodes)

Semantics, the same for every transport:
- Collectives never change their input and return a new array of the caller's kind (numpy, CuPy, torch).
- GPU work is queued on the caller's current stream (torch's for a torch tensor, CuPy's otherwise): the
  result is ordered before whatever the caller queues next, as with NCCL; the host does not wait.
- Arguments are checked by tplab.collectives, on every rank, before any data moves (``agree``): ranks that
  disagree all raise ``CollectiveArgumentError``. A transport may then refuse what it cannot do by raising
  ``Unsupported`` before it communicates: that depends only on the agreed arguments, so every rank refuses
  alike and "auto" can fall back to a hand-written algorithm. ``cannot_take(x)`` names the inputs it can
  never take (host memory on a GPU transport, an array on another GPU); they join the agreement as problems.
- Point-to-point buffers are 1-D contiguous arrays; ``recv`` fills the buffer it is given.

A transport subclasses Communicator and fills in the underscored hooks. The counters live here, so every
transport counts the same way and the algorithms never change when the wire does.

Nodes: ranks on one machine talk through shared memory, ranks on different machines through the
network, often ten times slower. ``node_ids()`` says which node every rank is on (nodes numbered 0, 1,
... in order of their lowest rank). With ``ranks_per_node = q`` set, node = rank // q (emulated nodes,
to try hierarchical algorithms on one machine); otherwise the transport detects the real nodes, which
is collective the first time (call it on every rank). A sub-communicator made by ``split`` keeps the
node of each of its ranks in the parent: its own rank // q would be wrong, so it stores the list.
"""

from __future__ import annotations

import abc
from collections import Counter

from tplab.toolkit.arrays import is_gpu_array


class CommTimeoutError(RuntimeError):
    """A blocking operation did not complete in time: almost always a deadlock (a peer that never sends)."""


class CollectiveArgumentError(ValueError):
    """The arguments of a collective are invalid or differ between ranks (raised on every rank)."""


class Unsupported(TypeError):
    """The transport cannot run this collective with these arguments (a dtype or op its library lacks, a
    message larger than its buffers, no point-to-point). Raised before any communication and alike on every
    rank, since it depends only on arguments the ranks agreed on."""


def checked_ranks_per_node(value):
    """``value`` if it is None or a positive int; a clear error otherwise."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"ranks_per_node must be a positive integer or None, not {value!r}")
    return value


class Request:
    """A nonblocking operation in flight. ``wait()`` blocks until it completes and returns its buffer."""

    def __init__(self, comm: "Communicator", handle, buf, what: str):
        self._comm, self._handle, self.buf, self._what = comm, handle, buf, what
        self.done = False

    def wait(self):
        if not self.done:
            self._comm._wait(self._handle, self._what)
            self.done = True
        return self.buf

    def test(self) -> bool:
        if not self.done:
            self.done = self._comm._test(self._handle)
        return self.done


class Communicator(abc.ABC):
    """Base class of all transports. Subclasses set ``rank`` and ``size`` and implement the hooks."""

    rank: int
    size: int
    # node = rank // ranks_per_node when set; None: detect the real nodes (or an irregular layout)
    ranks_per_node: int | None = None
    _node_ids: list[int] | None = None  # node of every rank, once known
    _node_split = None  # (local, cross), made by the first split_by_node()
    _counts_for = None  # (parent, parent rank of each of my ranks): a node split counts for its parent
    moves_gpu_memory = False  # True for transports that take CuPy arrays / CUDA tensors (nccl.py, staged.py)
    takes_host_memory = True  # False for a GPU transport that cannot move host arrays too (NCCL)
    point_to_point = True     # False: whole collectives only; the hooks below are never called
    prefers_builtin = False   # True: algorithm="auto" runs the transport's own collectives

    def __init__(self):
        self.bytes_sent = 0
        self.messages_sent = 0
        self.plans: dict = {}  # tplab.collectives' per-call work, done once per (collective, input kind, ...)

    # ---- what a collective may ask before it moves data ---------------------------------------------------
    def cannot_take(self, arr) -> str | None:
        """Why this transport can never take ``arr`` (a numpy or CuPy array), or None. Default: host memory
        only, or GPU memory only, as ``moves_gpu_memory`` says."""
        gpu = is_gpu_array(arr)
        if gpu and not self.moves_gpu_memory:
            return (f"{type(self).__name__} moves host memory; for GPU arrays use tplab.comm.nccl_world() or "
                    "tplab.comm.StagedComm")
        if not gpu and self.moves_gpu_memory and not self.takes_host_memory:
            return f"{type(self).__name__} moves GPU memory; got an array in host memory"
        return None

    def agree(self, description: dict) -> str | None:
        """Do all ranks describe the same call? ``description``: a dict of plain values (shape, dtype, op,
        algorithm, root) plus ``problems``, a list of this rank's local problems. Returns None when every rank
        passed the same and none has a problem, else the message every rank raises. Collective. Default: one
        ``allgather_object`` of the descriptions (tens of microseconds on the host)."""
        everyone = self.allgather_object(description)
        messages = [f"rank {r}: {p}" for r, meta in enumerate(everyone) for p in meta.get("problems", ())]
        for key in description:
            if key == "problems":
                continue
            values = [meta.get(key) for meta in everyone]
            if len(set(map(repr, values))) > 1:
                listed = ", ".join(f"rank {r} {v}" for r, v in enumerate(values))
                messages.append(f"ranks disagree on {key}: {listed}")
        return "; ".join(messages) or None

    def plan(self, collective: str, x, op: str | None = None, algorithm: str = "auto"):
        """A persistent ``collective`` ("allreduce", "allgather", "reduce_scatter") for inputs like ``x``
        (same shape, dtype, device, stream) by the transport's own collective: a callable ``plan(x, comm) ->
        result`` with the semantics of tplab.collectives' function, which does per call only what must be
        done per call and checks the ranks' agreement itself (or says it does not). It must not hold the
        communicator (it is kept in ``comm.plans``: a reference cycle would leave the communicator to the
        garbage collector, which frees it at a different moment on every rank). None where the transport
        has no such path (the default)."""
        return None

    # ---- counters: every message the algorithm sends, whatever the transport --------------------------
    def reset_counters(self) -> None:
        self.bytes_sent = 0
        self.messages_sent = 0

    def _count(self, buf, dest: int) -> None:
        self.bytes_sent += int(buf.nbytes)
        self.messages_sent += 1
        if self._counts_for is not None:  # sent by a collective of the parent, through a node split
            parent, parent_ranks = self._counts_for
            parent._count(buf, parent_ranks[dest])

    # ---- point-to-point ------------------------------------------------------------------------------
    def send(self, buf, dest: int, tag: int = 0) -> None:
        self._count(buf, dest)
        self._send(buf, dest, tag)

    def recv(self, buf, source: int, tag: int = 0):
        """Receive into ``buf`` (which must have exactly the incoming size) and return it."""
        self._recv(buf, source, tag)
        return buf

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0):
        """Send ``sendbuf`` to ``dest`` while receiving ``recvbuf`` from ``source``; deadlock-free in pairs
        and rings. Returns ``recvbuf``."""
        self._count(sendbuf, dest)
        self._sendrecv(sendbuf, dest, recvbuf, source, tag)
        return recvbuf

    def isend(self, buf, dest: int, tag: int = 0) -> Request:
        self._count(buf, dest)
        return Request(self, self._isend(buf, dest, tag), buf, f"send to rank {dest} (tag {tag})")

    def irecv(self, buf, source: int, tag: int = 0) -> Request:
        return Request(self, self._irecv(buf, source, tag), buf, f"recv from rank {source} (tag {tag})")

    @staticmethod
    def waitall(requests) -> list:
        return [r.wait() for r in requests]

    # ---- nodes ---------------------------------------------------------------------------------------------
    def node_ids(self) -> list[int]:
        """The node of every rank (collective the first time if the real nodes must be detected)."""
        if self._node_ids is None:
            if self.ranks_per_node is not None:
                self._node_ids = [r // self.ranks_per_node for r in range(self.size)]
            else:
                self._adopt_node_ids(self._detect_node_ids())
        return self._node_ids

    def node_of(self, rank: int) -> int:
        return self.node_ids()[rank]

    def split_by_node(self) -> tuple["Communicator", "Communicator"]:
        """(local, cross): ``local`` holds the ranks on my node (by rank); ``cross`` the ranks with my
        local index on every node (by node). Made once and kept, as NCCL builds its rings once at init.
        What is sent on them is also counted on this communicator (hierarchical algorithms send on them
        on this communicator's behalf). Collective."""
        if self._node_split is None:
            nodes = self.node_ids()
            node = nodes[self.rank]
            local_index = nodes[: self.rank].count(node)  # how many ranks of my node come before me
            local = self.split(color=node, key=self.rank)
            cross = self.split(color=local_index, key=node)
            for sub in (local, cross):
                sub._counts_for = (self, sub.allgather_object(self.rank))
            self._node_split = (local, cross)
        return self._node_split

    def _detect_node_ids(self) -> list[int]:
        """Transports that can see the machines override this; a generic one knows of one node only."""
        return [0] * self.size

    def _adopt_node_ids(self, ids) -> None:
        """Take a given layout: nodes renumbered 0, 1, ... by their lowest rank; ``ranks_per_node``
        set where the layout is node = rank // q, None where it is not (uneven nodes, interleaved)."""
        renumber: dict = {}
        self._node_ids = [renumber.setdefault(n, len(renumber)) for n in ids]
        q = Counter(self._node_ids)[0] if self._node_ids else None
        self.ranks_per_node = q if self._node_ids == [r // q for r in range(self.size)] else None

    def _inherit_nodes(self, sub: "Communicator", parent_ranks=None) -> "Communicator":
        """Give ``sub`` (a split or duplicate of this communicator) the nodes its ranks have here.
        ``parent_ranks[i]`` is the rank here of sub's rank i (found with one allgather if not given)."""
        if parent_ranks is None:
            parent_ranks = sub.allgather_object(self.rank)
        sub._adopt_node_ids([self.node_of(r) for r in parent_ranks])
        return sub

    def split(self, color: int, key: int | None = None) -> "Communicator":
        """Sub-communicators of the ranks with the same ``color``, ordered by ``key`` (default: rank)."""
        raise Unsupported(f"{type(self).__name__} cannot make sub-communicators")

    timeout: float | None = None  # seconds a blocking call may wait before CommTimeoutError (None: forever)

    def with_timeout(self, timeout: float | None, poll_pause: float | None = None) -> "Communicator":
        """A duplicate of this communicator (the same ranks, a message space of its own, so stray messages
        cannot mix) whose blocking calls give up after ``timeout`` seconds where the transport can, polling
        with sleeps of at most ``poll_pause`` seconds (0: just yield the core) where it polls. Collective.
        Default: a plain duplicate (``split``); a transport that cannot split is returned as it is."""
        try:
            return self.split(0, self.rank)
        except Unsupported:
            return self

    def free(self) -> None:
        """Release what the transport holds for this communicator (a duplicate, a sub-communicator)."""

    # ---- hooks a transport implements (point-to-point ones only where point_to_point is True) ------------
    def _no_point_to_point(self):
        raise Unsupported(f"{type(self).__name__} runs whole collectives only: it has no point-to-point")

    def _send(self, buf, dest: int, tag: int) -> None:
        self._no_point_to_point()

    def _recv(self, buf, source: int, tag: int) -> None:
        self._no_point_to_point()

    def _sendrecv(self, sendbuf, dest, recvbuf, source, tag) -> None:
        # Correct for any transport with nonblocking operations; MPI overrides it with MPI_Sendrecv.
        r = self._irecv(recvbuf, source, tag)
        s = self._isend(sendbuf, dest, tag)
        self._wait(r, f"recv from rank {source} (tag {tag})")
        self._wait(s, f"send to rank {dest} (tag {tag})")

    def _isend(self, buf, dest: int, tag: int):
        self._no_point_to_point()

    def _irecv(self, buf, source: int, tag: int):
        self._no_point_to_point()

    def _wait(self, handle, what: str) -> None:
        self._no_point_to_point()

    def _test(self, handle) -> bool:
        self._no_point_to_point()

    @abc.abstractmethod
    def barrier(self) -> None: ...

    @abc.abstractmethod
    def allgather_object(self, obj) -> list:
        """Every rank's ``obj``, in rank order (small metadata only; not counted)."""

    # ---- the library's own collectives (same semantics as tplab.allreduce & co.) ----------------------
    # Arrays in are numpy or CuPy views (bfloat16 as 16-bit integers, with the op's bfloat16 variant); a
    # transport that lacks one leaves the default, which refuses it (tplab.collectives then falls back).
    def _not_here(self, name: str):
        raise Unsupported(f"{type(self).__name__} has no {name} of its own")

    def builtin_allreduce(self, x, op: str):
        self._not_here("all-reduce")

    def builtin_reduce_scatter(self, x, op: str):
        self._not_here("reduce-scatter")

    def builtin_allgather(self, x):
        self._not_here("all-gather")

    def builtin_broadcast(self, x, root: int):
        self._not_here("broadcast")

    def builtin_reduce(self, x, op: str, root: int):
        self._not_here("reduce")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} rank {self.rank} of {self.size}>"
