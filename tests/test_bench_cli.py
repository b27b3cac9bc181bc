"""`tplab bench` under mpiexec: nccl-tests-like table on rank 0, CSV point by point, resumes."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from tplab.cli import parse_size

BIN = Path(sys.executable).parent


def bench(*args, ranks=2, timeout=120):
    mpiexec = BIN / "mpiexec"
    if not mpiexec.exists():
        pytest.skip("no mpiexec next to this Python")
    proc = subprocess.run([str(mpiexec), "-n", str(ranks), sys.executable, "-m", "tplab", "bench", *args],
                          capture_output=True, text=True, timeout=timeout)
    return proc


def read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_parse_size():
    assert parse_size("8") == 8 and parse_size("64K") == 65536 and parse_size("64M") == 64 << 20
    assert parse_size("1G") == 1 << 30 and parse_size("2KB") == 2048


def test_table_csv_and_resume(tmp_path):
    path = tmp_path / "runs.csv"
    args = ["allreduce", "-a", "ring,recursive_doubling,builtin", "-b", "8", "-e", "2K", "-f", "16", "-n", "3",
            "--csv", str(path), "--machine", "test machine"]
    first = bench(*args)
    assert first.returncode == 0, first.stderr
    header = [line for line in first.stdout.splitlines() if line.startswith("#")]
    assert all(c in header[1] for c in ["size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong"]), header
    rows = read(path)
    assert len(rows) == 3 * 3  # sizes 8, 128, 2048 x three algorithms, written once (by rank 0)
    assert {r["wrong"] for r in rows} == {"0"} and {r["ranks"] for r in rows} == {"2"}
    assert {r["machine"] for r in rows} == {"test machine"}

    # an interrupted sweep: drop the last rows, run again: only the missing points are measured
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows[:4])
    second = bench(*args)
    assert second.returncode == 0, second.stderr
    resumed = read(path)
    assert len(resumed) == 9 and resumed[:4] == rows[:4]
    assert sorted((r["algorithm"], r["size"]) for r in resumed) == sorted((r["algorithm"], r["size"]) for r in rows)


def test_osu_mode_and_other_collectives(tmp_path):
    proc = bench("allgather", "-b", "64", "-e", "64", "--osu", "-n", "50", ranks=3)  # (-n: fewer than OSU's 1000)
    assert proc.returncode == 0, proc.stderr
    assert "Avg Latency(us)" in proc.stdout and "recursive_doubling" in proc.stdout
    for collective in ["reduce_scatter", "broadcast", "reduce"]:
        proc = bench(collective, "-b", "1K", "-e", "1K", "-n", "2", ranks=3)
        assert proc.returncode == 0, proc.stderr


def test_unknown_algorithm_is_a_clear_error():
    proc = bench("allreduce", "-a", "bogus", "-e", "8")
    assert proc.returncode == 2 and "unknown allreduce algorithms ['bogus']" in proc.stderr


def test_peer_memory_rows_need_gpus_and_peer_memory():
    for name in ("peer_two_shot", "peer_registered"):  # (peer_registered: tplab on an input in the shared buffer)
        proc = bench("allreduce", "-a", name, "-e", "8")
        assert proc.returncode == 2 and "peer_* need --device gpu --peer-memory SIZE" in proc.stderr


def test_graph_mode_and_anchors_are_gpu_only_with_a_clear_error():
    proc = bench("allreduce", "-a", "ring", "-e", "8", "--graph")
    assert proc.returncode == 2 and "--graph times what a CUDA graph can hold, on GPUs" in proc.stderr
    proc = bench("allreduce", "-a", "symm_mem_one_shot", "-e", "8")  # anchors exist for GPU all-reduce only
    assert proc.returncode == 2 and "unknown allreduce algorithms ['symm_mem_one_shot']" in proc.stderr


def test_anchors_that_cannot_share_a_process_say_why():
    from tplab.lab.anchors import unavailable

    assert "separate runs" in unavailable(["nccl_symmetric", "symm_mem_two_shot"])
    assert unavailable(["nccl"]) in (None, "the anchors run on CUDA GPUs")


def test_a_nan_where_the_builtin_has_a_number_counts_as_wrong():
    """The float comparison counts what is *not* within the rounding bound: a NaN is never within it (a kernel
    that gave up on a peer writes NaN sums, which "difference > bound" would have let through)."""
    from types import SimpleNamespace

    import numpy as np

    from tplab.lab.bench import _wrong

    one_rank = SimpleNamespace(size=2, allgather_object=lambda value: [value])
    want = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    got = want.copy()
    got[[1, 3]] = np.nan
    assert _wrong("allreduce", got, want, want, one_rank, "sum") == 2
    assert _wrong("allreduce", want.copy(), want, want, one_rank, "sum") == 0


def test_a_peer_memory_failure_is_reported_on_every_rank():
    """tplab bench asks the peer memory after each GPU point: a failure any rank saw (a timed-out call stops
    the kernels without writing, silently) becomes one message that every rank has, so every rank raises."""
    from types import SimpleNamespace

    from tplab.lab.bench import peer_memory_failure

    class Peers:
        def __init__(self, problem):
            self.problem = problem

        def raise_pending(self):
            if self.problem:
                raise TimeoutError(self.problem)

    def comm(rank, problem, others):
        return SimpleNamespace(rank=rank, peers=Peers(problem),
                               allgather_object=lambda mine: [mine, *others] if rank == 0 else [*others, mine])

    assert peer_memory_failure(comm(0, "", [""])) == ""
    assert peer_memory_failure(comm(1, "", ["rank 0: TimeoutError: rank 1 never came"])) \
        == "rank 0: TimeoutError: rank 1 never came"
    assert peer_memory_failure(comm(0, "rank 1 never came", [""])) == "rank 0: TimeoutError: rank 1 never came"
    assert peer_memory_failure(SimpleNamespace(rank=0)) == ""   # (no peer memory: nothing to ask, no all-gather)
