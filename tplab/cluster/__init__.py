"""tplab.cluster — a local cluster of MPI engines for Jupyter, with errors that say which rank failed.

Each engine is one MPI rank (started together by an MPI launcher); the notebook sends them Python functions
through ipyparallel. Code on several ranks fails in ways one process cannot: a rank raises while the
others wait for ever in a collective, or a rank's process dies. ``Cluster.run`` turns each of these into
an exception that names the ranks, and rerunning the setup cell (or ``restart()``) gets you going again.

    from tplab.cluster import connect_or_start, engine_rank
    cluster = connect_or_start(n=4)          # this kernel's own cluster: reused, restarted or started
    cluster = connect_or_start(n=4, cluster_id="shared")   # or join the cluster of that name (or start it)
    cluster.run(engine_rank)                 # [{'rank': 0, 'size': 4, ...}, {'rank': 1, ...}, ...]
    cluster.run_df(engine_rank)              # the same as a DataFrame, one row per rank
    cluster.activate()                       # then %%px cells run on every rank
    cluster.resolve_device("auto")           # "gpu" when every engine has a GPU of its own, else "cpu"
    cluster.bind_gpus()                      # each engine takes the GPU of its node-local rank (gpus.py)
    cluster.stop()                           # stops it if this process owns it, else leaves it to its owner

The modules: cluster.py (the Cluster), recovery.py (connect_or_start), failures.py (the errors),
ownership.py and watchdog.py (a cluster stops when its owner dies), processes.py (finding and stopping a
cluster's processes; the loopback-only launcher), shm.py and ledger.py (MPICH's /dev/shm files),
doctor.py (``tplab doctor``), locate.py (ipyparallel's files), gpus.py.

From a terminal instead: ``ipcluster start -n 4 --engines=MPI --cluster-id=tplab``, then
``connect_or_start(n=4, cluster_id="tplab")`` in the notebook.
"""

from tplab.cluster.cluster import Cluster, connect, engine_rank, start, stop_cluster
from tplab.cluster.failures import (ERROR_GRACE_SECONDS, ClusterError, ClusterGone, ClusterTimeout, EngineDied,
                                    RankError)
from tplab.cluster.recovery import connect_or_start, own_cluster_id

__all__ = [
    "ERROR_GRACE_SECONDS",
    "Cluster",
    "ClusterError",
    "ClusterGone",
    "ClusterTimeout",
    "EngineDied",
    "RankError",
    "connect",
    "connect_or_start",
    "engine_rank",
    "own_cluster_id",
    "start",
    "stop_cluster",
]
