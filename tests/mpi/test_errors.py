"""Bad input gets the same clear error on every rank: never a hang, never a silently wrong array."""

import numpy as np
import pytest
from mpitest import COMM, agree

import tplab
from tplab import CollectiveArgumentError
from tplab.comm import world

P = COMM.size
C = world(timeout=10)
multi_rank = pytest.mark.skipif(P < 2, reason="needs ranks that can disagree")


def raises_everywhere(fn, *expected_fragments):
    """Call fn on every rank; every rank must raise CollectiveArgumentError mentioning the fragments."""
    try:
        fn()
        verdict, msg = False, "no error raised"
    except CollectiveArgumentError as e:
        msg = str(e)
        missing = [f for f in expected_fragments if f not in msg]
        verdict = not missing
        msg = msg if verdict else f"message {msg!r} lacks {missing}"
    agree(verdict, msg)
    return msg


@multi_rank
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "broadcast", "reduce"])
def test_mismatched_sizes(collective):
    x = np.ones(10 + (COMM.rank == P - 1), dtype=np.float32)
    msg = raises_everywhere(lambda: getattr(tplab, collective)(x, C), "disagree on shape", f"rank {P - 1} (11,)")
    agree("rank 0 (10,)" in msg, msg)


@multi_rank
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"])
def test_mismatched_dtypes(collective):
    x = np.ones(8, dtype=np.float64 if COMM.rank == 1 else np.float32)
    raises_everywhere(lambda: getattr(tplab, collective)(x, C), "disagree on dtype", "rank 1 float64")


@multi_rank
def test_mismatched_shapes_same_size():
    x = np.ones((2, 6) if COMM.rank == 0 else (3, 4))
    raises_everywhere(lambda: tplab.allreduce(x, C), "disagree on shape")


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"])
def test_unknown_algorithm_on_one_rank(collective):
    algorithm = "bogus" if COMM.rank == P - 1 else "auto"
    raises_everywhere(lambda: getattr(tplab, collective)(np.ones(4), C, algorithm=algorithm),
                      f"rank {P - 1}: unknown algorithm 'bogus'")


def test_unknown_op():
    raises_everywhere(lambda: tplab.allreduce(np.ones(4), C, op="average"), "unknown op 'average'")


@pytest.mark.parametrize("root", [-1, P, 1.5, True])
def test_root_out_of_range(root):
    raises_everywhere(lambda: tplab.broadcast(np.ones(4), C, root=root), "is not a rank")
    raises_everywhere(lambda: tplab.reduce(np.ones(4), C, root=root), "is not a rank")


@multi_rank
def test_mismatched_root():
    raises_everywhere(lambda: tplab.broadcast(np.ones(4), C, root=COMM.rank % 2), "disagree on root")


def test_unsupported_dtype():
    raises_everywhere(lambda: tplab.allreduce(np.ones(4, dtype=complex), C), "not supported")
    raises_everywhere(lambda: tplab.allreduce(np.array(["a", "b"]), C), "not supported")


def test_unchecked_call_still_rejects_local_problems():
    """check=False skips the agreement round, but an unknown algorithm is still an error."""
    with pytest.raises(CollectiveArgumentError, match="unknown algorithm"):
        tplab.allreduce(np.ones(4), C, algorithm="bogus", check=False)


def test_allgather_accepts_different_lengths():
    """Not an error: allgather is an allgatherv."""
    out = tplab.allgather(np.full(COMM.rank, COMM.rank), C)
    agree(out.tolist() == [r for r in range(P) for _ in range(r)], f"{out}")


@multi_rank  # with one rank auto never consults a table
def test_tuning_table_naming_an_unknown_algorithm():
    from tplab.collectives import tuning

    tuning.use_table({"collectives": {"allreduce": {"4": [[None, "bogus"]]}}})
    try:
        raises_everywhere(lambda: tplab.allreduce(np.ones(4), C), "tuning table in use chose 'bogus'")
    finally:
        tuning.use_table(None)


def test_a_rank_that_cannot_allocate_peer_memory_fails_every_rank():
    """PeerMemory's allocations: a rank out of GPU memory must not raise alone (its peers would wait in the
    exchange of handles): every rank raises, naming it, and frees what it got. Fake allocators: no GPU here."""
    from tplab.gpu_collectives.peer_memory import allocate_everywhere

    freed = []

    def malloc(n):
        if COMM.rank == P - 1 and n == 64:
            raise RuntimeError("out of memory")
        return 1000 + n   # (a pointer)

    agree(allocate_everywhere(COMM, [32, 16], malloc, freed.append, "a test area") == [1032, 1016] and not freed,
          "allocations that all succeed are kept")
    try:
        allocate_everywhere(COMM, [32, 64], malloc, freed.append, "a test area")
        verdict, message = False, "no error raised"
    except MemoryError as error:
        message = str(error)
        verdict = f"rank {P - 1} could not allocate its 96 bytes" in message and "out of memory" in message
    mine = [1032] if COMM.rank == P - 1 else [1032, 1064]
    agree(verdict and freed == mine, f"{message}; freed {freed}, not {mine}")
