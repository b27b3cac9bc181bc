"""Dynamic work pulling: a group that is free asks for the next item; nobody plans ahead.

A dispatcher holds the list of items. Each DP group's leader sends it "next?" when its group is free and
gets back an item index, or DONE when the list is empty. The leader then tells its TP group (a
broadcast), everyone in the group runs the item, and the leader asks again. Long items simply keep one
group busy while the others take the short ones: the schedule adapts to real times, including the
costs no model predicted.

    leader of group g                    dispatcher (a thread on world rank 0)
    send "next?" (g)          ------>    take the next index i of the list (or DONE)
    recv i                    <------    send i
    broadcast i to my group
    run item i, repeat until DONE        (with lookahead, "next?" goes out before running i)

Where the dispatcher lives: in a background thread of world rank 0, which also computes as a member of
group 0. A dedicated dispatcher rank would idle almost all the time (and with K = 1 there is no rank to
spare); a thread costs nothing while it sleeps. It needs MPI_THREAD_MULTIPLE (mpi4py asks for it by
default). The thread polls its pending receives and sleeps between polls (up to 0.5 ms), so it neither
spins on a shared core nor delays a request by more than that.

The order of the list is the policy: arrival order (first come, first served) or longest first (the
dynamic version of LPT). Messages are 8-byte integers on the groups' private control communicator.
"""

from __future__ import annotations

import threading
import time

import numpy as np

REQUEST, REPLY = 801, 802  # tags
DONE = -1


def _require_thread_multiple():
    from mpi4py import MPI

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise RuntimeError("the dynamic work queue runs its dispatcher in a thread, which needs MPI initialised "
                           "with MPI_THREAD_MULTIPLE (mpi4py's default; check mpi4py.rc.thread_level)")


class Dispatcher(threading.Thread):
    """Hands out ``order`` (item indices), one per request, to the ranks ``leaders``; then DONE to each."""

    def __init__(self, control, order, leaders):
        super().__init__(name="tplab-dispatcher", daemon=True)
        self.control, self.order, self.leaders = control, [int(i) for i in order], list(leaders)
        self.handed_out: list[tuple[int, int, float]] = []  # (leader, item, time) for the record
        self.error: BaseException | None = None

    def run(self):
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - reported by the main thread (join)
            self.error = e

    def _serve(self):
        c = self.control
        pending = {leader: c.irecv(np.empty(1, np.int64), leader, REQUEST) for leader in self.leaders}
        position, pause = 0, 0.0
        while pending:
            answered = False
            for leader, request in list(pending.items()):
                if not request.test():
                    continue
                item = self.order[position] if position < len(self.order) else DONE
                position += item != DONE
                self.handed_out.append((leader, item, time.perf_counter()))
                c.send(np.array([item], np.int64), leader, REPLY)
                if item == DONE:  # that group is finished: stop listening to it
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
    Collective over the world (every rank iterates until DONE); ``order`` must be the same on every rank.

    ``lookahead=1`` (default): the leader asks for its next item as soon as it receives one, so the
    answer travels while the group computes, and the round trip (a few ms on a busy, oversubscribed
    laptop; tens of µs on a quiet core) is hidden. The price: each group holds one item in reserve, so
    the last items are spread a little less evenly. ``lookahead=0`` asks only when idle."""

    def __init__(self, groups, order, timeline=None, lookahead: int = 1):
        _require_thread_multiple()
        if lookahead not in (0, 1):
            raise ValueError(f"lookahead must be 0 or 1, not {lookahead!r}")
        self.groups, self.timeline, self.lookahead = groups, timeline, lookahead  # pulls: "pull" spans
        self.dispatcher = None
        if groups.world.rank == 0:
            self.dispatcher = Dispatcher(groups.control, order, groups.leaders)
            self.dispatcher.start()

    def _ask(self):
        """Leader: send "next?" and return the pending reply."""
        g = self.groups
        g.control.send(np.array([g.index], np.int64), 0, REQUEST)
        return g.control.irecv(np.empty(1, np.int64), 0, REPLY)

    def _receive(self, pending) -> int:
        """The item for the whole group: the leader waits for the reply, then tells its group."""
        g = self.groups
        item = pending.wait() if g.is_leader else np.empty(1, np.int64)
        if g.tp > 1:  # the others wait here (sleeping: control has a deadline)
            from tplab.collectives import broadcast

            item = broadcast(item, g.group_control, root=0, check=False)
        return int(item[0])

    def __iter__(self):
        leader = self.groups.is_leader
        pending = self._ask() if leader else None
        while True:
            if self.timeline is None:
                item = self._receive(pending)
            else:
                with self.timeline.span("pull") as span:
                    item = span["item"] = self._receive(pending)
            if item == DONE:
                break
            if leader and self.lookahead:
                pending = self._ask()  # the next answer travels while this item runs
            yield item
            if leader and not self.lookahead:
                pending = self._ask()
        if self.dispatcher is not None:
            self.dispatcher.join()
            if self.dispatcher.error is not None:
                raise RuntimeError("the dispatcher failed") from self.dispatcher.error
