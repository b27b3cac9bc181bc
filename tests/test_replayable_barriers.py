"""The replayable stream barriers (tplab.gpu_collectives.copy_engine.StreamBarriers.queue_replayable), as a
protocol on a model of the GPUs' flags -- the very operations StreamBarriers builds (on a stand-in for the
CUDA driver's bindings, so no GPU is needed): every rank writes 1 into its flag at each peer, waits until each
peer's flag here is 1, then sets those flags back to 0, in flag slots that its barriers take in turn. Each
operation is atomic and a rank's operations run in order (one stream, or streams joined by events); the
ranks interleave in any order (hypothesis draws the schedule). Checked: no rank passes barrier k before
every rank has reached it, and nothing deadlocks -- with the slots taken in turn (2 or 3 of them). With one
slot a fixed schedule deadlocks: a peer's write for the next barrier lands before this rank's reset."""

import sys
from types import ModuleType, SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tplab.gpu_collectives.peer_agreement import MAX_RANKS, REPLAY_SLOTS


class FakeParams:                      # cuda.bindings.driver.CUstreamBatchMemOpParams, without the union
    def __init__(self):
        self.writeValue, self.waitValue = SimpleNamespace(), SimpleNamespace()


FAKE_DRIVER = SimpleNamespace(
    CUstreamBatchMemOpParams=FakeParams, CUdeviceptr=int,
    CUstreamBatchMemOpType=SimpleNamespace(CU_STREAM_MEM_OP_WRITE_VALUE_32="write", CU_STREAM_MEM_OP_WAIT_VALUE_32="wait"),
    CUstreamWriteValue_flags=SimpleNamespace(CU_STREAM_WRITE_VALUE_DEFAULT="fenced"),
    CUstreamWaitValue_flags=SimpleNamespace(CU_STREAM_WAIT_VALUE_GEQ=">="))
FLAGS = 1 << 20                        # rank q's flags area at (q + 1) * FLAGS in the stand-in address space


@pytest.fixture(scope="module")
def barriers_of():
    """rank, size -> the StreamBarriers that rank builds, its driver the stand-in."""
    from tplab.gpu_collectives.copy_engine import StreamBarriers

    fake_cuda = ModuleType("cuda")
    fake_cuda.bindings = SimpleNamespace(driver=FAKE_DRIVER)
    saved = {name: sys.modules.get(name) for name in ("cuda", "cuda.bindings")}
    sys.modules["cuda"], sys.modules["cuda.bindings"] = fake_cuda, fake_cuda.bindings
    try:
        yield lambda rank, size: StreamBarriers(SimpleNamespace(rank=rank, size=size,
                                                                _flags=[(q + 1) * FLAGS for q in range(size)]))
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def product_operations(barriers, rank: int, count: int, slots: int):
    """The operations of ``count`` replayable barriers in a row, roles 0, 1, .. slots-1 in turn, as StreamBarriers
    queues them, read back as (kind, barrier, role, peer)."""
    ops = []
    for k in range(count):
        role = k % slots
        for op in barriers.replayable[role]:
            kind = "wait" if hasattr(op.waitValue, "operation") else "write"
            value = op.waitValue if kind == "wait" else op.writeValue
            at, offset = divmod(value.address, FLAGS)
            slot, sender = divmod(offset, MAX_RANKS * 4)
            assert REPLAY_SLOTS.index(slot) == role
            if kind == "write" and value.value == 0:        # my own flags back to 0
                assert at - 1 == rank and value.flags == "fenced"
                ops.append(("reset", k, role, sender // 4))
            elif kind == "write":                            # my flag at a peer's: 1
                assert value.value == 1 and sender // 4 == rank and value.flags == "fenced"
                ops.append(("write", k, role, at - 1))
            else:                                            # a peer's flag here: until >= 1
                assert at - 1 == rank and value.value == 1 and value.flags == ">="
                ops.append(("wait", k, role, sender // 4))
    return ops


def operations(rank: int, size: int, barriers: int, slots: int):
    """The protocol by hand: rank ``rank``'s operations for ``barriers`` barriers, (kind, barrier, slot, peer)."""
    ops = []
    for k in range(barriers):
        slot, peers = k % slots, [q for q in range(size) if q != rank]
        ops += [("write", k, slot, q) for q in peers]     # my flag at q's: 1
        ops += [("wait", k, slot, q) for q in peers]      # q's flag here: until 1
        ops += [("reset", k, slot, q) for q in peers]     # q's flag here: back to 0
    return ops


def run(programs, slots: int, choose):
    """Run every rank's operations, ``choose(n)`` picking which of n runnable ranks moves next. Returns
    'deadlock', or the first barrier that some rank passed before every rank reached it, or None."""
    size = len(programs)
    flags = {(at, slot, q): 0 for at in range(size) for slot in range(slots) for q in range(size)}
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
def test_slots_taken_in_turn_meet_every_time_and_never_deadlock(barriers_of, size, barriers, slots, data):
    programs = [product_operations(barriers_of(r, size), r, barriers, slots) for r in range(size)]
    assert programs[0] == operations(0, size, barriers, slots)   # (the protocol the docstring states)
    choose = lambda n: data.draw(st.integers(0, n - 1))  # noqa: E731 - hypothesis draws the interleaving
    assert run(programs, slots, choose) is None


def test_one_slot_deadlocks_when_a_peer_is_faster():
    """Rank 1 writes its first flag, then rank 0 runs whenever it can: it passes barrier 0, resets, and writes
    barrier 1's flag at rank 1 -- where rank 1's reset of barrier 0 then wipes it, and rank 1 waits for ever."""
    first = [True]

    def rank_1_then_rank_0_first(n):           # n runnable ranks, in rank order
        pick = n - 1 if first[0] else 0
        first[0] = False
        return pick

    assert run([operations(r, 2, 2, 1) for r in range(2)], 1, rank_1_then_rank_0_first) == "deadlock"
    first[0] = True
    assert run([operations(r, 2, 2, 2) for r in range(2)], 2, rank_1_then_rank_0_first) is None
