"""The replayable stream barriers (tplab.gpu_collectives.copy_engine.StreamBarriers.queue_replayable), as a
protocol on a model of the GPUs' flags: every rank writes 1 into its flag at each peer, waits until each
peer's flag here is 1, then sets those flags back to 0, in flag slots that its barriers take in turn. Each
operation is atomic and a rank's operations run in order (one stream, or streams joined by events); the
ranks interleave in any order (hypothesis draws the schedule). Checked: no rank passes barrier k before
every rank has reached it, and nothing deadlocks -- with the slots taken in turn (2 or 3 of them). With one
slot a fixed schedule deadlocks: a peer's write for the next barrier lands before this rank's reset."""

from hypothesis import given, settings
from hypothesis import strategies as st


def operations(rank: int, size: int, barriers: int, slots: int):
    """Rank ``rank``'s operations for ``barriers`` barriers in a row: (kind, barrier, slot, peer)."""
    ops = []
    for k in range(barriers):
        slot, peers = k % slots, [q for q in range(size) if q != rank]
        ops += [("write", k, slot, q) for q in peers]     # my flag at q's: 1
        ops += [("wait", k, slot, q) for q in peers]      # q's flag here: until 1
        ops += [("reset", k, slot, q) for q in peers]     # q's flag here: back to 0
    return ops


def run(size: int, barriers: int, slots: int, choose):
    """Run every rank's operations, ``choose(n)`` picking which of n runnable ranks moves next. Returns
    'deadlock', or the first barrier that some rank passed before every rank reached it, or None."""
    flags = {(at, slot, q): 0 for at in range(size) for slot in range(slots) for q in range(size)}
    programs = [operations(r, size, barriers, slots) for r in range(size)]
    step = [0] * size
    reached = [-1] * size                                   # the last barrier each rank has started

    def runnable(r):
        if step[r] == len(programs[r]):
            return False
        kind, _, slot, q = programs[r][step[r]]
        return kind != "wait" or flags[(r, slot, q)] >= 1

    while any(step[r] < len(programs[r]) for r in range(size)):
        ready = [r for r in range(size) if runnable(r)]
        if not ready:
            return "deadlock"
        r = ready[choose(len(ready))]
        kind, k, slot, q = programs[r][step[r]]
        if kind == "write":
            flags[(q, slot, r)] = 1
            reached[r] = max(reached[r], k)
        elif kind == "reset":
            flags[(r, slot, q)] = 0
        step[r] += 1
        if kind == "wait" and programs[r][step[r]][0] == "reset" and min(reached) < k:   # (its last wait of k)
            return k
    return None


@settings(max_examples=300, deadline=None)
@given(size=st.integers(2, 5), barriers=st.integers(1, 7), slots=st.sampled_from([2, 3]), data=st.data())
def test_slots_taken_in_turn_meet_every_time_and_never_deadlock(size, barriers, slots, data):
    choose = lambda n: data.draw(st.integers(0, n - 1))  # noqa: E731 - hypothesis draws the interleaving
    assert run(size, barriers, slots, choose) is None


def test_one_slot_deadlocks_when_a_peer_is_faster():
    """Rank 1 writes its first flag, then rank 0 runs whenever it can: it passes barrier 0, resets, and writes
    barrier 1's flag at rank 1 -- where rank 1's reset of barrier 0 then wipes it, and rank 1 waits for ever."""
    first = [True]

    def rank_1_then_rank_0_first(n):           # n runnable ranks, in rank order
        pick = n - 1 if first[0] else 0
        first[0] = False
        return pick

    assert run(2, 2, 1, rank_1_then_rank_0_first) == "deadlock"
    first[0] = True
    assert run(2, 2, 2, rank_1_then_rank_0_first) is None
