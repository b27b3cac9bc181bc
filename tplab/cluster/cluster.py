"""The Cluster: start or connect to n MPI engines, run functions on every rank, stop without orphans."""

from __future__ import annotations

import logging
import os
import socket
import time

import ipyparallel as ipp
import psutil
from traitlets.config import Config

from tplab.cluster import gpus
from tplab.cluster.failures import ClusterError, ClusterTimeout, RankError, echo_output, gather_results, name_ranks
from tplab.cluster.processes import cluster_processes, find_mpiexec, mpiexec_args, shutdown

# ipyparallel logs every engine's output at WARNING when mpiexec stops, and an ERROR for each stale
# cluster file it reads: keep that out of notebook cells. Set this logger to DEBUG to watch the launchers.
_IPP_LOG = logging.getLogger("tplab.cluster.ipyparallel")
_IPP_LOG.setLevel(logging.CRITICAL)


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
        # Engine ids number the engines in the order they registered, not by MPI rank: ask each one.
        engine_ids = sorted(client.ids)
        try:
            infos = gather_results({e: client[e].apply_async(engine_rank) for e in engine_ids}, min(timeout, 30),
                            "engine_rank", label="engine")
        except ClusterTimeout as e:  # an idle engine answers in moments
            raise ClusterTimeout(
                f"{name_ranks(e.unfinished, 'engine').capitalize()} did not tell their MPI rank: busy, perhaps "
                f"stuck in a call from an earlier session. Stop the cluster (tplab.cluster.stop_cluster("
                f"{cluster_id!r})) and start it again.", e.finished, e.unfinished) from None
        self.ranks = {eid: info["rank"] for eid, info in zip(engine_ids, infos)}  # engine id -> MPI rank
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
        """Start a controller and ``mpiexec -n n`` engines on this machine (``owns`` is True)."""
        env = {"OMP_NUM_THREADS": "1", **(env or {})}  # the ranks share few cores: one thread each
        config = Config()
        # ipyparallel runs a bare `mpiexec`, not on PATH when the venv was never activated (a Jupyter
        # kernel started from elsewhere): use the one installed next to this Python, if there is one.
        config.MPIEngineSetLauncher.mpi_cmd = [find_mpiexec()]
        config.MPIEngineSetLauncher.mpi_args = mpiexec_args(find_mpiexec())  # Open MPI: as root, oversubscribed
        config.MPIEngineSetLauncher.environment = env
        where = {**_where(cluster_id, None, profile_dir), "shutdown_atexit": True}  # stop it as Python exits
        ipp_cluster = ipp.Cluster(engines="mpi", n=n, config=config, delay=0, **where)
        cluster_id, profile_dir = ipp_cluster.cluster_id, ipp_cluster.profile_dir
        if _is_running(profile_dir, cluster_id):
            raise ClusterError(
                f"a cluster {cluster_id!r} already runs in {profile_dir}: connect to it (connect_or_start), "
                f"or stop it (tplab.cluster.stop_cluster({cluster_id!r})).")
        client = None
        try:
            ipp_cluster.start_cluster_sync(n)
            client = ipp_cluster.connect_client_sync()
            _wait_for_engines(client, n, timeout, ipp_cluster.engine_set)
            return cls(client, cluster_id=cluster_id, profile_dir=profile_dir, owns=True,
                       ipp_cluster=ipp_cluster, env=env, timeout=timeout)
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
        profile_dir = ipp.Cluster(**_where(cluster_id, profile, profile_dir)).profile_dir
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
                _wait_for_engines(client, n, timeout)
            return cls(client, cluster_id=cluster_id, profile_dir=profile_dir, owns=False, timeout=timeout)
        except BaseException:
            client.close()
            raise

    # ---- running functions on every rank --------------------------------------------------------------
    def run(self, func, *args, timeout=120, **kwargs) -> list:
        """``func(*args, **kwargs)`` on every rank; the results in rank order. Raises RankError (a rank
        raised), EngineDied or ClusterTimeout, naming the ranks. (For a ``timeout`` argument of func
        itself, use functools.partial.)"""
        if self.client is None:
            raise ClusterError("this cluster was stopped: cluster.restart() starts it again")
        # One AsyncResult per engine, not one for the view: that one is ready only when every rank is,
        # and a rank blocked in a barrier never is -- while the rank that failed has its error ready now.
        pending = {rank: self.client[self._engine_of[rank]].apply_async(_on_engine, func, args, kwargs)
                   for rank in range(self.n)}
        name = getattr(func, "__name__", "func")
        lost = lambda: [self.ranks[e] for e in set(self.ranks) - set(self.client.ids)]  # noqa: E731
        try:
            return [wrapped[0] for wrapped in gather_results(pending, timeout, name, lost=lost)]
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
    def stop(self, force=False):
        """Stop the controller, mpiexec and the engines, leaving no process behind, if this object
        started them (or ``force``); otherwise only disconnect."""
        busy = False
        if self.client is not None:
            busy = bool(self.client.outstanding)  # a call never finished: ranks may be stuck in MPI
            self.client.close()
            self.client = None
        if self.owns or force:
            ipp_cluster = self._ipp_cluster or _load_cluster_file(self.profile_dir, self.cluster_id)
            shutdown(ipp_cluster, self.profile_dir, self.cluster_id, kill_engines_first=busy)
            self._ipp_cluster = None

    def restart(self) -> "Cluster":
        """Stop (forcefully) and start again with the same n. Returns this object, updated in place."""
        n, cluster_id, profile_dir, env = self.n, self.cluster_id, self.profile_dir, self._env
        self.stop(force=True)
        fresh = Cluster.start(n, cluster_id=cluster_id, profile_dir=profile_dir, env=env)
        self.__dict__.update(fresh.__dict__)  # the same object: notebook variables holding it stay valid
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start(n=4, **kw) -> Cluster:
    """``Cluster.start(n, ...)``."""
    return Cluster.start(n, **kw)


def connect(cluster_id="", **kw) -> Cluster:
    """``Cluster.connect(cluster_id, ...)``."""
    return Cluster.connect(cluster_id, **kw)


def connect_or_start(n=4, cluster_id="tplab", **kw) -> Cluster:
    """Connect to cluster ``cluster_id`` if it runs (with at least n engines), else start it (owns=True).

        cluster = connect_or_start(n=n_ranks, cluster_id=cluster_id)   # a notebook's first cell
    """
    profile_dir = ipp.Cluster(**_where(cluster_id, kw.get("profile"), kw.get("profile_dir"))).profile_dir
    if not _is_running(profile_dir, cluster_id):
        start_kw = {k: v for k, v in kw.items() if k in ("timeout", "env")}
        return Cluster.start(n, cluster_id=cluster_id, profile_dir=profile_dir, **start_kw)
    cluster = Cluster.connect(cluster_id, profile_dir=profile_dir, timeout=kw.get("timeout", 60))
    if cluster.n < n:
        cluster.stop()
        raise ClusterError(
            f"cluster {cluster_id!r} runs {cluster.n} engines, fewer than the {n} asked for: use "
            f"n={cluster.n}, or stop it (tplab.cluster.stop_cluster({cluster_id!r})).")
    return cluster


def stop_cluster(cluster_id="", *, profile=None, profile_dir=None) -> bool:
    """Stop a cluster by id, whoever started it (``ipcluster``, a kernel that was killed...), even with
    stuck engines: ``ipcluster stop --cluster-id=ID``, thoroughly. True if anything was running."""
    profile_dir = ipp.Cluster(**_where(cluster_id, profile, profile_dir)).profile_dir
    was_running = bool(cluster_processes(profile_dir, cluster_id))
    shutdown(_load_cluster_file(profile_dir, cluster_id), profile_dir, cluster_id)
    return was_running


# ---- finding clusters and waiting for engines ------------------------------------------------------------


def _where(cluster_id, profile, profile_dir) -> dict:
    """Keyword arguments for ipp.Cluster, which finds the profile directory as ipcluster does (default:
    the running IPython's profile, else $IPYTHONDIR/profile_default)."""
    kw = {"log": _IPP_LOG, "shutdown_atexit": False}
    if cluster_id:
        kw["cluster_id"] = cluster_id
    if profile:
        kw["profile"] = profile
    if profile_dir:
        kw["profile_dir"] = os.path.abspath(os.path.expanduser(profile_dir))
    return kw


def _load_cluster_file(profile_dir, cluster_id):
    try:
        return ipp.Cluster.from_file(profile_dir=profile_dir, cluster_id=cluster_id, log=_IPP_LOG)
    except (OSError, ValueError):
        return None


def _is_running(profile_dir, cluster_id) -> bool:
    found = _load_cluster_file(profile_dir, cluster_id)  # (this also deletes the file of a dead cluster)
    return found is not None and found._is_running()


def _wait_for_engines(client, n, timeout, launcher=None):
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
