"""The one Communicator contract (tplab/comm/base.py), held by every transport that runs on CPU ranks:
MPI, an emulated network, torch.distributed (gloo) and the null communicator. The same tplab calls give the
same answers whatever the wire; a transport of whole collectives runs its own for any algorithm name;
what a transport cannot do is refused alike on every rank, and "auto" falls back."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from mpitest import COMM, agree  # noqa: E402

import tplab  # noqa: E402
from tplab.comm import EmulatedNetwork, world  # noqa: E402
from tplab.comm.base import Communicator, Unsupported  # noqa: E402
from tplab.comm.null import NullComm  # noqa: E402
from tplab.comm.torch_dist import TorchDistributedComm  # noqa: E402

P, RANK = COMM.size, COMM.rank
WIRES = {"mpi": lambda: world(), "emulated network": lambda: EmulatedNetwork(world(), ranks_per_node=max(1, P // 2)),
         "torch.distributed (gloo)": lambda: gloo()}
_gloo = []


def gloo():
    """torch.distributed on gloo, made at the first test that needs it (not at collection) and ended after
    this module (its threads and sockets would otherwise stay for the rest of the MPI suite)."""
    if not _gloo:
        _gloo.append(TorchDistributedComm(torch.device("cpu")))
    return _gloo[0]


@pytest.fixture(scope="module", autouse=True)
def end_gloo():
    yield
    if _gloo:
        _gloo.pop().close()


def mine(n=10, dtype=torch.float64):
    return (torch.arange(n, dtype=dtype) + RANK * 100)


def total(n=10, dtype=torch.float64):
    return sum(torch.arange(n, dtype=dtype) + r * 100 for r in range(P))


def test_every_transport_is_a_communicator():
    agree(all(isinstance(make(), Communicator) for make in WIRES.values()) and isinstance(NullComm(), Communicator))


@pytest.mark.parametrize("wire", list(WIRES))
@pytest.mark.parametrize("algorithm", ["auto", "ring"])
def test_the_same_calls_give_the_same_answers_on_every_wire(wire, algorithm):
    comm = WIRES[wire]()
    n = 4 * P
    got = [tplab.allreduce(mine(n), comm, algorithm=algorithm),
           tplab.reduce_scatter(mine(n), comm, algorithm=algorithm),
           tplab.allgather(mine(n), comm, algorithm=algorithm)]
    want = [total(n), total(n).chunk(P)[RANK], torch.cat([torch.arange(n, dtype=torch.float64) + r * 100
                                                          for r in range(P)])]
    agree(all(torch.equal(g, w) for g, w in zip(got, want)), f"{wire} {algorithm}")


def test_a_transport_of_whole_collectives_runs_its_own_for_any_name():
    GLOO = gloo()
    agree(not GLOO.point_to_point and GLOO.prefers_builtin)
    for algorithm in ("naive", "recursive_doubling", "builtin"):  # no send/recv on it: its own all-reduce
        agree(torch.equal(tplab.allreduce(mine(), GLOO, algorithm=algorithm), total()), algorithm)
    with pytest.raises(Unsupported, match="no point-to-point"):
        GLOO.send(np.zeros(1), 0)


def test_numpy_arrays_through_torch_distributed_agree_first():
    """The general path (numpy in) agrees on the host first: ranks that disagree raise, none hangs."""
    GLOO = gloo()
    x = np.ones(5 + (RANK == 0 and P > 1), dtype=np.float32)
    if P > 1:
        with pytest.raises(tplab.CollectiveArgumentError, match="disagree"):
            tplab.allreduce(x, GLOO)
    agree(np.array_equal(tplab.allreduce(np.ones(5, np.float32), GLOO), np.full(5, P, np.float32)))


def test_what_a_transport_lacks_is_refused_alike_and_auto_falls_back():
    """torch.distributed scatters equal blocks only: an uneven reduce-scatter is refused on every rank
    (explicit "builtin"); MPI's auto takes its own or a hand-written algorithm either way."""
    GLOO = gloo()
    x = mine(P + 1)
    if P > 1:  # (one rank: one block, always equal)
        with pytest.raises(tplab.CollectiveArgumentError, match="equal blocks"):
            tplab.reduce_scatter(x.numpy(), GLOO, algorithm="builtin")
    agree(torch.equal(tplab.reduce_scatter(x, world()), total(P + 1).tensor_split(P)[RANK]))


def test_the_null_communicator_moves_nothing_and_logs_what_it_would_send():
    null = NullComm(RANK, P)
    x = mine(2 * P)
    same = tplab.allreduce(x, null, algorithm="ring")
    parts = tplab.allgather(x, null)
    block = tplab.reduce_scatter(x, null)
    agree(same is x and parts.numel() == P * x.numel() and torch.equal(block, x.chunk(P)[RANK]))
    agree([name for name, *_ in null.log] == ["allreduce", "allgather", "reduce_scatter"], str(null.log))


@pytest.mark.parametrize("wire", list(WIRES))
def test_with_timeout_gives_a_working_duplicate(wire):
    twin = WIRES[wire]().with_timeout(30.0)
    agree(torch.equal(tplab.allreduce(mine(), twin, algorithm="auto"), total()), wire)
