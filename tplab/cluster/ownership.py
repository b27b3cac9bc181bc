"""Who owns a cluster, and is that process still alive?

A cluster started by ``Cluster.start`` carries its owner in the environment of every one of its processes
(controller, launcher, engines, watchdog): ``TPLAB_OWNER_PID`` and ``TPLAB_OWNER_STARTED`` (the owner's
start time, so that a new process that happens to get the same pid is not taken for the owner). A cluster
started by hand (``ipcluster start``) has neither: its owner is whoever runs ``ipcluster stop``.

    owner_env()                          the variables to give a cluster this process starts
    who = owner_of(procs)                Owner(pid=1234, alive=True, by_hand=False) from a cluster's processes
    who.describe()                       "process 1234 (alive)", "started by hand (ipcluster)", ...
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import psutil

OWNER_PID, OWNER_STARTED = "TPLAB_OWNER_PID", "TPLAB_OWNER_STARTED"


def owner_env(pid: int | None = None) -> dict:
    """Environment variables that name ``pid`` (default: this process) as a cluster's owner."""
    pid = os.getpid() if pid is None else pid
    return {OWNER_PID: str(pid), OWNER_STARTED: repr(psutil.Process(pid).create_time())}


def is_alive(pid: int, started: float | None = None) -> bool:
    """True if process ``pid`` runs (not a zombie) and, given ``started``, is the one that started then."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(proc.create_time() - started) < 0.01
    except psutil.Error:
        return False


@dataclass(frozen=True)
class Owner:
    pid: int | None          # None: started by hand, no owner recorded
    alive: bool              # the owner runs (by hand: True while the cluster's controller runs)
    by_hand: bool = False

    @property
    def is_me(self) -> bool:
        return self.pid == os.getpid()

    def describe(self) -> str:
        if self.by_hand:
            return "started by hand (ipcluster), no owner process"
        who = "this process" if self.is_me else f"process {self.pid}"
        return f"{who} ({'alive' if self.alive else 'dead: an orphan'})"


def owner_of(procs) -> Owner:
    """The owner recorded in the environment of a cluster's processes (the first that tells)."""
    for proc in procs:
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if OWNER_PID in env:
            pid, started = int(env[OWNER_PID]), float(env.get(OWNER_STARTED) or "nan")
            return Owner(pid, is_alive(pid, None if started != started else started))
    return Owner(None, True, by_hand=True)
