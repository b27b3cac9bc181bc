"""A cluster's watchdog: when the process that owns the cluster dies, in any way, the cluster goes too.

ipyparallel starts the controller and ``mpiexec`` in sessions of their own (so that Ctrl-C in a notebook
does not reach them) and stops them from an ``atexit`` hook: a kernel killed with SIGKILL, or by the
out-of-memory killer, never runs it, and its cluster would run on for ever, holding cores, memory and
/dev/shm. ``Cluster.start`` therefore starts this small process beside the cluster, in a session of its
own too:

    python -m tplab.cluster.watchdog PROFILE_DIR CLUSTER_ID     (owner in TPLAB_OWNER_PID / _STARTED)

Every half second it checks that the owner lives; when it does not, it stops the cluster (every process
found by its environment, see processes.py), removes the cluster's shared-memory files and exits. Every
few seconds it also writes down which /dev/shm files the engines map (ledger.py), and removes them as soon
as the engines are gone (an engine that died takes its MPI job with it, and MPICH leaves its files). It
exits as well when the cluster is stopped some other way. Its own environment carries the cluster's
IPP_* variables, so that stopping the cluster stops the watchdog too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tplab.cluster import ledger, shm
from tplab.cluster.ownership import OWNER_PID, OWNER_STARTED, is_alive
from tplab.cluster.processes import cluster_processes, cmdline, is_engine, shutdown

CHECK_SECONDS = 0.5   # how often the owner is checked (cheap: one /proc lookup)
SCAN_SECONDS = 1.0    # how often the cluster's processes are listed (reads every process's environment: ~20 ms)


def spawn(profile_dir: str, cluster_id: str, owner: dict) -> subprocess.Popen:
    """Start the watchdog of cluster (profile_dir, cluster_id), owned by ``owner`` (ownership.owner_env())."""
    env = dict(os.environ, IPP_PROFILE_DIR=profile_dir, IPP_CLUSTER_ID=cluster_id, **owner)
    return subprocess.Popen([sys.executable, "-m", "tplab.cluster.watchdog", profile_dir, cluster_id], env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, close_fds=True)


def watch(profile_dir: str, cluster_id: str, owner_pid: int, owner_started: float | None) -> str:
    """Watch until the owner or the cluster is gone; clean up; say why it stopped watching."""
    seen_controller, files, next_scan = False, set(), 0.0
    while True:
        if not is_alive(owner_pid, owner_started):
            # every process at once (SIGTERM, then SIGKILL 3 s later), the controller among the first: a
            # notebook that joined this cluster then hears "gone" rather than "an engine died"
            shutdown(None, profile_dir, cluster_id)  # (also its files and ledger)
            return f"owner {owner_pid} died: stopped cluster {cluster_id!r}"
        if time.monotonic() >= next_scan:
            procs = cluster_processes(profile_dir, cluster_id)
            engines = [p.pid for p in procs if is_engine(p)]
            controllers = [p for p in procs if "ipyparallel.controller" in cmdline(p)]
            seen_controller = seen_controller or bool(controllers)
            now_mapped = shm.mapped_files(engines)
            if now_mapped - files:
                files |= now_mapped
                ledger.add_shm(profile_dir, cluster_id, files)
            if files and not engines:  # the MPI job ended (an engine died): its files stay unless removed
                files -= set(shm.remove_unused(files))
            if seen_controller and not controllers:  # stopped by someone else (stop_cluster, ipcluster stop)
                shutdown(None, profile_dir, cluster_id)
                return f"cluster {cluster_id!r} was stopped"
            next_scan = time.monotonic() + SCAN_SECONDS
        time.sleep(CHECK_SECONDS)


def main(argv=None) -> int:
    profile_dir, cluster_id = (argv or sys.argv[1:])[:2]
    started = os.environ.get(OWNER_STARTED)
    watch(profile_dir, cluster_id, int(os.environ[OWNER_PID]), float(started) if started else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
