"""The bytes and messages the algorithms really send equal the formulas in tplab.cost.traffic."""

import numpy as np
import pytest
from mpitest import COMM, agree

import tplab
from tplab.comm import MPIComm
from tplab.cost import allreduce_traffic, traffic
from tplab.cost.traffic import KNOWN

P = COMM.size
# 8*P elements: divisible by p and by the power of two below p (1, 2, 4 or 8): whole blocks everywhere
COUNT = 8 * P


def run_once(collective, algorithm, comm):
    """Run the collective once; return n as nccl-tests counts it (see tplab.cost)."""
    if collective == "allgather":  # each rank contributes COUNT elements; n is the gathered total
        tplab.allgather(np.ones(COUNT), comm, algorithm=algorithm)
        return COUNT * 8 * P
    x = np.ones(COUNT)
    getattr(tplab, collective)(x, comm, algorithm=algorithm)  # broadcast and reduce: root 0
    return x.nbytes


def counted(comm):
    everyone = COMM.allgather((comm.messages_sent, comm.bytes_sent))
    return {
        "max_messages": max(m for m, _ in everyone),
        "max_bytes": float(max(b for _, b in everyone)),
        "total_messages": sum(m for m, _ in everyone),
        "total_bytes": float(sum(b for _, b in everyone)),
    }


@pytest.mark.parametrize("collective,algorithm", KNOWN, ids=[f"{c}-{a}" for c, a in KNOWN])
def test_counted_traffic_equals_formula(collective, algorithm):
    c = MPIComm(COMM.Dup())
    n = run_once(collective, algorithm, c)
    measured, expected = counted(c), traffic(collective, algorithm, P, n)
    c.mpi.Free()
    agree(measured == expected, f"{collective} {algorithm} p={P}: counted {measured}, formula {expected}")


@pytest.mark.parametrize("ranks_per_node", [1, 2, 3, 4])
def test_counted_hierarchical_traffic_equals_formula(ranks_per_node):
    c = MPIComm(COMM.Dup(), ranks_per_node=ranks_per_node)
    nodes = -(-P // ranks_per_node)
    x = np.ones(8 * P * nodes)  # whole blocks inside nodes, across nodes and among leaders (uneven nodes)
    tplab.allreduce(x, c, algorithm="hierarchical")
    measured = counted(c)
    expected = traffic("allreduce", "hierarchical", P, x.nbytes, ranks_per_node=ranks_per_node)
    agree(measured == expected, f"hierarchical p={P} q={ranks_per_node}: counted {measured}, formula {expected}")


def test_allreduce_traffic_is_traffic_of_allreduce():
    for algorithm in ("naive", "ring", "recursive_doubling", "rabenseifner", "tree"):
        assert allreduce_traffic(algorithm, P, 64 * P) == traffic("allreduce", algorithm, P, 64 * P)
