"""tplab.cluster on real MPI engines: results in rank order, and clear errors for the ways ranks fail.

One 3-engine cluster is shared by the tests of this module (starting one takes seconds on 2 cores); the
fault tests restart it. Every cluster lives in a temporary profile directory, never in ~/.ipython.
"""

import os
import subprocess
import sys
import time

import psutil
import pytest

from tplab.cluster import (
    Cluster,
    ClusterError,
    ClusterTimeout,
    EngineDied,
    RankError,
    connect_or_start,
    engine_rank,
    stop_cluster,
)
from tplab.cluster.failures import describe_error
from tplab.cluster.processes import cluster_processes, find_mpiexec

pytestmark = pytest.mark.slow

VENV_BIN = os.path.dirname(sys.executable)
N = 3
# ipyparallel ships a function's code, but the engine imports the function's module for its globals:
# the engines must be able to import this test module (a notebook's functions live in __main__: no need).
ENGINE_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(__file__),
                                                       os.environ.get("PYTHONPATH")]))}


def processes_of(profile_dir) -> list:
    """Every live process started for any cluster in this profile directory (by its environment)."""
    found = []
    for proc in psutil.process_iter():
        try:
            env, alive = proc.environ(), proc.status() != psutil.STATUS_ZOMBIE
            if env.get("IPP_PROFILE_DIR") == str(profile_dir) and alive:
                found.append(proc)
        except (psutil.Error, OSError):
            pass
    return found


@pytest.fixture(scope="module")
def profile_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ipython-profile"))


@pytest.fixture(scope="module")
def cluster(profile_dir):
    # Started with the venv's bin/ NOT on PATH, as from a Jupyter kernel of a venv that was never activated.
    with pytest.MonkeyPatch.context() as mp:
        path = [p for p in os.environ["PATH"].split(os.pathsep) if p and os.path.abspath(p) != VENV_BIN]
        mp.setenv("PATH", os.pathsep.join(path))
        started = Cluster.start(N, cluster_id="test-cluster", profile_dir=profile_dir, timeout=60,
                                env=ENGINE_ENV)
    with started:  # __exit__ stops it
        yield started
    assert processes_of(profile_dir) == []


def test_mpiexec_is_found_next_to_python():
    beside_python = os.path.join(VENV_BIN, "mpiexec")
    if not os.path.exists(beside_python):
        pytest.skip("no mpiexec next to this Python (a system MPI, found on PATH)")
    assert find_mpiexec() == beside_python


def test_start_gives_one_mpi_world_in_rank_order(cluster):
    assert cluster.owns and cluster.n == N
    assert sorted(cluster.ranks.values()) == list(range(N))
    infos = cluster.run(engine_rank)
    assert [i["rank"] for i in infos] == list(range(N))
    assert {i["size"] for i in infos} == {N}
    assert len({i["pid"] for i in infos}) == N
    assert infos[0]["mpi_library"]

    def rank_and_threads():
        import os

        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank(), os.environ.get("OMP_NUM_THREADS")

    # the view's targets are in MPI rank order too (for %px), and each engine runs one thread
    assert cluster.view.apply_sync(rank_and_threads) == [(r, "1") for r in range(N)]


def test_run_passes_arguments_and_runs_tplab_collectives(cluster):
    def ring_allreduce(length, *, scale):
        import numpy as np

        import tplab

        comm = tplab.comm.world()
        x = np.full(length, scale * (comm.rank + 1), dtype=np.float64)
        return tplab.allreduce(x, comm, algorithm="ring").tolist()

    expected = [2.0 * N * (N + 1) / 2] * 5
    assert cluster.run(ring_allreduce, 5, scale=2.0) == [expected] * N


def test_run_df_makes_one_row_per_rank(cluster):
    df = cluster.run_df(engine_rank)  # columns in the order of the function's dict, not sorted
    assert list(df.columns) == ["rank", "size", "host", "pid", "mpi_library"]
    assert list(df["rank"]) == list(range(N))

    def two_rows():
        from mpi4py import MPI

        return [{"step": s, "value": 10 * MPI.COMM_WORLD.Get_rank() + s} for s in range(2)]

    df = cluster.run_df(two_rows)
    assert list(df.columns) == ["rank", "step", "value"]
    assert list(df["rank"]) == [0, 0, 1, 1, 2, 2] and list(df["value"]) == [0, 1, 10, 11, 20, 21]
    df = cluster.run_df(lambda: 7)
    assert list(df.columns) == ["rank", "result"] and list(df["result"]) == [7] * N


def test_gpu_questions_on_engines_without_gpus(cluster):
    from tplab.comm.devices import gpu_count

    if any(cluster.run(gpu_count)):
        pytest.skip("these engines see a GPU")
    assert cluster.has_gpus() is False and cluster.resolve_device("auto") == "cpu"
    with pytest.raises(ClusterError, match="rank 0 sees no GPU"):
        cluster.resolve_device("gpu")
    bound = cluster.bind_gpus()  # no error: every rank says it has no device
    assert list(bound["rank"]) == list(range(N)) and bound["device"].isna().all()
    assert list(bound.columns) == ["rank", "local_rank", "device", "name", "memory_gib", "host"]
    assert sorted(bound["local_rank"]) == list(range(N))  # one node: local rank = rank


def test_a_rank_that_hangs_times_out(cluster):
    def rank_2_is_slow():
        import time

        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() == 2:
            time.sleep(4)
        return "done"

    started = time.monotonic()
    with pytest.raises(ClusterTimeout) as info:
        cluster.run(rank_2_is_slow, timeout=1.5)
    assert time.monotonic() - started < 4
    assert info.value.unfinished == [2] and info.value.finished == [0, 1]
    assert "rank 2 did not finish" in str(info.value) and "cluster.restart()" in str(info.value)
    # only slow, not stuck: the next call waits behind it and succeeds
    assert cluster.run(lambda: "ok", timeout=30) == ["ok"] * N


def test_a_rank_that_raises_while_the_others_wait_in_a_barrier(cluster):
    def rank_1_fails():
        import tplab

        comm = tplab.comm.world()
        if comm.rank == 1:
            raise ValueError("rank 1 has bad data")
        comm.mpi.Barrier()  # ranks 0 and 2 wait here for ever

    started = time.monotonic()
    with pytest.raises(RankError) as info:
        cluster.run(rank_1_fails, timeout=60)
    assert time.monotonic() - started < 15  # reported long before the timeout
    message = str(info.value)
    assert "rank 1" in message and "ValueError: rank 1 has bad data" in message
    assert 'raise ValueError("rank 1 has bad data")' in message  # a line of the traceback
    assert "Ranks 0, 2 had not finished" in message and "cluster.restart()" in message
    assert list(info.value.failures) == [1] and info.value.unfinished == [0, 2]

    # a second session connecting now (a notebook after a kernel restart) is told the engines are stuck
    with pytest.raises(ClusterTimeout, match="stuck in a call"):
        Cluster.connect(cluster.cluster_id, profile_dir=cluster.profile_dir, timeout=3)

    same = cluster.restart()
    assert same is cluster and cluster.n == N
    assert [i["rank"] for i in cluster.run(engine_rank)] == list(range(N))


def test_an_engine_process_that_dies(cluster):
    def rank_1_dies():
        import os

        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank() == 1:
            os.kill(os.getpid(), 9)
        MPI.COMM_WORLD.Barrier()

    old_pids = {i["pid"] for i in cluster.run(engine_rank)}
    started = time.monotonic()
    with pytest.raises(EngineDied) as info:
        cluster.run(rank_1_dies, timeout=60)
    assert time.monotonic() - started < 15
    assert 1 in info.value.ranks and "died" in str(info.value) and "cluster.restart()" in str(info.value)

    cluster.restart()
    infos = cluster.run(engine_rank)
    assert [i["rank"] for i in infos] == list(range(N)) and not old_pids & {i["pid"] for i in infos}


def test_error_descriptions_drop_terminal_colours():
    class FakeRemoteError(Exception):
        ename, evalue = "KeyError", "'w'"
        traceback = "\x1b[31mKeyError\x1b[39m: 'w'\n  File \x1b[32mx.py\x1b[0m:3"

    assert describe_error(FakeRemoteError()) == "KeyError: 'w'\n    KeyError: 'w'\n      File x.py:3"


def test_stop_leaves_no_process_behind(cluster, profile_dir):
    pids = [i["pid"] for i in cluster.run(engine_rank)]
    tree = cluster_processes(cluster.profile_dir, cluster.cluster_id)
    names = " ".join(" ".join(p.cmdline()) for p in tree)
    assert "ipyparallel.controller" in names and "mpiexec" in names and "ipyparallel.engine" in names
    assert {p.pid for p in processes_of(profile_dir)} == {p.pid for p in tree}
    cluster.stop()
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert processes_of(profile_dir) == []
    cluster.stop()  # a second stop is harmless
    with pytest.raises(ClusterError, match="stopped"):
        cluster.run(engine_rank)


@pytest.fixture
def cli_cluster(tmp_path):
    """A cluster started by hand with the ipcluster command, in a temporary profile directory."""
    profile_dir, cluster_id = str(tmp_path / "profile"), "cli-test"
    ipcluster = [os.path.join(VENV_BIN, "ipcluster")]
    where = [f"--cluster-id={cluster_id}", f"--profile-dir={profile_dir}"]
    env = dict(os.environ, PATH=VENV_BIN + os.pathsep + os.environ["PATH"], **ENGINE_ENV)  # an activated venv
    subprocess.run(ipcluster + ["start", "-n", "2", "--engines=MPI", "--daemonize"] + where,
                   env=env, check=True, capture_output=True, timeout=60)
    yield profile_dir, cluster_id
    if processes_of(profile_dir):  # the test failed half-way: clean up
        subprocess.run(ipcluster + ["stop"] + where, env=env, capture_output=True, timeout=60)
        for proc in processes_of(profile_dir):
            proc.kill()


def test_connect_to_a_cluster_started_with_ipcluster(cli_cluster):
    profile_dir, cluster_id = cli_cluster
    cluster = Cluster.connect(cluster_id, profile_dir=profile_dir, n=2, timeout=60)
    assert not cluster.owns and cluster.n == 2
    assert [i["rank"] for i in cluster.run(engine_rank)] == [0, 1]

    again = connect_or_start(n=2, cluster_id=cluster_id, profile_dir=profile_dir)
    assert not again.owns and again.n == 2
    again.stop()  # not ours: only disconnects
    with pytest.raises(ClusterError, match="fewer than the 3"):
        connect_or_start(n=3, cluster_id=cluster_id, profile_dir=profile_dir)
    assert cluster.run(lambda: "still up") == ["still up"] * 2

    cluster.stop(force=True)
    assert processes_of(profile_dir) == []
    assert stop_cluster(cluster_id, profile_dir=profile_dir) is False  # nothing left to stop


def test_connect_to_nothing_fails_fast(tmp_path):
    started = time.monotonic()
    with pytest.raises(ClusterError, match="no cluster 'nothing-here'"):
        Cluster.connect("nothing-here", profile_dir=str(tmp_path))
    assert time.monotonic() - started < 5
