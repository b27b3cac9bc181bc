"""The Cluster: start or connect to n MPI engines, run functions on every rank, stop without orphans."""

from __future__ import annotations

import os
import socket
import time

import ipyparallel as ipp
from traitlets.config import Config

from tplab.cluster import gpus, ledger, watchdog
from tplab.cluster.failures import (RECOVER, ClusterError, ClusterGone, ClusterTimeout, EngineDied, RankError,
                                    echo_output, gather_results, name_ranks)
from tplab.cluster.locate import is_running, load_cluster_file, profile_dir_of, wait_for_engines, where
from tplab.cluster.ownership import is_alive, owner_env, owner_of
from tplab.cluster.processes import (LOCAL_ONLY_ENV, cluster_processes, cmdline, find_mpiexec, local_launcher,
                                     mpiexec_args, shutdown)

# The clusters this process started and still owns, by (profile_dir, cluster_id): rerunning a notebook's
# setup cell finds its own cluster here (recovery.py), however broken, rather than joining it as a stranger.
OWNED: dict = {}


def engine_rank() -> dict:
    """Runs on an engine: who am I in MPI? ``cluster.run(engine_rank)`` asks every engine."""
    from mpi4py import MPI

    from tplab.toolkit.machine import mpi_library

    world = MPI.COMM_WORLD
    return {"rank": world.Get_rank(), "size": world.Get_size(), "host": socket.gethostname(),
            "pid": os.getpid(), "mpi_library": mpi_library()}


def _on_engine(func, args, kwargs):
    """Runs on an engine: ``[func(*args, **kwargs)]``. In a list because ipyparallel sends a dict result
    back with its keys sorted, but keeps the order of a dict inside a list (the columns of run_df)."""
    return [func(*args, **kwargs)]


class Cluster:
    """A client for n MPI engines; ``view`` is a DirectView over them in MPI rank order.

        with Cluster.start(2) as cluster:    # stops the cluster on exit
            print(cluster.run(engine_rank))
    """

    def __init__(self, client, *, cluster_id, profile_dir, owns, ipp_cluster=None, env=None, timeout=60):
        self.client, self.cluster_id, self.profile_dir, self.owns = client, cluster_id, profile_dir, owns
        self._ipp_cluster, self._env = ipp_cluster, env
        # The engines that left, in the order the controller said so: the first is the one that died (mpiexec
        # then ends the others). (ipyparallel calls these callbacks for every (un)registration it hears of.)
        self.departed = []
        client._registration_callbacks.append(
            lambda event: self.departed.append(int(event["id"])) if event.get("event") == "unregister" else None)
        procs = cluster_processes(profile_dir, cluster_id)
        self.owner = owner_of(procs)
        # The controller's processes, when they run on this machine: once none runs, the cluster is gone.
        self._controllers = [p for p in procs if "ipyparallel.controller" in cmdline(p)]
        # Engine ids number the engines in the order they registered, not by MPI rank: ask each one.
        engine_ids = sorted(client.ids)
        if not engine_ids:
            raise ClusterError(f"the cluster {cluster_id!r} has no engines: its MPI job ended (an engine died, and "
                               "mpiexec ends every rank when one dies). Rerun the setup cell "
                               "(tplab.cluster.connect_or_start), which starts it again.")
        try:
            infos = gather_results({e: client[e].apply_async(engine_rank) for e in engine_ids}, min(timeout, 30),
                            "engine_rank", label="engine")
        except ClusterTimeout as e:  # an idle engine answers in moments
            raise ClusterTimeout(
                f"{name_ranks(e.unfinished, 'engine').capitalize()} did not tell their MPI rank: busy, perhaps "
                f"stuck in a call from an earlier session. Stop the cluster (tplab.cluster.stop_cluster("
                f"{cluster_id!r})) and start it again.", e.finished, e.unfinished) from None
        self.ranks = {eid: info["rank"] for eid, info in zip(engine_ids, infos)}  # engine id -> MPI rank
        self.pids = {info["rank"]: info["pid"] for info in infos}
        self.n = len(infos)
        if sorted(self.ranks.values()) != list(range(self.n)) or {i["size"] for i in infos} != {self.n}:
            reported = [(i["rank"], i["size"]) for i in infos]
            raise ClusterError(f"the engines are not one MPI world: they report (rank, size) {reported}. "
                               "Start them together with mpiexec: `ipcluster start -n N --engines=MPI`, "
                               "or Cluster.start(N).")
        self._engine_of = {rank: eid for eid, rank in self.ranks.items()}
        self.view = client.direct_view(targets=[self._engine_of[r] for r in range(self.n)])
        self.view.block = True

    def __repr__(self):
        return f"<Cluster {self.cluster_id!r}: {self.n} ranks, owns={self.owns}>"

    # ---- starting and connecting ----------------------------------------------------------------------
    @classmethod
    def start(cls, n=4, *, cluster_id=None, profile_dir=None, timeout=120, env=None) -> "Cluster":
        """Start a controller and ``mpiexec -n n`` engines on this machine (``owns`` is True), and a watchdog
        that stops them when this process dies (watchdog.py). Everything listens on 127.0.0.1 only."""
        owner = owner_env()
        # the ranks share few cores: one thread each; MPI over shared memory only (no network listener)
        env = {"OMP_NUM_THREADS": "1", **LOCAL_ONLY_ENV, **(env or {})}
        config = Config()
        # ipyparallel runs a bare `mpiexec`, not on PATH when the venv was never activated (a Jupyter
        # kernel started from elsewhere): use the one installed next to this Python, if there is one.
        launcher = local_launcher()
        config.MPIEngineSetLauncher.mpi_cmd = launcher
        config.MPIEngineSetLauncher.mpi_args = mpiexec_args(launcher[0]) if launcher[0] == find_mpiexec() else []
        config.MPIEngineSetLauncher.environment = {**env, **owner}
        config.LocalControllerLauncher.environment = owner   # (its sockets: 127.0.0.1, ipyparallel's default)
        where_ = {**where(cluster_id, None, profile_dir), "shutdown_atexit": True}  # stop it as Python exits
        ipp_cluster = ipp.Cluster(engines="mpi", n=n, config=config, delay=0, **where_)
        cluster_id, profile_dir = ipp_cluster.cluster_id, ipp_cluster.profile_dir
        if is_running(profile_dir, cluster_id):
            raise ClusterError(
                f"a cluster {cluster_id!r} already runs in {profile_dir}: connect to it (connect_or_start), "
                f"or stop it (tplab.cluster.stop_cluster({cluster_id!r})).")
        client = None
        try:
            ledger.write({"profile_dir": profile_dir, "cluster_id": cluster_id, "shm": [],
                          "owner_pid": os.getpid(), "owner_started": float(owner["TPLAB_OWNER_STARTED"])})
            ipp_cluster.start_cluster_sync(n)
            watchdog.spawn(profile_dir, cluster_id, owner)
            client = ipp_cluster.connect_client_sync()
            wait_for_engines(client, n, timeout, ipp_cluster.engine_set)
            cluster = cls(client, cluster_id=cluster_id, profile_dir=profile_dir, owns=True,
                          ipp_cluster=ipp_cluster, env=env, timeout=timeout)
            OWNED[(profile_dir, cluster_id)] = cluster
            return cluster
        except BaseException as e:
            if client is not None:
                client.close()
            shutdown(ipp_cluster, profile_dir, cluster_id)
            if isinstance(e, FileNotFoundError):
                raise ClusterError(f"could not run mpiexec ({e}): `pip install mpich` installs one") from e
            raise

    @classmethod
    def connect(cls, cluster_id="", *, profile=None, profile_dir=None, n=None, timeout=60) -> "Cluster":
        """Connect to a running cluster, e.g. one started with ``ipcluster start -n 4 --engines=MPI``;
        with ``n``, wait until at least n engines have registered. ``owns`` is False."""
        profile_dir = profile_dir_of(cluster_id, profile, profile_dir)
        name = f"ipcontroller-{cluster_id}-client.json" if cluster_id else "ipcontroller-client.json"
        try:
            if not os.path.exists(os.path.join(profile_dir, "security", name)):  # ipyparallel would wait
                raise OSError(f"security/{name} not found")
            client = ipp.Client(profile_dir=profile_dir, cluster_id=cluster_id, timeout=min(timeout, 10))
        except (OSError, TimeoutError) as e:
            raise ClusterError(
                f"no cluster {cluster_id!r} to connect to in {profile_dir} ({str(e).splitlines()[0]}). Start "
                f"one: Cluster.start(4, cluster_id={cluster_id!r}) or `ipcluster start -n 4 --engines=MPI "
                f"--cluster-id={cluster_id}`.") from e
        try:
            if n is not None:
                wait_for_engines(client, n, timeout)
            return cls(client, cluster_id=cluster_id, profile_dir=profile_dir, owns=False, timeout=timeout)
        except BaseException:
            client.close()
            raise

    # ---- is it still there? ---------------------------------------------------------------------------
    def gone(self) -> str | None:
        """Why this cluster can run nothing any more -- its controller stopped -- or None. (Only for a
        controller on this machine; one elsewhere is not checked.)"""
        if self.client is None:
            return "this cluster was stopped: cluster.restart() starts it again"
        if self._controllers and not any(is_alive(p.pid) for p in self._controllers):
            if self.owns:
                whose = "it was stopped or killed"
            elif self.owner.by_hand or is_alive(self.owner.pid):
                whose = "its owner stopped it"
            else:
                whose = f"its owner, process {self.owner.pid}, died"
            return f"the cluster {self.cluster_id!r} is gone ({whose}): rerun the setup cell"
        return None

    def lost_ranks(self) -> list:
        """The ranks whose engines left the controller, the first to leave first."""
        ids = set(self.client.ids)
        order = [e for e in dict.fromkeys(self.departed) if e in self.ranks and e not in ids]
        order += sorted(e for e in set(self.ranks) - ids if e not in order)
        return [self.ranks[e] for e in order]

    def _check_usable(self, what):
        """Before a call: a cluster that is gone or lost an engine says so at once."""
        why = self.gone()
        if why:
            raise ClusterGone(f"{what}: {why}") if self.client is not None else ClusterError(why)
        lost = self.lost_ranks()
        if lost:
            raise EngineDied(
                f"{what}: rank {lost[0]} of cluster {self.cluster_id!r} died after the last call"
                + (f", and {name_ranks(lost[1:], 'rank')} with it (mpiexec ends every rank of an MPI job "
                   "when one dies)" if len(lost) > 1 else "")
                + f". Recover: {RECOVER}.", ranks=lost)

    # ---- running functions on every rank --------------------------------------------------------------
    def run(self, func, *args, timeout=120, **kwargs) -> list:
        """``func(*args, **kwargs)`` on every rank; the results in rank order. Raises RankError (a rank
        raised), EngineDied or ClusterTimeout, naming the ranks. (For a ``timeout`` argument of func
        itself, use functools.partial.)"""
        name = getattr(func, "__name__", "func")
        self._check_usable(name)
        # One AsyncResult per engine, not one for the view: that one is ready only when every rank is,
        # and a rank blocked in a barrier never is -- while the rank that failed has its error ready now.
        try:
            pending = {rank: self.client[self._engine_of[rank]].apply_async(_on_engine, func, args, kwargs)
                       for rank in range(self.n)}
        except (ipp.error.NoEnginesRegistered, IndexError):  # an engine left since the check: say which
            time.sleep(0.5)
            self._check_usable(name)
            raise
        lost = lambda: [self.ranks[e] for e in set(self.ranks) - set(self.client.ids)]  # noqa: E731
        try:
            return [wrapped[0] for wrapped in gather_results(pending, timeout, name, lost=lost, gone=self.gone)]
        except RankError as e:
            module = getattr(func, "__module__", None)
            if f"No module named '{module}'" in str(e):  # ipyparallel imports func's module on the engines
                e.args = (f"{e}\n\nThe engines import module {module!r} to find {name}'s globals: define it "
                          "in the notebook, or put its folder on their PYTHONPATH (Cluster.start(env=...)).",)
            raise
        finally:
            echo_output(pending)

    def run_df(self, func, *args, timeout=120, **kwargs):
        """``run`` as a DataFrame, column "rank" first: a dict result is a row (its keys are columns), a
        list of dicts several rows, anything else a column "result"."""
        import pandas as pd

        rows = []
        for rank, result in enumerate(self.run(func, *args, timeout=timeout, **kwargs)):
            if isinstance(result, dict):
                result = [result]
            if isinstance(result, list) and all(isinstance(r, dict) for r in result):
                rows += [{"rank": rank, **{k: v for k, v in r.items() if k != "rank"}} for r in result]
            else:
                rows.append({"rank": rank, "result": result})
        return pd.DataFrame(rows, columns=None if rows else ["rank"])

    # ---- GPUs: one engine per GPU (tplab/cluster/gpus.py) -------------------------------------------------
    def has_gpus(self) -> bool:
        """True if every engine sees a GPU."""
        return gpus.has_gpus(self)

    def resolve_device(self, device="auto") -> str:
        """A notebook's ``device`` knob as "cpu" or "gpu": "auto" is "gpu" when every engine can have a GPU
        of its own (and CuPy), else "cpu"."""
        return gpus.resolve_device(self, device)

    def bind_gpus(self):
        """Bind each engine to the GPU of its node-local rank (CuPy and torch); a DataFrame, one row per rank
        (device None on a machine without GPUs)."""
        return gpus.bind_gpus(self)

    def activate(self, suffix=""):
        """Make ``%px`` and ``%%px`` (or ``%px<suffix>``) run on every rank, in rank order."""
        self.view.activate(suffix)

    # ---- stopping -------------------------------------------------------------------------------------
    def stop(self, force=False, quiet=False) -> None:
        """Stop the controller, mpiexec and the engines, leaving no process (and no /dev/shm file) behind,
        if this object started them (or ``force``); otherwise only disconnect, and leave the cluster to its
        owner. Prints one line saying which it did (``quiet``: not)."""
        if self.client is None and self._ipp_cluster is None:
            return
        busy = False
        if self.client is not None:
            busy = bool(self.client.outstanding)  # a call never finished: ranks may be stuck in MPI
            self.client.close()
            self.client = None
        if self.owns or force:
            ipp_cluster = self._ipp_cluster or load_cluster_file(self.profile_dir, self.cluster_id)
            shutdown(ipp_cluster, self.profile_dir, self.cluster_id, kill_engines_first=busy)
            self._ipp_cluster = None
            OWNED.pop((self.profile_dir, self.cluster_id), None)
            line = f"stopped cluster {self.cluster_id!r} ({self.n} rank{'s' if self.n != 1 else ''}): no process left"
        elif self._controllers and not any(is_alive(p.pid) for p in self._controllers):
            line = f"disconnected from cluster {self.cluster_id!r}, which is gone already"
        else:
            line = (f"disconnected from cluster {self.cluster_id!r}; left it running for its owner, "
                    f"{self.owner.describe()} (stop_cluster({self.cluster_id!r}) stops it anyway)")
        if not quiet:
            print(line)

    def restart(self, n=None) -> "Cluster":
        """Stop (forcefully) and start again, with the same n or ``n``; this process owns the new cluster.
        Returns this object, updated in place."""
        n, cluster_id, profile_dir, env = n or self.n, self.cluster_id, self.profile_dir, self._env
        self.stop(force=True, quiet=True)
        fresh = Cluster.start(n, cluster_id=cluster_id, profile_dir=profile_dir, env=env)
        self.__dict__.update(fresh.__dict__)  # the same object: notebook variables holding it stay valid
        OWNED[(profile_dir, cluster_id)] = self
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop(quiet=True)


def start(n=4, **kw) -> Cluster:
    """``Cluster.start(n, ...)``."""
    return Cluster.start(n, **kw)


def connect(cluster_id="", **kw) -> Cluster:
    """``Cluster.connect(cluster_id, ...)``."""
    return Cluster.connect(cluster_id, **kw)


def stop_cluster(cluster_id="", *, profile=None, profile_dir=None) -> bool:
    """Stop a cluster by id, whoever started it (``ipcluster``, a kernel that was killed...), even with
    stuck engines: ``ipcluster stop --cluster-id=ID``, thoroughly. True if anything was running."""
    profile_dir = profile_dir_of(cluster_id, profile, profile_dir)
    was_running = bool(cluster_processes(profile_dir, cluster_id))
    shutdown(load_cluster_file(profile_dir, cluster_id), profile_dir, cluster_id)
    OWNED.pop((profile_dir, cluster_id), None)
    return was_running
