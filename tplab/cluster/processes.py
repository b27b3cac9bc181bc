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

from tplab.cluster import ledger, shm


def find_mpiexec() -> str:
    beside_python = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside_python if os.access(beside_python, os.X_OK) else "mpiexec"


# MPICH over UCX (the PyPI wheel) opens a TCP listener on the machine's external address in every rank
# unless UCX's TCP transport is left out; what remains (shared memory; CUDA and InfiniBand on a GPU node)
# opens no IP listener. (FI_PROVIDER: the same for MPICH over libfabric.)
LOCAL_ONLY_ENV = {"UCX_TLS": "^tcp", "FI_PROVIDER": "shm"}


def local_launcher() -> list:
    """The launcher for a cluster on this machine only. MPICH's hydra ``mpiexec`` listens on every interface
    (0.0.0.0) for its proxies, whatever its flags; MPICH's ``mpiexec.gforker``, installed beside it, forks
    the ranks and talks to them over pipes: no socket at all. Other MPIs: their ``mpiexec``."""
    mpiexec = find_mpiexec()
    gforker = mpiexec + ".gforker"
    return [gforker] if os.path.isabs(mpiexec) and os.access(gforker, os.X_OK) else [mpiexec]


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


def shutdown(ipp_cluster, profile_dir, cluster_id, kill_engines_first=False) -> list:
    """Stop through ipyparallel (SIGTERM to the controller and mpiexec), then terminate what is left, then
    remove the shared-memory files the engines leave (shm.py) and the cluster's ledger entry. Returns the
    files removed."""
    procs = cluster_processes(profile_dir, cluster_id)
    entry = ledger.read(profile_dir, cluster_id) or {}
    files = shm.mapped_files(p.pid for p in procs if is_engine(p)) | set(entry.get("shm", []))
    if kill_engines_first:  # ranks stuck inside MPI never act on SIGTERM: mpiexec would wait for them
        kill([p for p in procs if is_engine(p)])
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
    removed = shm.remove_unused(files)
    ledger.remove(profile_dir, cluster_id)
    return removed


def is_engine(proc) -> bool:
    """An MPI rank of the cluster (not its nanny, not mpiexec)."""
    line = cmdline(proc)
    return "ipyparallel.engine" in line and "nanny" not in line and "mpiexec" not in line


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
