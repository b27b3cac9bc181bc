"""What students do to a cluster: kill an engine between cells and during one, kill the kernel that owns a
cluster, lose a cluster another notebook shared. Each must end in a clear message, a working cluster after
rerunning the setup cell, no process left behind and no /dev/shm file left behind.

Small clusters (2 engines where a rank must die with another, else 1) in temporary profile and state
directories; every wait has a deadline (a hang fails within seconds); only processes these tests started
are killed. Last, `tplab doctor` against stand-in clusters.
"""

import ipaddress
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tplab.cli import main
from tplab.cluster import ClusterGone, EngineDied, connect_or_start, engine_rank, ledger, shm
from tplab.cluster.ownership import owner_env
from tplab.cluster.processes import cluster_processes

pytestmark = pytest.mark.slow

N = 2
ENGINE_ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))}


def wait_until(condition, seconds, what):
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {seconds} s")
        time.sleep(0.1)
    return time.monotonic()


def non_loopback_listeners(procs) -> list:
    """(pid, command, address) of every TCP listener or bound UDP socket not on 127.0.0.1 / ::1."""
    found = []
    for proc in procs:
        try:
            conns, command = proc.net_connections(kind="inet"), " ".join(proc.cmdline())[:60]
        except psutil.Error:
            continue
        for c in conns:
            listening = c.status == psutil.CONN_LISTEN or (c.type == 2 and not c.raddr)  # (2: SOCK_DGRAM)
            if listening and not ipaddress.ip_address(c.laddr.ip).is_loopback:
                found.append((proc.pid, command, f"{c.laddr.ip}:{c.laddr.port}"))
    return found


@pytest.fixture
def where(tmp_path, monkeypatch):
    monkeypatch.setenv("TPLAB_STATE_DIR", str(tmp_path / "state"))  # the ledger; the watchdogs inherit it
    return str(tmp_path / "profile")


def test_an_engine_killed_between_cells_and_during_one(where, capsys):
    cluster = connect_or_start(N, profile_dir=where, env=ENGINE_ENV)
    assert "started 2 ranks (this kernel owns them" in capsys.readouterr().out
    procs = cluster_processes(cluster.profile_dir, cluster.cluster_id)
    assert any("tplab.cluster.watchdog" in " ".join(p.cmdline()) for p in procs)
    assert non_loopback_listeners(procs) == []  # controller, launcher, engines, watchdog: loopback only
    try:
        files = shm.mapped_files(cluster.pids.values())
        assert files, "MPICH maps a shared-memory file in /dev/shm"

        # between cells: the engine dies, mpiexec ends the other rank; the next call says which, at once
        old_pids = set(cluster.pids.values())
        os.kill(cluster.pids[1], signal.SIGKILL)
        wait_until(lambda: cluster.lost_ranks(), 15, "the controller hears that the engines left")
        started = time.monotonic()
        with pytest.raises(EngineDied) as info:
            cluster.run(engine_rank)
        assert time.monotonic() - started < 2
        assert info.value.ranks[0] == 1 and "rank 1 of cluster" in str(info.value)
        assert "rerun the setup cell" in str(info.value)
        wait_until(lambda: not any(map(os.path.exists, files)), 10, "the dead job's /dev/shm files are removed")

        # rerunning the setup cell recovers, and says how
        again = connect_or_start(N, profile_dir=where, env=ENGINE_ENV)
        assert again is cluster
        assert "rank 1 had died: restarted it with 2 ranks" in capsys.readouterr().out
        assert [i["rank"] for i in cluster.run(engine_rank)] == list(range(N))
        assert not old_pids & set(cluster.pids.values())

        # during a cell: the same, and its files go too
        files = shm.mapped_files(cluster.pids.values())

        def rank_1_dies():
            import os

            from mpi4py import MPI

            if MPI.COMM_WORLD.Get_rank() == 1:
                os.kill(os.getpid(), 9)
            MPI.COMM_WORLD.Barrier()

        with pytest.raises(EngineDied, match="rank 1 died"):
            cluster.run(rank_1_dies, timeout=30)
        wait_until(lambda: not any(map(os.path.exists, files)), 10, "the dead job's /dev/shm files are removed")
    finally:
        cluster.stop()
    assert "stopped cluster" in capsys.readouterr().out
    assert cluster_processes(cluster.profile_dir, cluster.cluster_id) == []


KERNEL = """
import sys, time
import tplab.cluster
cluster = tplab.cluster.connect_or_start(n={n}, cluster_id="shared", profile_dir={where!r})
print("pids", *cluster.pids.values(), flush=True)
time.sleep(120)   # a notebook kernel, idle: the test kills it with SIGKILL
"""


def test_a_kernel_killed_hard_and_the_notebook_that_shared_its_cluster(where, capsys):
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL.format(n=1, where=where)], stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, **ENGINE_ENV))
    joined = None
    try:
        lines = [kernel.stdout.readline() for _ in range(2)]  # its setup line, then its engines' pids
        assert "started 1 rank (this kernel owns them" in lines[0], lines
        engine_pids = [int(pid) for pid in lines[1].split()[1:]]
        joined = connect_or_start(1, cluster_id="shared", profile_dir=where)
        assert not joined.owns and f"joined its 1 rank, owned by process {kernel.pid} (alive)" in \
            capsys.readouterr().out
        procs = cluster_processes(joined.profile_dir, "shared")
        files = shm.mapped_files(engine_pids)
        assert files and non_loopback_listeners(procs) == []

        def slow():
            import time
            time.sleep(60)

        kernel.kill()  # SIGKILL: no atexit, no cleanup of its own
        kernel.wait(timeout=10)
        started = time.monotonic()
        with pytest.raises(ClusterGone) as info:  # at once, not after the 120-s collective timeout
            joined.run(slow, timeout=120)
        assert time.monotonic() - started < 10
        assert "the cluster 'shared' is gone" in str(info.value) and "rerun the setup cell" in str(info.value)
        # the watchdog stopped everything, and removed the shared-memory files
        wait_until(lambda: not [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], 15,
                   "the orphaned controller and engines exit")
        wait_until(lambda: not any(map(os.path.exists, files)), 10, "the orphan's /dev/shm files are removed")
        joined.stop()
        assert "which is gone already" in capsys.readouterr().out
    finally:
        if kernel.poll() is None:
            kernel.kill()
        for proc in cluster_processes(os.path.abspath(where), "shared"):  # only if the test failed half-way
            proc.kill()


def test_the_setup_cell_replaces_an_orphan_whose_watchdog_was_killed_too(where, capsys):
    code = KERNEL.replace('"shared"', '"orphaned"').format(n=1, where=where)
    kernel = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, **ENGINE_ENV))
    cluster = None
    try:
        lines = [kernel.stdout.readline() for _ in range(2)]
        engine_pids = [int(pid) for pid in lines[1].split()[1:]]
        procs = cluster_processes(os.path.abspath(where), "orphaned")
        files = shm.mapped_files(engine_pids)
        for proc in procs:  # the watchdog first (as if it never ran), then the kernel: a true orphan
            if "tplab.cluster.watchdog" in " ".join(proc.cmdline()):
                proc.kill()
        kernel.kill()
        kernel.wait(timeout=10)
        assert all(psutil.pid_exists(pid) for pid in engine_pids)  # nothing stopped it

        from tplab.cli import main
        main(["doctor"])
        assert "ORPHAN (owner dead)" in next(line for line in capsys.readouterr().out.splitlines()
                                               if line.strip().startswith("orphaned"))

        cluster = connect_or_start(1, cluster_id="orphaned", profile_dir=where)
        assert f"stopped the one left running by process {kernel.pid}, which died; started 1 rank" in \
            capsys.readouterr().out
        assert cluster.owns and [i["rank"] for i in cluster.run(engine_rank)] == [0]
        assert not [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not any(map(os.path.exists, files))
    finally:
        if cluster is not None:
            cluster.stop()
        if kernel.poll() is None:
            kernel.kill()
        for proc in cluster_processes(os.path.abspath(where), "orphaned"):  # only if the test failed half-way
            proc.kill()

# ---- tplab doctor: lists clusters and /dev/shm files with their owners; --clean removes only what is provably
# tplab's and orphaned. Stand-in clusters (sleeping processes carrying a cluster's environment), no MPI. (In this
# file, not one of its own: its --clean must not run while another test's orphan is meant to stay.)
SLEEPER = "import time; time.sleep(60)"


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


@pytest.fixture
def stand_in_clusters(tmp_path, monkeypatch):
    """Three stand-in clusters (one orphaned, one whose owner lives, one started by hand) and two MPICH files
    (one listed in a stopped cluster's ledger, one nobody's)."""
    monkeypatch.setenv("TPLAB_STATE_DIR", str(tmp_path / "state"))
    profile = str(tmp_path / "profile")
    orphan_owner = {"TPLAB_OWNER_PID": str(dead_pid()), "TPLAB_OWNER_STARTED": "1.0"}
    procs = {}
    for cluster_id, owner in [(f"orphan-{os.getpid()}", orphan_owner), (f"alive-{os.getpid()}", owner_env()),
                              (f"by-hand-{os.getpid()}", {})]:
        env = dict(os.environ, IPP_PROFILE_DIR=profile, IPP_CLUSTER_ID=cluster_id, **owner)
        procs[cluster_id.rsplit("-", 1)[0]] = subprocess.Popen([sys.executable, "-c", SLEEPER, "ipyparallel.controller"],
                                                               env=env)
    tag = f"doctortest{os.getpid()}"
    ours, unknown = f"/dev/shm/mpich_shm_{tag}a_0", f"/dev/shm/mpich_shm_{tag}b_0"
    for path in (ours, unknown):
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    ledger.write({"profile_dir": profile, "cluster_id": "gone", "shm": [ours], "owner_pid": dead_pid()})
    deadline = time.monotonic() + 10  # the stand-ins' environments are readable once they run
    while any("IPP_CLUSTER_ID" not in _environ(p.pid) for p in procs.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    yield procs, ours, unknown
    for proc in procs.values():
        proc.kill()
        proc.wait(timeout=10)
    for path in (ours, unknown):
        if os.path.exists(path):
            os.unlink(path)


def _environ(pid) -> dict:
    try:
        return psutil.Process(pid).environ()
    except psutil.Error:
        return {}


def test_doctor_lists_and_cleans_only_orphans_that_are_provably_tplabs(stand_in_clusters, capsys):
    procs, ours, unknown = stand_in_clusters
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    lines = {cid: next(line for line in text.splitlines() if line.split()[:1] == [f"{cid}-{os.getpid()}"])
             for cid in ("orphan", "alive", "by-hand")}
    assert "ORPHAN (owner dead)" in lines["orphan"] and "dead: an orphan" in lines["orphan"]
    assert "this process (alive); ok" in lines["alive"]
    assert "started by hand" in lines["by-hand"] and lines["by-hand"].endswith("ok")
    assert f"{ours}" in text and "tplab cluster 'gone'; mapped by nobody; ORPHAN" in text
    assert f"{unknown}" in text and "unknown (not provably tplab's)" in text
    assert procs["orphan"].poll() is None  # listing changes nothing

    assert main(["doctor", "--clean"]) == 0
    text = capsys.readouterr().out
    assert f"stopped cluster 'orphan-{os.getpid()}'" in text and f"removed {ours}" in text
    procs["orphan"].wait(timeout=10)  # stopped
    assert procs["alive"].poll() is None and procs["by-hand"].poll() is None  # left alone
    assert not os.path.exists(ours) and os.path.exists(unknown)  # only the file a ledger proves tplab's
    assert ledger.entries() == []  # the stopped cluster's entry went with its file
