"""Shared-memory files of a cluster's MPI job, and removing them once nobody uses them.

MPICH puts the ranks' shared-memory segment in a file ``/dev/shm/mpich_shm_<id>_<n>`` (2-4 MiB) and
unlinks it in MPI_Finalize. A rank that never gets there -- an engine killed by a signal, or stopped with
SIGKILL because it was stuck in MPI -- leaves the file in /dev/shm (which is RAM) until reboot. Which files
are a cluster's is known only while its engines run (they map them): ``mapped_files`` reads that from
/proc, the watchdog writes it down (``ledger.py``), and after the engines are gone ``remove_unused`` deletes
those files that no process maps any more. Nothing else in /dev/shm is touched.
"""

from __future__ import annotations

import os

import psutil

SHM_DIR = "/dev/shm"


def mapped_files(pids) -> set:
    """The files in /dev/shm that processes ``pids`` map (and that still have a name there)."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                lines = f.read().splitlines()
        except OSError:  # gone, or not ours to read
            continue
        for line in lines:
            fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
            path = fields[5].strip() if len(fields) == 6 else ""
            if path.startswith(SHM_DIR + "/") and not path.endswith(" (deleted)"):
                found.add(path)
    return found


def users(paths) -> dict:
    """{path: [pids mapping it]} over every process this user can see."""
    paths = set(paths)
    using = {path: [] for path in paths}
    if not paths:
        return using
    for proc in psutil.process_iter():
        for path in mapped_files([proc.pid]) & paths:
            using[path].append(proc.pid)
    return using


def remove_unused(paths) -> list:
    """Delete those of ``paths`` that exist and that no process maps; return the ones deleted."""
    removed = []
    for path, pids in users(p for p in paths if os.path.exists(p)).items():
        if pids:
            continue
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return sorted(removed)


def orphan_candidates() -> list:
    """MPICH's files in /dev/shm that no process maps (whose they were, /dev/shm does not say)."""
    try:
        names = [os.path.join(SHM_DIR, n) for n in os.listdir(SHM_DIR) if n.startswith("mpich_shm_")]
    except OSError:
        return []
    return sorted(path for path, pids in users(names).items() if not pids)
