"""tplab.toolkit.timing: the two statistics over ranks, with a stand-in communicator of three ranks."""

from tplab.toolkit.timing import median_of_slowest, slowest_median, time_calls, time_forward


class ThreeRanks:
    """allgather_object as rank 0 of three would see it; the other ranks' values are fixed."""

    def __init__(self, others):
        self.others, self.barriers = others, 0

    def barrier(self):
        self.barriers += 1

    def allgather_object(self, mine):
        return [mine, *self.others]


def test_slowest_median_is_the_largest_of_the_ranks_medians():
    comm = ThreeRanks([2.0, 5.0])  # the other ranks' medians
    assert slowest_median([1.0, 9.0, 3.0], comm) == 5.0


def test_median_of_slowest_takes_each_calls_slowest_rank_first():
    comm = ThreeRanks([[1.0, 1.0, 8.0], [1.0, 7.0, 1.0]])  # the other ranks' times, call by call
    assert median_of_slowest([6.0, 1.0, 1.0], comm) == (7.0, 6.0)  # calls last 6, 7, 8


def test_time_calls_warms_up_untimed_and_lines_up_every_timed_call():
    calls, comm = [], ThreeRanks([0.0, 0.0])
    times = time_calls(lambda: calls.append(1), iters=4, warmup=2, barrier=comm.barrier)
    assert len(calls) == 6 and len(times) == 4 and comm.barriers == 4 and min(times) >= 0
    assert time_forward(lambda: None, ThreeRanks([1.0, 2.0]), iters=3, warmup=1) == 2.0  # rank 2 is slowest
