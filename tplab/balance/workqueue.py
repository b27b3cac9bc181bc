"""Dynamic work pulling: a group that is free asks for more work; nobody plans ahead.

A dispatcher holds the list of items (in the order it will hand them out). Each DP group's leader sends
it "more?" when its group is free and gets back the next *chunk* of the list (a start position and a
count; count 0 means the list is empty). The leader tells its TP group (a broadcast), everyone in the
group runs the chunk's items, and the leader asks again. Long items keep one group busy while the
others take the short ones: the schedule adapts to the real times, including those no model predicted.

    leader of group g                    dispatcher (a thread on world rank 0)
    send "more?" (g)          ------>    cut the next chunk [start, start + count) of the list
    recv (start, count)       <------    send it (count 0: DONE)
    broadcast it to my group
    run the chunk's items, repeat until DONE   (with lookahead, "more?" goes out before running them)

Chunk sizes, as OpenMP's loop schedules:
    single   one item per request (``schedule(dynamic, 1)``): the best balance, one round trip per item
    guided   as many items as fit in 1/(2G) of the remaining predicted cost (G groups), at least one
             (``schedule(guided)``, measured in cost rather than count): big chunks early, single items
             at the end where balance is decided; far fewer round trips when items are short

Where the dispatcher lives: in a background thread of world rank 0, which also computes as a member of
group 0. A dedicated dispatcher rank would idle almost all the time (and with K = 1 there is no rank to
spare); a thread costs nothing while it sleeps. It needs MPI_THREAD_MULTIPLE (mpi4py asks for it by
default). The thread polls its pending receives and sleeps between polls (up to 0.5 ms).

A round trip is what dynamism costs: tens of µs between ranks with a core each, but several ms on a
laptop whose ranks outnumber its cores (a rank that waits gives up its core, and the scheduler makes a
process that has just computed wait its turn to run again). ``lookahead=1`` hides it behind the current
chunk's work; ``guided`` makes fewer of them. Messages are pairs of int64 on the private control
communicator of the groups.
"""

from __future__ import annotations

import threading
import time

import numpy as np

REQUEST, REPLY = 801, 802  # tags
CHUNKING = ("single", "guided")


def _require_thread_multiple():
    from mpi4py import MPI

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError("the dynamic work queue runs its dispatcher in a thread, which needs MPI initialised "
                           "with MPI_THREAD_MULTIPLE (mpi4py's default; check mpi4py.rc.thread_level)")


def guided_chunk(start: int, costs_in_order, remaining_cost: float, groups: int) -> int:
    """How many items from ``start`` make the next guided chunk: up to 1/(2G) of the remaining cost."""
    share = remaining_cost / (2 * groups)
    stop, taken = start + 1, costs_in_order[start]
    while stop < len(costs_in_order) and taken + costs_in_order[stop] <= share:
        taken += costs_in_order[stop]
        stop += 1
    return stop - start


def guided_chunks(costs_in_order, groups: int) -> list[range]:
    """The whole list cut into guided chunks (whoever asks, the cuts are the same)."""
    chunks, start, costs = [], 0, np.asarray(costs_in_order, dtype=float)
    while start < len(costs):
        count = guided_chunk(start, costs, float(costs[start:].sum()), groups)
        chunks.append(range(start, start + count))
        start += count
    return chunks


class Dispatcher(threading.Thread):
    """Hands out consecutive chunks of positions 0..n-1 of the list, on request, to the ranks
    ``leaders``; then (n, 0) = DONE to each of them."""

    def __init__(self, control, n_items, leaders, costs_in_order=None, chunking="single"):
        super().__init__(name="tplab-dispatcher", daemon=True)
        self.control, self.n, self.leaders = control, int(n_items), list(leaders)
        self.costs, self.chunking = costs_in_order, chunking
        self.handed_out: list[tuple[int, int, int, float]] = []  # (leader, start, count, time) for the record
        self.error: BaseException | None = None

    def run(self):
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread (join)
            self.error = e

    def _chunk(self, start) -> int:
        if start >= self.n:
            return 0
        if self.chunking == "single":
            return 1
        return guided_chunk(start, self.costs, float(np.sum(self.costs[start:])), len(self.leaders))

    def _serve(self):
        c = self.control
        pending = {leader: c.irecv(np.empty(1, np.int64), leader, REQUEST) for leader in self.leaders}
        position, pause = 0, 0.0
        while pending:
            answered = False
            for leader, request in list(pending.items()):
                if not request.test():
                    continue
                count = self._chunk(position)
                self.handed_out.append((leader, position, count, time.perf_counter()))
                c.send(np.array([position, count], np.int64), leader, REPLY)
                position += count
                if count == 0:  # that group is finished: stop listening to it
                    del pending[leader]
                else:
                    pending[leader] = c.irecv(np.empty(1, np.int64), leader, REQUEST)
                answered = True
            if not answered:
                time.sleep(pause)  # nothing to do: back off, up to half a millisecond
                pause = min(2 * pause + 1e-5, 5e-4)
            else:
                pause = 0.0


class WorkQueue:
    """Iterate over the items this rank's group should run: ``for i in WorkQueue(groups, order): ...``.
    Collective over the world (every rank iterates until DONE); ``order`` (and ``costs``, indexed by
    item) must be the same on every rank.

    ``lookahead=1`` (default): the leader asks for its next chunk as soon as it receives one, so the
    answer travels while the group computes. The price: each group holds one chunk in reserve, so the
    last items are spread a little less evenly. ``lookahead=0`` asks only when idle.
    ``chunking``: "single" or "guided" (which needs ``costs``)."""

    def __init__(self, groups, order, timeline=None, lookahead: int = 1, costs=None, chunking: str = "single"):
        _require_thread_multiple()
        if lookahead not in (0, 1):
            raise ValueError(f"lookahead must be 0 or 1, not {lookahead!r}")
        if chunking not in CHUNKING:
            raise ValueError(f"chunking must be one of {CHUNKING}, not {chunking!r}")
        if chunking == "guided" and costs is None:
            raise ValueError("guided chunks are cut by predicted cost: give costs")
        self.order = [int(i) for i in order]
        self.groups, self.timeline, self.lookahead = groups, timeline, lookahead  # pulls: "pull" spans
        self.dispatcher = None
        if groups.world.rank == 0:
            in_order = None if costs is None else np.array([float(costs[i]) for i in self.order])
            self.dispatcher = Dispatcher(groups.control, len(self.order), groups.leaders, in_order, chunking)
            self.dispatcher.start()
        # The first question goes out now: create the queue before the clock starts (as a static plan is
        # made before it), and the first answers are waiting when the work begins.
        self._pending = self._ask() if groups.is_leader else None

    def _ask(self):
        """Leader: send "more?" and return the pending reply."""
        g = self.groups
        g.control.send(np.array([g.index], np.int64), 0, REQUEST)
        return g.control.irecv(np.empty(2, np.int64), 0, REPLY)

    def _receive(self, pending) -> tuple[int, int]:
        """The chunk for the whole group: the leader waits for the reply, then tells its group."""
        g = self.groups
        chunk = pending.wait() if g.is_leader else np.empty(2, np.int64)
        if g.tp > 1:  # the others wait here (sleeping: control has a deadline)
            from tplab.collectives import broadcast

            chunk = broadcast(chunk, g.group_control, root=0, check=False)
        return int(chunk[0]), int(chunk[1])

    def __iter__(self):
        leader, pending = self.groups.is_leader, self._pending
        while True:
            if self.timeline is None:
                start, count = self._receive(pending)
            else:
                with self.timeline.span("pull") as span:
                    start, count = self._receive(pending)
                    span["item"], span["count"] = (self.order[start] if count else -1), count
            if count == 0:
                break
            if leader and self.lookahead:
                pending = self._ask()  # the next answer travels while this chunk runs
            yield from self.order[start:start + count]
            if leader and not self.lookahead:
                pending = self._ask()
        if self.dispatcher is not None:
            self.dispatcher.join()
            if self.dispatcher.error is not None:
                raise RuntimeError("the dispatcher failed") from self.dispatcher.error
