"""tplab.nodes — several nodes on one Linux machine, for real: network namespaces joined by a shaped link.

Each node is a network namespace with its own address; the link between the nodes is rate-limited (and
delayed, where the kernel has netem) with tc; MPI starts its ranks on them with its own launcher and a
hostfile, as on a cluster. So MPI's node detection finds real nodes, messages between nodes cross a real
(slow) network stack, and messages inside a node take shared memory.

    sudo tplab nodes up --nodes 2 --ranks-per-node 2 --rate 10gbit --latency 20us
    sudo tplab nodes run -- python -m pytest tests/mpi/test_hierarchical.py
    sudo tplab nodes ipcluster -n 4 --cluster-id multi       # engines on both nodes, controller on node 0
    sudo tplab nodes login -- python -c "import tplab.cluster as c; print(c.connect('multi', n=4).run_df(c.engine_rank))"
    sudo tplab nodes down                                      # also ends what still runs on the nodes

namespaces.py makes and removes them (root, iproute2), shaping.py is the link, launcher.py the mpiexec
and ipcluster command lines, launch.sh the launcher MPICH's mpiexec uses in place of ssh.
"""

from tplab.nodes.launcher import (MPI_ENV, in_login_node, ipcluster_command, mpiexec_args, mpiexec_command,
                                  run_across)
from tplab.nodes.namespaces import DEVICE, Layout, NodesError, check_can_run, current, down, namespaces_work, status, up
from tplab.nodes.shaping import Shaping, parse_rate, parse_time

__all__ = ["DEVICE", "MPI_ENV", "Layout", "NodesError", "Shaping", "check_can_run", "current", "down",
           "in_login_node", "ipcluster_command", "mpiexec_args", "mpiexec_command", "namespaces_work",
           "parse_rate", "parse_time", "run_across", "status", "up"]
