"""The benchmark harness: identical rows on every rank, validation that catches wrong results."""

import numpy as np
import pytest
from mpitest import COMM, agree, same_on_every_rank

import tplab
import tplab.lab.bench as bench
from tplab.comm import world

P = COMM.size
C = world(timeout=10)


@pytest.mark.parametrize("collective", sorted(tplab.ALGORITHMS))
def test_every_algorithm_validates_and_rows_agree(collective):
    algorithms = [a for a in tplab.ALGORITHMS[collective] if a != "auto"]
    rows = bench.sweep(collective, algorithms, [8, 3000], iters=2, warmup=1, comm=C)
    agree(all(r["wrong"] == 0 for r in rows), str([(r["algorithm"], r["size"], r["wrong"]) for r in rows]))
    agree(same_on_every_rank(rows), "rows differ between ranks")
    factor = bench.BUS_FACTOR[collective](P)
    agree(all(abs(r["busbw"] - r["algbw"] * factor) < 1e-12 for r in rows), "busbw factor")
    if collective == "allgather":  # nccl-tests' size: the gathered total
        agree(all(r["size"] == r["count"] * 4 * P for r in rows), str(rows[0]))


def test_count_wrong_sees_a_broken_result(monkeypatch):
    real_call = bench._call

    def broken(collective, x, comm, algorithm, op, check=False):
        y = real_call(collective, x, comm, algorithm, op, check)
        if comm.rank == P - 1:
            y[:3] += 1  # three wrong elements on the last rank
        return y

    monkeypatch.setattr(bench, "_call", broken)
    wrong = bench.count_wrong("allreduce", "ring", np.ones(10, dtype=np.float32), C, "sum")
    agree(wrong == 3, f"counted {wrong}")


def test_osu_mode_averages():
    row = bench.time_collective("allreduce", "recursive_doubling", 64, comm=C, osu=True)
    agree(row["mode"] == "osu" and row["iters"] == 1000 and row["min_us"] <= row["time_us"] <= row["max_us"],
          str(row))
