"""All-to-all by Bruck and all-to-all-v by pairwise exchange equal MPI's own, bitwise, on every rank; the bytes
and messages they send equal tplab.cost.alltoall's formulas; bad input is the same error on every rank."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpitest import COMM, abort_on_exception, agree, rearm_watchdog

from tplab.collectives import CollectiveArgumentError, alltoall, alltoallv
from tplab.comm import world
from tplab.cost import alltoall_traffic

torch = pytest.importorskip("torch")

P, RANK = COMM.size, COMM.rank
C = world(timeout=10)


@pytest.mark.parametrize("algorithm", ["pairwise", "bruck"])
@settings(max_examples=4)
@given(block=st.sampled_from([0, 1, 3, 33]), dtype=st.sampled_from(["float64", "int32", "float16"]),
       kind=st.sampled_from(["numpy", "torch"]))
@abort_on_exception
def test_alltoall_equals_mpi_alltoall_and_the_formula(algorithm, block, dtype, kind):
    rearm_watchdog()
    x = (np.arange(P * block * 2) + 1000 * RANK).astype(dtype).reshape(P, block, 2)  # x[j] for rank j
    want = np.empty_like(x)
    COMM.Alltoall(x, want)
    C.reset_counters()
    got = alltoall(torch.from_numpy(x) if kind == "torch" else x, C, algorithm=algorithm)
    got = got.numpy() if kind == "torch" else got
    agree(np.array_equal(got, want) and got.dtype == want.dtype, f"{algorithm}: got {got.ravel()[:8]}")
    expected = alltoall_traffic(algorithm, P, x.nbytes)
    agree(C.bytes_sent == expected["max_bytes"] and C.messages_sent == expected["max_messages"],
          f"{algorithm} sent {C.bytes_sent} B in {C.messages_sent} messages; formula {expected}")


def counts_matrix(seed, largest):
    """counts[i][j]: rows rank i sends to rank j, the same matrix on every rank (zeros included)."""
    rng = np.random.default_rng(seed)
    m = rng.integers(0, largest + 1, size=(P, P))
    m[rng.random((P, P)) < 0.3] = 0  # many empty pairs: nothing is sent for them
    return m


@settings(max_examples=6)
@given(seed=st.integers(0, 10**6), largest=st.sampled_from([0, 1, 5, 300]),
       dtype=st.sampled_from(["float64", "int64", "float32"]), kind=st.sampled_from(["numpy", "torch"]),
       give_recv=st.booleans())
@abort_on_exception
def test_alltoallv_equals_mpi_alltoallv(seed, largest, dtype, kind, give_recv):
    rearm_watchdog()
    m = counts_matrix(seed, largest)
    sends, recvs = m[RANK], m[:, RANK]
    width = 3
    x = (np.arange(sends.sum() * width) + 10**6 * RANK).astype(dtype).reshape(-1, width)
    want = np.empty((recvs.sum(), width), dtype)
    COMM.Alltoallv([x, sends * width], [want, recvs * width])
    C.reset_counters()
    got = alltoallv(torch.from_numpy(x) if kind == "torch" else x, sends, C,
                    recv_counts=recvs if give_recv else None)
    got = got.numpy() if kind == "torch" else got
    agree(np.array_equal(got, want), f"got {got.ravel()[:8]}, MPI_Alltoallv {want.ravel()[:8]}")
    others = [j for j in range(P) if j != RANK]
    agree(C.bytes_sent == sum(int(sends[j]) for j in others) * width * x.itemsize
          and C.messages_sent == sum(1 for j in others if sends[j]), f"sent {C.bytes_sent} B, {C.messages_sent} msgs")


def test_alltoallv_bad_input_is_the_same_error_on_every_rank():
    ones = np.ones((P, 2))
    with pytest.raises(CollectiveArgumentError, match="recv_counts|expects"):
        recvs = [1] * P
        if RANK == 0 and P > 1:
            recvs[-1] = 2  # rank P-1 sends 1 row to rank 0, which expects 2
        alltoallv(ones, [1] * P, C, recv_counts=recvs if P > 1 else [2])
    with pytest.raises(CollectiveArgumentError, match="add up to"):
        alltoallv(np.ones((P + 1, 2)) if RANK == 0 else ones, [1] * P, C)
    with pytest.raises(CollectiveArgumentError, match="trailing shape"):
        if P == 1:
            raise CollectiveArgumentError("trailing shape: nothing to disagree with on one rank")
        alltoallv(np.ones((P, 3)) if RANK == 0 else ones, [1] * P, C)
    with pytest.raises(CollectiveArgumentError, match="non-negative"):
        alltoallv(ones, [-1] + [1] * P if RANK == 0 else [1] * P, C)
    with pytest.raises(CollectiveArgumentError, match="algorithm"):
        alltoall(np.ones((P, 2)), C, algorithm="bruck" if RANK == 0 else "pairwise") if P > 1 else \
            alltoall(np.ones((P, 2)), C, algorithm="spiral")
    agree(True)
