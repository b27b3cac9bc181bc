"""Where a cluster's files are (ipyparallel's profile directory), whether it runs, and waiting for its engines."""

from __future__ import annotations

import logging
import os
import time

import ipyparallel as ipp
import psutil

from tplab.cluster.failures import ClusterError, ClusterTimeout

# ipyparallel logs every engine's output at WARNING when mpiexec stops, and an ERROR for each stale
# cluster file it reads: keep that out of notebook cells. Set this logger to DEBUG to watch the launchers.
IPP_LOG = logging.getLogger("tplab.cluster.ipyparallel")
IPP_LOG.setLevel(logging.CRITICAL)


def profile_dir_of(cluster_id, profile=None, profile_dir=None) -> str:
    """The profile directory ipcluster would use for these arguments."""
    return ipp.Cluster(**where(cluster_id, profile, profile_dir)).profile_dir


def where(cluster_id, profile, profile_dir) -> dict:
    """Keyword arguments for ipp.Cluster, which finds the profile directory as ipcluster does (default:
    the running IPython's profile, else $IPYTHONDIR/profile_default)."""
    kw = {"log": IPP_LOG, "shutdown_atexit": False}
    if cluster_id:
        kw["cluster_id"] = cluster_id
    if profile:
        kw["profile"] = profile
    if profile_dir:
        kw["profile_dir"] = os.path.abspath(os.path.expanduser(profile_dir))
    return kw


def load_cluster_file(profile_dir, cluster_id):
    try:
        return ipp.Cluster.from_file(profile_dir=profile_dir, cluster_id=cluster_id, log=IPP_LOG)
    except (OSError, ValueError):
        return None


def is_running(profile_dir, cluster_id) -> bool:
    found = load_cluster_file(profile_dir, cluster_id)  # (this also deletes the file of a dead cluster)
    return found is not None and found._is_running()


def wait_for_engines(client, n, timeout, launcher=None):
    deadline = time.monotonic() + timeout
    while len(client.ids) < n:
        if launcher is not None and _exited(launcher):  # mpiexec exited: no engine will come
            raise ClusterError(f"mpiexec exited before {n} engines registered:\n{_tail(launcher)}")
        if time.monotonic() > deadline:
            raise ClusterTimeout(f"only {len(client.ids)} of {n} engines registered within {timeout} s"
                                 + (f"; mpiexec's output so far:\n{_tail(launcher)}" if launcher else ""))
        time.sleep(0.1)


def _exited(launcher) -> bool:
    # (launcher.state changes only when ipyparallel's event loop runs, so ask the process itself)
    try:
        return not launcher.process.is_running() or launcher.process.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _tail(launcher, lines=20) -> str:
    try:
        with open(launcher.output_file) as f:
            text = f.read()
    except OSError:  # ipyparallel reads and deletes the file when mpiexec exits
        text = getattr(launcher, "_output", None) or ""
    return "".join(text.splitlines(True)[-lines:])
