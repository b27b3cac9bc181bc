"""``connect_or_start``: a notebook's setup cell, which leaves a working cluster whatever state it finds.

Students kill engines, restart kernels, run two notebooks at once and rerun cells in any order. Rerunning
the setup cell must always end with a cluster of the requested size that answers, and say in one line
what it did:

    this kernel's own cluster, healthy              reuse it
    this kernel's own cluster, broken               restart it (an engine died, ranks stuck in an old call, ...)
    nobody's: no cluster of that id                 start one (this kernel owns it)
    a live kernel's, or started by hand, healthy    join it (owns=False: stop() leaves it running)
    a dead kernel's (an orphan)                     stop it, start one
    anyone's, broken (no engines, not one world)    stop it, start one

Without a ``cluster_id`` a notebook gets a cluster of its own, ``tplab-<pid of the kernel>``; a name
shares one on purpose (``tplab demo`` runs every notebook on one cluster this way).
"""

from __future__ import annotations

import os
import time

from tplab.cluster.cluster import OWNED, Cluster
from tplab.cluster.failures import ClusterError, ClusterTimeout
from tplab.cluster.locate import is_running, load_cluster_file, profile_dir_of
from tplab.cluster.ownership import owner_of
from tplab.cluster.processes import cluster_processes, cmdline, is_engine, shutdown


def own_cluster_id() -> str:
    """The id of this process's own cluster: one per kernel, so notebooks do not share by accident."""
    return f"tplab-{os.getpid()}"


def connect_or_start(n=4, cluster_id=None, *, profile=None, profile_dir=None, timeout=120, env=None,
                     quiet=False) -> Cluster:
    """A working cluster of ``n`` ranks named ``cluster_id`` (None: this kernel's own), however it finds it
    (see the module's docstring); prints one line saying what it did (also in ``cluster.how``).

        cluster = connect_or_start(n=n_ranks, cluster_id=cluster_id)   # a notebook's setup cell
    """
    cluster_id = cluster_id or own_cluster_id()
    profile_dir = profile_dir_of(cluster_id, profile, profile_dir)

    def start():
        return Cluster.start(n, cluster_id=cluster_id, profile_dir=profile_dir, timeout=timeout, env=env)

    mine = OWNED.get((profile_dir, cluster_id))
    if mine is not None:
        why = _broken(mine, n)
        if why is None:
            how = f"reusing its {ranks(mine.n)} (this kernel started it)"
        else:
            mine.restart(n)
            how = f"{why}: restarted it with {ranks(n)} (this kernel owns them)"
        return _say(mine, how, quiet)
    if not is_running(profile_dir, cluster_id):
        return _say(start(), f"started {ranks(n)} (this kernel owns them: they stop when it does)", quiet)

    procs = cluster_processes(profile_dir, cluster_id)
    owner = owner_of(procs)
    if not owner.alive:
        _stop(profile_dir, cluster_id)
        return _say(start(), f"stopped the one left running by process {owner.pid}, which died; started "
                             f"{ranks(n)} (this kernel owns them)", quiet)
    why, joined = None, None
    try:
        engines = sum(is_engine(p) for p in procs)
        launching = any("mpiexec" in cmdline(p) for p in procs)  # (its engines may not have started yet)
        if not engines and not launching:
            raise ClusterError("it has no engines (its MPI job ended)")
        # (engines of a cluster started a moment ago may still be registering: wait for them)
        joined = Cluster.connect(cluster_id, profile_dir=profile_dir, n=min(n, engines) or n,
                                 timeout=min(timeout, 30))
        why = _broken(joined, n, joined=True)
    except ClusterTimeout:
        why = "its engines were stuck"
    except ClusterError as e:
        why = str(e).split(". ")[0].split(": ")[0]
    if why is None and joined.n < n:  # someone else's healthy cluster: theirs to resize
        joined.stop(quiet=True)
        raise ClusterError(
            f"cluster {cluster_id!r} runs {joined.n} engines, fewer than the {n} asked for ({owner.describe()}): "
            f"use n={joined.n}, or stop it (tplab.cluster.stop_cluster({cluster_id!r})).")
    if why is None:
        return _say(joined, f"joined its {ranks(joined.n)}, owned by {owner.describe()}; stop() leaves it running",
                    quiet)
    if joined is not None:
        joined.stop(quiet=True)
    _stop(profile_dir, cluster_id)
    return _say(start(), f"{why} ({owner.describe()}): stopped it and started {ranks(n)} (this kernel owns "
                         "them)", quiet)


def _broken(cluster, n, joined=False) -> str | None:
    """Why this cluster cannot serve a notebook that wants n ranks, or None."""
    why = cluster.gone()
    if why:
        return "it was gone"
    lost = cluster.lost_ranks()
    if lost:
        return f"rank {lost[0]} had died"
    if cluster.n != n and not joined:
        return f"it had {cluster.n} ranks, not {n}"
    deadline = time.monotonic() + 2  # a call that timed out may still be finishing: give it a moment
    while cluster.client.outstanding and time.monotonic() < deadline:
        time.sleep(0.05)
    if cluster.client.outstanding:
        return "its ranks were stuck in an earlier call"
    try:
        cluster.run(lambda: None, timeout=10)
    except ClusterError as e:
        return f"it did not answer ({type(e).__name__})"
    return None


def ranks(n) -> str:
    return f"{n} rank" + ("s" if n != 1 else "")


def _stop(profile_dir, cluster_id):
    shutdown(load_cluster_file(profile_dir, cluster_id), profile_dir, cluster_id, kill_engines_first=True)
    OWNED.pop((profile_dir, cluster_id), None)


def _say(cluster, how, quiet):
    cluster.how = f"cluster {cluster.cluster_id!r}: {how}"
    if not quiet:
        print(cluster.how)
    return cluster
