"""The shard exchanges' agreement (tplab.comm.shard_agreement): the digest fast path says yes exactly when
every rank makes the same call with the same shard and no rank has a problem; otherwise every rank takes
the full agreement, which raises the same error everywhere."""

import pytest
from mpitest import COMM, agree

from tplab.collectives import CollectiveArgumentError
from tplab.comm.shard_agreement import agree_on_shards, digests_agree

P, R = COMM.size, COMM.rank


def full_agreement(what, call, shape, dtype, problem=""):
    if not digests_agree(COMM, what, call, shape, dtype, problem):
        agree_on_shards(COMM.allgather, what, call, shape, dtype, problem)
        return "full"
    return "fast"


def test_the_same_call_everywhere_takes_the_fast_path():
    agree(full_agreement("start_gather", 3, (4, 5), "torch.float64") == "fast", "same call: fast path")


@pytest.mark.parametrize("rank_off", [0, P - 1])
@pytest.mark.parametrize("what, call, shape, dtype, problem, message", [
    ("start_scatter", 3, (4, 5), "torch.float64", "", "different calls"),
    ("start_gather", 4, (4, 5), "torch.float64", "", "different calls"),
    ("start_gather", 3, (4, 6), "torch.float64", "", "shards differ"),
    ("start_gather", 3, (4, 5), "torch.float32", "", "shards differ"),
    ("start_gather", 3, (4, 5), "torch.float64", "a bad tensor", "a bad tensor"),
])
def test_any_difference_is_the_same_error_on_every_rank(rank_off, what, call, shape, dtype, problem, message):
    if P == 1 and not problem:
        pytest.skip("one rank cannot differ from itself")
    args = (what, call, shape, dtype, problem) if R == rank_off else ("start_gather", 3, (4, 5), "torch.float64", "")
    with pytest.raises(CollectiveArgumentError, match=message):
        full_agreement(*args)
