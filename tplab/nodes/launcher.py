"""MPI across the nodes of tplab.nodes: the same mpiexec and hostfile a cluster uses.

mpiexec (MPICH's hydra) runs inside node 0, the "login node"; it starts a proxy on each host of the
hostfile through the launcher ``up`` wrote (launch.sh, in place of ssh: it enters the node's namespace),
and the proxies connect back to node 0's address (-localhost). The ranks then talk:

    inside a node   shared memory, as MPICH does on any node (MPI_Comm_split_type finds the node's ranks)
    between nodes   TCP over the node's interface: the OFI netmod with libfabric's tcp provider on tplab0.
                    Without MPI_ENV, MPICH would notice that all ranks run on one machine and take shared
                    memory between nodes too, around the shaped link.

    run_across(layout, [sys.executable, "script.py"])       # mpiexec -n ..., killed whole at the time limit
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

from tplab.nodes.namespaces import DEVICE, Layout

MPI_ENV = {"MPICH_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": DEVICE}


def mpiexec_args(layout: Layout, ranks_per_node: int | None = None, extra_env: dict | None = None) -> list[str]:
    """What a cluster's mpiexec needs besides -n: the launcher, the control address, the hostfile, the
    ranks per node (-ppn: hydra fills the nodes in order, as on a cluster) and the network's environment."""
    q = layout.ranks_per_node if ranks_per_node is None else ranks_per_node
    env = dict(MPI_ENV, **(extra_env or {}))
    genv = [arg for key, value in env.items() for arg in ("-genv", key, str(value))]
    return ["-launcher", "ssh", "-launcher-exec", str(layout.launcher), "-localhost", layout.address(0),
            "-f", str(layout.hostfile), "-ppn", str(q), *genv]


def in_login_node(layout: Layout) -> list[str]:
    """The prefix that runs a command on node 0, the "login node" where mpiexec and the controller run."""
    return ["ip", "netns", "exec", layout.names[0]]


def mpiexec_command(layout: Layout, ranks: int | None = None, ranks_per_node: int | None = None,
                    extra_env: dict | None = None) -> list[str]:
    """The command line that runs ``ranks`` processes across the nodes (default: ranks_per_node on every
    node); append the program."""
    q = layout.ranks_per_node if ranks_per_node is None else ranks_per_node
    return [*in_login_node(layout), layout.mpiexec, *mpiexec_args(layout, q, extra_env),
            "-n", str(layout.nodes * q if ranks is None else ranks)]


def ipcluster_command(layout: Layout, engines: int | None = None, cluster_id: str = "multi",
                      ranks_per_node: int | None = None) -> list[str]:
    """README's multi-node recipe, on these nodes: ``ipcluster start --engines=MPI --daemonize`` on node 0
    with the controller listening on node 0's address (``--ip``; 127.0.0.1 would be unreachable from
    the other nodes) and the engines started by the cluster's mpiexec with its hostfile. Connect from
    node 0 (``in_login_node``): ``tplab.cluster.connect(cluster_id, n=engines)``. Engines fill the nodes
    in order, ``ranks_per_node`` each (default: the hostfile's slots)."""
    ipcluster = str(Path(layout.mpiexec).with_name("ipcluster"))
    if not Path(ipcluster).exists():
        ipcluster = shutil.which("ipcluster") or "ipcluster"
    return [*in_login_node(layout), ipcluster, "start", "-n", str(engines or layout.ranks), "--engines=MPI",
            f"--cluster-id={cluster_id}", "--daemonize", f"--ip={layout.address(0)}",
            f"--MPILauncher.mpi_cmd={[layout.mpiexec]!r}", f"--MPILauncher.mpi_args={mpiexec_args(layout, ranks_per_node)!r}"]


def run_across(layout: Layout, program: list[str], ranks: int | None = None, ranks_per_node: int | None = None,
               timeout: float = 600, env: dict | None = None, capture: bool = False, cwd=None):
    """Run ``program`` on the ranks across the nodes; returns (exit code, output if ``capture``). At the
    time limit the whole process group (mpiexec, its proxies, the ranks) is killed and TimeoutError
    raised with what it printed."""
    cmd = mpiexec_command(layout, ranks=ranks, ranks_per_node=ranks_per_node) + list(program)
    pipe = subprocess.PIPE if capture else None
    proc = subprocess.Popen(cmd, env=dict(os.environ, **(env or {})), stdout=pipe, cwd=cwd,
                            stderr=subprocess.STDOUT if capture else None, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise TimeoutError(f"{' '.join(cmd)} did not finish within {timeout} s\n{out or ''}") from None
    return proc.returncode, out
