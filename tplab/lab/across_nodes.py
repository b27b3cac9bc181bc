"""Flat against hierarchical all-reduce on real nodes, and the two-level model's prediction of each.

Run under an mpiexec that spans several nodes (``tplab nodes run`` on one machine's network namespaces,
or a cluster's): MPI's node detection gives the nodes, no ``ranks_per_node`` is pretended.

    fit       α, β, γ inside a node: ``fit_on`` the ranks of my node (every node at once, as in a
              collective); α, β between nodes: ``fit_on`` the two ranks of local index 0 on two nodes,
              one message each way at a time: one flow through each node's link. A 4 MiB exchange by the
              first ranks alone, then by every rank at once, shows how the link is shared.
    sweep     ``tplab.lab.bench.sweep`` of the flat algorithms, hierarchical and MPI's built-in, on the
              world communicator: the inter-node messages cross the real (shaped) link.
    predict   TwoLevelMachine(intra, inter, q, shared_link=True): one link per node, shared by the ranks
              that cross at once (the namespaces' nodes have one interface each); next to it the model
              that gives every rank a link of its own (shared_link=False), the GPU-node assumption.
"""

from __future__ import annotations

import math
import socket
import time

import numpy as np

from tplab.comm import world
from tplab.cost import Machine, TwoLevelMachine, fit_on, predict
from tplab.cost.fit import fit_line, fit_two_lines, measure_exchange
from tplab.lab.bench import sweep

FLAT = ("ring", "recursive_doubling", "rabenseifner")
FIT_SIZES = [8 << (2 * i) for i in range(11)]  # 8 B .. 8 MiB, 4x apart


def fit_two_levels(comm, iters=10, sizes=FIT_SIZES):
    """(intra Machine, inter Machine): α, β, γ inside a node, fitted on every node at once; α, β between
    nodes for one flow through each node's link (only the first rank of each node measures). Collective,
    the same on every rank."""
    local, cross = comm.split_by_node()
    intra = fit_on(local, sizes=sizes, iters=iters, name="inside a node", protocols=False)[0]
    comm.barrier()
    inter = None
    if local.rank == 0:
        inter = _fit_link(measure_exchange(cross, sizes, iters=iters))
    comm.barrier()
    # world rank 0 is local rank 0 of node 0, so it has both
    return comm.allgather_object(intra)[0], comm.allgather_object(inter)[0]


def _fit_link(exchange_rows) -> Machine:
    """α, β between nodes, as two lines wherever the best split fits better than one line (``fit_two_lines``
    with no bar): a shaped link lets its token bucket's burst (~1 ms of traffic) through at the wire's
    speed, so messages up to ~100 KiB see a faster link than long transfers, which run at the rate."""
    alpha, beta = fit_line(exchange_rows)
    two = fit_two_lines(exchange_rows, better_by=1.0)
    if two is None:
        return Machine(alpha=alpha, beta=beta, gamma=0.0, name="between nodes")
    switch, (alpha, beta), (alpha_large, beta_large) = two
    return Machine(alpha=alpha, beta=beta, gamma=0.0, name="between nodes", switch_bytes=switch,
                   alpha_large=alpha_large, beta_large=beta_large)


def measure_link_sharing(comm, nbytes=4 << 20, iters=5):
    """Seconds for each rank to exchange ``nbytes`` with its partner on the next node: (first rank of each
    node alone, every rank at once). On one link per node the second is ~q times the first; with a link
    per rank (GPU nodes with a NIC each) about the same. Started together (world barrier), median."""
    local, cross = comm.split_by_node()
    out, into = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    right, left = (cross.rank + 1) % cross.size, (cross.rank - 1) % cross.size
    times = []
    for everyone in (False, True):
        mine = []
        for _ in range(iters + 1):
            comm.barrier()
            t0 = time.perf_counter()
            if everyone or local.rank == 0:
                cross.sendrecv(out, right, into, left)
            mine.append(time.perf_counter() - t0)
        times.append(max(comm.allgather_object(float(np.median(mine[1:])))))
    return tuple(times)


def flat_vs_hierarchical(sizes, iters=5, fit_iters=10, algorithms=FLAT + ("hierarchical", "builtin"),
                         link="", csv_path=None):
    """Measure and predict across the real nodes of this MPI job; the rows (the same on every rank):
    sweep rows plus nodes, ranks_per_node, link, predicted_us (one link per node), error
    (predicted / measured - 1), error_vs_min (the same against the fastest iteration), predicted_own_links_us, and the fitted machines' numbers."""
    comm = world()
    nodes = comm.node_ids()
    q, n_nodes = nodes.count(0), len(set(nodes))
    if n_nodes < 2 or comm.size != q * n_nodes:
        raise RuntimeError(f"needs >= 2 nodes of equal size, found node ids {nodes}: run it under "
                           "`tplab nodes run` or an mpiexec across nodes")
    intra, inter = fit_two_levels(comm, iters=fit_iters)
    alone, together = measure_link_sharing(comm)
    shared_model = TwoLevelMachine(intra, inter, q, shared_link=True)
    own_model = TwoLevelMachine(intra, inter, q)
    hosts = sorted(set(comm.allgather_object(socket.gethostname())))
    rows = sweep("allreduce", list(algorithms), sizes, iters=iters, warmup=1, comm=comm)
    out = []
    for row in rows:
        def model(machine):
            try:
                return predict("allreduce", row["algorithm"], comm.size, row["size"], machine, itemsize=4) * 1e6
            except ValueError:  # builtin: no formula
                return math.nan
        predicted = model(shared_model)
        out.append({**row, "nodes": n_nodes, "ranks_per_node": q, "hosts": " ".join(hosts), "link": link,
                    "predicted_us": predicted, "error": predicted / row["time_us"] - 1,
                    "error_vs_min": predicted / row["min_us"] - 1,  # the fastest iteration: least disturbed
                    "predicted_own_links_us": model(own_model),
                    "intra_alpha_us": intra.alpha * 1e6, "intra_GBps": 1e-9 / intra.beta,
                    "gamma_GBps": 1e-9 / intra.gamma, "entry_us": intra.entry * 1e6,
                    "inter_alpha_us": inter.alpha * 1e6, "inter_GBps": 1e-9 / inter.beta,
                    "inter_switch_bytes": inter.switch_bytes,
                    "inter_alpha_large_us": (inter.alpha_large or inter.alpha) * 1e6,
                    "inter_large_GBps": 1e-9 / (inter.beta_large or inter.beta),
                    "exchange_4MiB_one_flow_ms": alone * 1e3, "exchange_4MiB_all_flows_ms": together * 1e3})
    if csv_path and comm.rank == 0:
        import pandas as pd

        pd.DataFrame(out).to_csv(csv_path, index=False)
    return out


def crossover(rows, small="recursive_doubling", large="hierarchical", column="time_us"):
    """The smallest size from which ``large`` stays faster than ``small`` (in ``column``), or None."""
    by_size = {}
    for row in rows:
        by_size.setdefault(row["size"], {})[row["algorithm"]] = row[column]
    sizes = sorted(s for s, t in by_size.items() if small in t and large in t)
    for i, size in enumerate(sizes):
        if all(by_size[s][large] < by_size[s][small] for s in sizes[i:]):
            return size
    return None
