"""The bytes and messages the algorithms really send equal the formulas in tplab.cost."""

import numpy as np
import pytest
from mpitest import COMM, agree

import tplab
from tplab.comm import MPIComm
from tplab.cost import allreduce_traffic

P = COMM.size


@pytest.mark.parametrize("algorithm", ["naive", "ring", "recursive_doubling", "rabenseifner", "tree"])
def test_counted_traffic_equals_formula(algorithm):
    c = MPIComm(COMM.Dup())
    count = 8 * P  # divisible by p and by the power of two below p: whole blocks everywhere
    n = count * 8
    tplab.allreduce(np.ones(count), c, algorithm=algorithm)
    counted = COMM.allgather((c.messages_sent, c.bytes_sent))
    measured = {
        "max_messages": max(m for m, _ in counted),
        "max_bytes": float(max(b for _, b in counted)),
        "total_messages": sum(m for m, _ in counted),
        "total_bytes": float(sum(b for _, b in counted)),
    }
    expected = allreduce_traffic(algorithm, P, n)
    agree(measured == expected, f"{algorithm} p={P}: counted {measured}, formula {expected}")
