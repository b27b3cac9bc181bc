"""Flat against hierarchical all-reduce on real nodes, and the two-level model's prediction of each.

Run under an mpiexec that spans several nodes (``tplab nodes run`` on one machine's network namespaces,
or a cluster's): MPI's node detection gives the nodes, no ``ranks_per_node`` is pretended.

    fit       α, β, γ inside a node: ``fit_on`` the ranks of my node (every node at once, as in a
              collective); α, β between nodes: the first rank of each node exchanges with the next node's,
              4 exchanges in a row per timing (measure_link): one flow through each node's link; α the
              smallest message's time, β the slope between the two largest (``hockney``). A 4 MiB exchange by the
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
from tplab.lab.bench import sweep

FLAT = ("ring", "recursive_doubling", "rabenseifner")
FIT_SIZES = [8 << (2 * i) for i in range(11)]  # 8 B .. 8 MiB, 4x apart


def machine_description(comm, link) -> str:
    """For the CSVs' ``machine`` column: the CPU, its cores, the MPI library, the nodes' layout and link,
    and the load average (other jobs on the same cores show in the timings)."""
    import os

    from tplab.toolkit.machine import cpu_model, mpi_library

    nodes = comm.node_ids()
    return (f"{cpu_model(short=True)}, {os.cpu_count()} cores, {mpi_library(short=True)}; {len(set(nodes))} nodes "
            f"x {nodes.count(0)} ranks as network namespaces (tplab nodes), {link}; load average "
            f"{os.getloadavg()[0]:.1f}")


def fit_two_levels(comm, iters=10, sizes=FIT_SIZES):
    """(intra Machine, inter Machine): α, β, γ inside a node, fitted on every node at once; α, β between
    nodes for one flow through each node's link (only the first rank of each node measures). Collective,
    the same on every rank."""
    local, cross = comm.split_by_node()
    intra = fit_on(local, sizes=sizes, iters=iters, name="inside a node", protocols=False)[0]
    comm.barrier()
    inter = None
    if local.rank == 0:
        inter = hockney(measure_link(cross, sizes, iters=iters))
    comm.barrier()
    # world rank 0 is local rank 0 of node 0, so it has both
    return comm.allgather_object(intra)[0], comm.allgather_object(inter)[0]


def measure_link(cross, sizes, iters=10, steps=4) -> list[dict]:
    """Per-step seconds of ``steps`` exchanges in a row with the next node (a chain, as an algorithm's
    crossing steps follow each other). Several in a row matter on a shaped link: its token bucket lets a
    burst (~1 ms of traffic) through at the wire's speed after a pause, which a single exchange after a
    barrier would take for the link's rate. Per size the fastest of ``iters`` chains (the link is what
    is measured, not the moments other processes took the cores; on a machine of few cores shared by
    others the median is mostly the latter), the slowest rank's; the same rows on every rank."""
    right, left = (cross.rank + 1) % cross.size, (cross.rank - 1) % cross.size
    rows = []
    for size in sizes:
        out, into = np.ones(size * steps, np.uint8), np.empty(size, np.uint8)
        mine = []
        for i in range(iters + 2):
            cross.barrier()
            t0 = time.perf_counter()
            for k in range(steps):
                cross.sendrecv(out[k * size:(k + 1) * size], right, into, left)
            mine.append((time.perf_counter() - t0) / steps)
        rows.append({"size": size, "time_s": max(cross.allgather_object(float(np.min(mine[2:]))))})
    return rows


def hockney(rows) -> Machine:
    """α, β the way Hockney read them off a ping-pong: α the time of the smallest message, β the slope
    between the two largest (which the α of each cancels out of). A least-squares line through every
    size would bend to the sizes in between, which a shaped link's token bucket lets through faster than
    its rate, and to a loaded machine's noisy small messages."""
    rows = sorted(rows, key=lambda r: r["size"])
    (n1, t1), (n2, t2) = [(r["size"], r["time_s"]) for r in rows[-2:]]
    beta = max((t2 - t1) / (n2 - n1), 1e-15)
    return Machine(alpha=rows[0]["time_s"], beta=beta, gamma=0.0, name="between nodes")


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
    where = machine_description(comm, link)
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
                    "machine": where,
                    "predicted_us": predicted, "error": predicted / row["time_us"] - 1,
                    "error_vs_min": predicted / row["min_us"] - 1,  # the fastest iteration: least disturbed
                    "predicted_own_links_us": model(own_model),
                    "intra_alpha_us": intra.alpha * 1e6, "intra_GBps": 1e-9 / intra.beta,
                    "gamma_GBps": 1e-9 / intra.gamma, "entry_us": intra.entry * 1e6,
                    "inter_alpha_us": inter.alpha * 1e6, "inter_GBps": 1e-9 / inter.beta,
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


# ---- a TP model split across the nodes ------------------------------------------------------------------
def tp_groups(node_ids) -> dict:
    """Rank groups that each hold one TP copy of the model: alone, inside node 0, across two nodes (the
    first rank of node 0 and of node 1), and every rank. Rank 0 is in each (it reports)."""
    q = node_ids.count(0)
    groups = {"TP=1": [0], f"TP={q} inside a node": list(range(q))}
    first_of_node_1 = node_ids.index(1)
    groups["TP=2 across 2 nodes"] = [0, first_of_node_1]
    groups[f"TP={len(node_ids)} across {len(set(node_ids))} nodes"] = list(range(len(node_ids)))
    return groups


def time_block_allreduces(config, batch, seq, group, iters) -> dict:
    """The communication of the forward pass alone: its 2 all-reduces per block, each of the
    batch x seq x hidden activations (float32), as the row-parallel layers call them. What TP adds to the
    compute, with nothing else on the cores but the collectives."""
    import tplab
    from tplab.toolkit.timing import median_of_slowest, time_calls

    x = np.ones(batch * seq * config.n_embd, np.float32)

    def all_reduces():
        for _ in range(2 * config.n_layer):
            tplab.allreduce(x, group, check=False)

    if group.size == 1:
        return {"block_allreduces_ms": 0.0, "block_allreduces_min_ms": 0.0}
    median, best = median_of_slowest(time_calls(all_reduces, iters=iters, warmup=2, barrier=group.barrier), group)
    return {"block_allreduces_ms": median * 1e3, "block_allreduces_min_ms": best * 1e3}


def tp_across_nodes(config, batch=4, seq=64, iters=10, link=""):
    """Forward time of ``config``'s GPT split over each of ``tp_groups``, what one forward pass sends from
    rank 0 (bytes, messages: 2 all-reduces per block, plus the vocabulary-parallel embedding's and head's),
    and the time of its blocks' all-reduces alone (``time_block_allreduces``). The same rows on every rank;
    the ranks outside a group wait sleeping."""
    import torch

    from tplab.models import GPT, parallelize
    from tplab.models.speed import time_model_forward, timing_mode, wait_sleeping_for_rank_0

    comm = world()
    where = machine_description(comm, link)
    rows = []
    for name, ranks in tp_groups(comm.node_ids()).items():
        member = comm.rank in ranks
        group = comm.split(color=0 if member else 1, key=comm.rank)
        row = None
        if member:
            torch.manual_seed(0)
            sharded = parallelize(GPT(config), group)
            tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
            with timing_mode(threads=1):
                group.reset_counters()
                sharded(tokens)
                sent = {"bytes_sent": group.bytes_sent, "messages_sent": group.messages_sent}
                row = {"group": name, "tp": len(ranks), "nodes": len({comm.node_of(r) for r in ranks}),
                       "batch": batch, "seq": seq, "n_layer": config.n_layer, "n_embd": config.n_embd,
                       "link": link, "machine": where, **sent,
                       **time_model_forward(sharded, tokens, group, iters=iters),
                       **time_block_allreduces(config, batch, seq, group, iters)}
        wait_sleeping_for_rank_0(comm)
        rows.append(comm.allgather_object(row)[0])
    return rows


def predict_block_allreduces(tp_rows, fitted_row) -> list[dict]:
    """``tp_rows`` (tp_across_nodes) with ``predicted_block_allreduces_ms``: the model's time of the blocks'
    2·n_layer all-reduces, each the algorithm ``auto`` picks, from the α, β, γ fitted between and inside
    the nodes (a row of flat_vs_hierarchical): inside a node on the intra Machine, 2 ranks on 2 nodes on
    the inter one (every message crosses), more ranks on the TwoLevelMachine with one link per node."""
    from dataclasses import replace

    from tplab.collectives.auto import choose

    intra = Machine(alpha=fitted_row["intra_alpha_us"] * 1e-6, beta=1e-9 / fitted_row["intra_GBps"],
                    gamma=1e-9 / fitted_row["gamma_GBps"], entry=fitted_row["entry_us"] * 1e-6)
    inter = replace(intra, alpha=fitted_row["inter_alpha_us"] * 1e-6, beta=1e-9 / fitted_row["inter_GBps"])
    out = []
    for row in tp_rows:
        p, count = int(row["tp"]), int(row["batch"] * row["seq"] * row["n_embd"])
        if p == 1:
            out.append({**row, "predicted_block_allreduces_ms": 0.0})
            continue
        per_node = p // int(row["nodes"])
        machine = intra if row["nodes"] == 1 else inter if per_node == 1 else \
            TwoLevelMachine(intra, inter, per_node, shared_link=True)
        algorithm = choose("allreduce", 4 * count, count, p)
        one = predict("allreduce", algorithm, p, 4 * count, machine, itemsize=4)
        out.append({**row, "predicted_block_allreduces_ms": 2 * row["n_layer"] * one * 1e3})
    return out
