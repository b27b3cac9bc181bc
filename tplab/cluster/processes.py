"""Finding and stopping a cluster's processes, so that nothing is left behind.

Every process of a cluster (controller, mpiexec, engines and their nannies) carries the environment
variables IPP_PROFILE_DIR and IPP_CLUSTER_ID that ipyparallel sets: that is how they are found, even for a
cluster started by another process that has since died.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import psutil


def find_mpiexec() -> str:
    beside_python = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside_python if os.access(beside_python, os.X_OK) else "mpiexec"


def mpiexec_args(mpiexec: str) -> list:
    """Flags this ``mpiexec`` needs to start a notebook's engines: Open MPI's refuses to run as root without
    ``--allow-run-as-root`` and to start more ranks than cores without ``--oversubscribe`` (a laptop's
    4 engines on 2 cores); MPICH's needs neither (none are added)."""
    return list(_open_mpi_flags(mpiexec))


@functools.lru_cache(maxsize=None)
def _open_mpi_flags(mpiexec: str) -> tuple:
    try:
        version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    if not any(mark in version for mark in ("Open MPI", "OpenRTE", "open-mpi.org")):
        return ()
    return ("--oversubscribe",) + (("--allow-run-as-root",) if hasattr(os, "geteuid") and os.geteuid() == 0 else ())


# ---- stopping without leaving processes behind -----------------------------------------------------------
def cluster_processes(profile_dir, cluster_id) -> list:
    """Every local process of a cluster, found by its environment: ipyparallel sets IPP_PROFILE_DIR and
    IPP_CLUSTER_ID for the controller and mpiexec, and the engines (and their nannies) inherit them."""
    found = []
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("IPP_PROFILE_DIR") == profile_dir and env.get("IPP_CLUSTER_ID") == cluster_id:
            found += [proc] if proc.pid != os.getpid() else []
    return found


def shutdown(ipp_cluster, profile_dir, cluster_id, kill_engines_first=False):
    """Stop through ipyparallel (SIGTERM to the controller and mpiexec), then terminate what is left."""
    if kill_engines_first:  # ranks stuck inside MPI never act on SIGTERM: mpiexec would wait for them
        kill([p for p in cluster_processes(profile_dir, cluster_id) if "ipyparallel.engine" in cmdline(p)])
    if ipp_cluster is not None:
        try:
            ipp_cluster.stop_cluster_sync()
        except Exception:  # noqa: BLE001 - what it could not stop, the sweep below does
            pass
    leftovers = cluster_processes(profile_dir, cluster_id)
    for proc in leftovers:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    kill(psutil.wait_procs(leftovers, timeout=3)[1])


def cmdline(proc) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def kill(procs):
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)
