"""tplab.cluster — a local cluster of MPI engines for Jupyter, with errors that say which rank failed.

Each engine is one MPI rank (started together by ``mpiexec``); the notebook sends them Python functions
through ipyparallel. Code on several ranks fails in ways one process cannot: a rank raises while the
others wait for ever in a collective, or a rank's process dies. ``Cluster.run`` turns each of these into
an exception that names the ranks, and ``restart()`` gets you going again.

    from tplab.cluster import connect_or_start, engine_rank
    cluster = connect_or_start(n=4)          # reuse the cluster "tplab" if it runs, else start it
    cluster.run(engine_rank)                 # [{'rank': 0, 'size': 4, ...}, {'rank': 1, ...}, ...]
    cluster.run_df(engine_rank)              # the same as a DataFrame, one row per rank
    cluster.activate()                       # then %%px cells run on every rank
    cluster.stop()

From a terminal instead: ``ipcluster start -n 4 --engines=MPI --cluster-id=tplab``, then
``Cluster.connect("tplab")`` in the notebook.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import time

import ipyparallel as ipp
import psutil
from traitlets.config import Config

# ipyparallel logs every engine's output at WARNING when mpiexec stops, and an ERROR for each stale
# cluster file it reads: keep that out of notebook cells. Set this logger to DEBUG to watch the launchers.
_IPP_LOG = logging.getLogger("tplab.cluster.ipyparallel")
_IPP_LOG.setLevel(logging.CRITICAL)

# After one rank fails, how long to wait for the others before reporting: they may fail too, or be
# blocked for ever in a collective that the failed rank will never join.
ERROR_GRACE_SECONDS = 2.0
RECOVER = "cluster.restart() kills and relaunches the engines (their variables are lost: re-run your setup)"


class ClusterError(RuntimeError):
    """Something went wrong with the cluster (base class of the errors below)."""


class RankError(ClusterError):
    """Ranks raised. ``failures``: {rank: RemoteError}; ``unfinished``: ranks that were still running."""

    def __init__(self, message, failures=None, unfinished=()):
        super().__init__(message)
        self.failures, self.unfinished = dict(failures or {}), list(unfinished)


class ClusterTimeout(ClusterError):
    """Ranks did not finish in time. ``finished`` / ``unfinished``: lists of ranks."""

    def __init__(self, message, finished=(), unfinished=()):
        super().__init__(message)
        self.finished, self.unfinished = list(finished), list(unfinished)


class EngineDied(ClusterError):
    """Engine processes died. ``ranks``: the dead ranks, the first to die first."""

    def __init__(self, message, ranks=()):
        super().__init__(message)
        self.ranks = list(ranks)


def engine_rank() -> dict:
    """Runs on an engine: who am I in MPI? ``cluster.run(engine_rank)`` asks every engine."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    return {"rank": world.Get_rank(), "size": world.Get_size(), "host": socket.gethostname(),
            "pid": os.getpid(), "mpi_library": MPI.Get_library_version().splitlines()[0].strip()}


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
            infos = _gather({e: client[e].apply_async(engine_rank) for e in engine_ids}, min(timeout, 30),
                            "engine_rank", label="engine")
        except ClusterTimeout as e:  # an idle engine answers in moments
            raise ClusterTimeout(
                f"{_names(e.unfinished, 'engine').capitalize()} did not tell their MPI rank: busy, perhaps "
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
        config.MPIEngineSetLauncher.mpi_cmd = [_find_mpiexec()]
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
            _shutdown(ipp_cluster, profile_dir, cluster_id)
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
            return [wrapped[0] for wrapped in _gather(pending, timeout, name, lost=lost)]
        except RankError as e:
            module = getattr(func, "__module__", None)
            if f"No module named '{module}'" in str(e):  # ipyparallel imports func's module on the engines
                e.args = (f"{e}\n\nThe engines import module {module!r} to find {name}'s globals: define it "
                          "in the notebook, or put its folder on their PYTHONPATH (Cluster.start(env=...)).",)
            raise
        finally:
            _echo_output(pending)

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
            _shutdown(ipp_cluster, self.profile_dir, self.cluster_id, kill_engines_first=busy)
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
    was_running = bool(_cluster_processes(profile_dir, cluster_id))
    _shutdown(_load_cluster_file(profile_dir, cluster_id), profile_dir, cluster_id)
    return was_running


# ---- finding clusters and waiting for engines ------------------------------------------------------------
def _find_mpiexec() -> str:
    beside_python = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside_python if os.access(beside_python, os.X_OK) else "mpiexec"


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


# ---- collecting results, and explaining failures ---------------------------------------------------------
def _gather(pending, timeout, what, label="rank", lost=lambda: []):
    """Wait for {rank: AsyncResult}; return the results in rank order, or raise a ClusterError naming the
    ranks that raised, died or did not finish. ``label`` is the word for a key ("engine" before ranks
    are known); ``lost()`` lists the ranks whose engines left the controller."""
    deadline, first_failure = time.monotonic() + timeout, None
    while not all(ar.ready() for ar in pending.values()):
        now = time.monotonic()
        # A dead engine comes back as an EngineError within moments (each engine has a watchdog
        # "nanny" that tells the controller); one that left without that report counts as dead too.
        if lost() or any(ar.ready() and not ar.successful() for ar in pending.values()):
            first_failure = first_failure or now
            if now - first_failure > ERROR_GRACE_SECONDS:
                break
        if now > deadline:
            break
        time.sleep(0.02)
    results, errors, unfinished = {}, {}, []
    for key, ar in sorted(pending.items()):
        if not ar.ready():
            unfinished.append(key)
            continue
        try:
            results[key] = ar.get(0)
        except Exception as e:  # noqa: BLE001 - a remote error: described below
            errors[key] = e
    died = sorted((k for k, e in errors.items() if getattr(e, "ename", None) == "EngineError"),
                  key=lambda k: _completed(pending[k]))  # the first reported is the first that died
    died += [k for k in sorted(lost()) if k in unfinished]
    if died:
        raise EngineDied(
            f"{what}: the engine process of {label} {died[0]} died"
            + (f", then {_names(died[1:], label)} (mpiexec ends every rank of an MPI job when one dies)"
               if len(died) > 1 else "")
            + ". Typical causes: a crash in native code, the out-of-memory killer, os._exit, a signal. "
            f"Recover: {RECOVER}.", ranks=died)
    if errors:
        by_text = {}  # ranks that failed the same way are reported together
        for key, error in errors.items():
            by_text.setdefault(_describe(error), []).append(key)
        message = f"{what} raised on {_names(list(errors), label)}:\n\n" + "\n\n".join(
            f"--- {_names(keys, label)}: {text}" for text, keys in by_text.items())
        if unfinished:
            message += (
                f"\n\n{_names(unfinished, label).capitalize()} had not finished {ERROR_GRACE_SECONDS:g} s "
                f"later: most likely blocked in a collective (barrier, allreduce, send/recv) waiting for "
                f"{_names(list(errors), label)}, which will never join. A rank blocked inside MPI cannot be "
                f"interrupted: {RECOVER}.")
        raise RankError(message, errors, unfinished)
    if unfinished:
        finished = sorted(results)
        raise ClusterTimeout(
            f"{what} did not finish within {timeout:g} s: {_names(unfinished, label)} did not finish"
            + (f", {_names(finished, label)} did" if finished else "")
            + ".\nLikely cause: a rank blocked in a collective because another rank failed, died or never "
            "called it (a deadlock), or work that needs more time than the timeout."
            f"\nA rank blocked inside MPI cannot be interrupted: {RECOVER}.",
            finished, unfinished)
    return [results[k] for k in sorted(results)]


def _completed(ar) -> float:
    when = ar.metadata.get("completed")
    return when.timestamp() if when else float("inf")


def _names(keys, label) -> str:
    return f"{label} {keys[0]}" if len(keys) == 1 else f"{label}s {', '.join(map(str, keys))}"


def _describe(error, lines=12) -> str:
    """'ValueError: boom' and the last lines of the remote traceback, without the terminal colours."""
    head = f"{getattr(error, 'ename', type(error).__name__)}: {getattr(error, 'evalue', error)}"
    tb = re.sub(r"\x1b\[[0-9;]*m", "", getattr(error, "traceback", None) or "")
    # IPython separates the frames with blank lines: drop the frames of ipyparallel and of _on_engine
    frames = [f for f in tb.split("\n\n") if f.strip() and not _is_plumbing(f.strip().splitlines()[0])]
    tail = [line for line in "\n".join(frames).splitlines() if line.strip()][-lines:]
    return head + "".join("\n    " + line for line in tail)


def _is_plumbing(first_line) -> bool:
    return (first_line.startswith("---") or "/ipyparallel/" in first_line
            or first_line.startswith("File <string>") or "in _on_engine(" in first_line)


def _echo_output(pending):
    """Show what the ranks printed, each line tagged with its rank (ipyparallel captured it)."""
    for rank, ar in sorted(pending.items()):
        for stream in ("stdout", "stderr"):
            for line in (ar.metadata.get(stream) or "").splitlines():
                print(f"[rank {rank}] {line}", file=getattr(sys, stream))


# ---- stopping without leaving processes behind -----------------------------------------------------------
def _cluster_processes(profile_dir, cluster_id) -> list:
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


def _shutdown(ipp_cluster, profile_dir, cluster_id, kill_engines_first=False):
    """Stop through ipyparallel (SIGTERM to the controller and mpiexec), then terminate what is left."""
    if kill_engines_first:  # ranks stuck inside MPI never act on SIGTERM: mpiexec would wait for them
        _kill([p for p in _cluster_processes(profile_dir, cluster_id) if "ipyparallel.engine" in _cmdline(p)])
    if ipp_cluster is not None:
        try:
            ipp_cluster.stop_cluster_sync()
        except Exception:  # noqa: BLE001 - what it could not stop, the sweep below does
            pass
    leftovers = _cluster_processes(profile_dir, cluster_id)
    for proc in leftovers:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _kill(psutil.wait_procs(leftovers, timeout=3)[1])


def _cmdline(proc) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def _kill(procs):
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)
