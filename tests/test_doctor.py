"""``tplab doctor``: lists clusters and /dev/shm files with their owners; ``--clean`` removes only what is
provably tplab's and orphaned. Stand-in clusters (sleeping processes carrying a cluster's environment), no
MPI: fast, and nothing real is at risk."""

import os
import subprocess
import sys
import time

import psutil
import pytest

from tplab.cli import main
from tplab.cluster import ledger
from tplab.cluster.ownership import owner_env

SLEEPER = "import time; time.sleep(60)"


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """Three stand-in clusters (one orphaned, one whose owner lives, one started by hand) and two MPICH files
    (one listed in a stopped cluster's ledger, one nobody's)."""
    monkeypatch.setenv("TPLAB_STATE_DIR", str(tmp_path / "state"))
    profile = str(tmp_path / "profile")
    orphan_owner = {"TPLAB_OWNER_PID": str(dead_pid()), "TPLAB_OWNER_STARTED": "1.0"}
    procs = {}
    for cluster_id, owner in [("orphan", orphan_owner), ("alive", owner_env()), ("by-hand", {})]:
        env = dict(os.environ, IPP_PROFILE_DIR=profile, IPP_CLUSTER_ID=cluster_id, **owner)
        procs[cluster_id] = subprocess.Popen([sys.executable, "-c", SLEEPER, "ipyparallel.controller"], env=env)
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


def test_doctor_lists_and_cleans_only_orphans_that_are_provably_tplabs(machine, capsys):
    procs, ours, unknown = machine
    assert main(["doctor"]) == 0
    text = capsys.readouterr().out
    lines = {cid: next(line for line in text.splitlines() if line.strip().startswith(cid))
             for cid in ("orphan", "alive", "by-hand")}
    assert "ORPHAN (owner dead)" in lines["orphan"] and "dead: an orphan" in lines["orphan"]
    assert "this process (alive); ok" in lines["alive"]
    assert "started by hand" in lines["by-hand"] and lines["by-hand"].endswith("ok")
    assert f"{ours}" in text and "tplab cluster 'gone'; mapped by nobody; ORPHAN" in text
    assert f"{unknown}" in text and "unknown (not provably tplab's)" in text
    assert procs["orphan"].poll() is None  # listing changes nothing

    assert main(["doctor", "--clean"]) == 0
    text = capsys.readouterr().out
    assert "stopped cluster 'orphan'" in text and f"removed {ours}" in text
    procs["orphan"].wait(timeout=10)  # stopped
    assert procs["alive"].poll() is None and procs["by-hand"].poll() is None  # left alone
    assert not os.path.exists(ours) and os.path.exists(unknown)  # only the file a ledger proves tplab's
    assert ledger.entries() == []  # the stopped cluster's entry went with its file
