"""Across real nodes: flat vs hierarchical all-reduce against the two-level model, and a TP model split
across the nodes.

On one Linux machine, as root (network namespaces; tplab.nodes brings them up and down around the run):

    python scripts/nodes_reference.py --nodes 2 --ranks-per-node 2 --rate 1gbit \
        --csv data/nodes_2x2_<machine>.csv --tp-csv data/nodes_tp_2x2_<machine>.csv

On a cluster (or nodes already up), run the measuring part under the cluster's own mpiexec:

    mpiexec -f hostfile -ppn 2 -n 4 python scripts/nodes_reference.py --inside --csv out.csv --tp-csv tp.csv

All-reduce: prints, per size, each algorithm's measured and predicted time, the crossovers (the sizes
from which hierarchical beats recursive doubling and the ring) measured and predicted, and how many
points the model gets within 25% (tplab.lab.across_nodes says what is fitted and how). TP: the forward
time of a small GPT on 1 rank, split inside a node, across two nodes and over every rank, with the bytes
one forward pass sends. With --emulated-csv, the all-reduce sweep again on one machine's plain mpiexec,
EmulatedNetwork playing the link with the α, β fitted between the nodes: what section 4 of notebook 03
would have predicted.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tplab beside this script, also when run from elsewhere

SIZES = [16 << (2 * i) for i in range(11)]  # 16 B .. 16 MiB per rank, 4x apart


def inside(args) -> int:
    from tplab.comm import world
    from tplab.lab.across_nodes import crossover, flat_vs_hierarchical

    if args.points == 0:
        return tensor_parallel(args) or 0
    rows = flat_vs_hierarchical(SIZES[args.first: args.first + args.points], iters=args.iters, fit_iters=args.fit_iters, link=args.link, csv_path=args.csv)
    if world().rank == 0:
        import pandas as pd

        frame = pd.DataFrame(rows)
        first = frame.iloc[0]
        print(f"{first.nodes} nodes x {first.ranks_per_node} ranks ({first.hosts}); link {args.link}")
        print(f"fitted: inside a node α {first.intra_alpha_us:.1f} µs, {first.intra_GBps:.2f} GB/s; between nodes "
              f"α {first.inter_alpha_us:.1f} µs, {first.inter_GBps:.3f} GB/s; a 4 MiB exchange between nodes "
              f"{first.exchange_4MiB_one_flow_ms:.1f} ms alone, {first.exchange_4MiB_all_flows_ms:.1f} ms with all "
              f"{first.ranks_per_node} ranks of each node at once")
        table = frame.pivot(index="size", columns="algorithm", values="time_us").round(0)
        predicted = frame.dropna(subset=["predicted_us"]).pivot(index="size", columns="algorithm",
                                                                 values="predicted_us").round(0)
        print("measured µs\n", table.to_string(), "\npredicted µs (one link per node)\n", predicted.to_string())
        modelled = frame.dropna(subset=["predicted_us"])
        large = modelled["size"] >= 262144
        for column, what in (("error", "median"), ("error_vs_min", "fastest iteration")):
            within = modelled[column].abs() <= 0.25
            print(f"within 25% of the {what}: {within.sum()} of {len(modelled)} points; "
                  f"from 256 KiB: {within[large].sum()} of {large.sum()}")
        print(f"hierarchical beats recursive doubling from: measured {crossover(rows)} B, "
              f"predicted {crossover(rows, column='predicted_us')} B; beats ring from: measured "
              f"{crossover(rows, 'ring')} B, predicted {crossover(rows, 'ring', column='predicted_us')} B")
    if args.tp_csv:
        tensor_parallel(args)
    return 0


def tensor_parallel(args):
    from tplab.comm import world
    from tplab.lab.across_nodes import predict_block_allreduces, tp_across_nodes
    from tplab.models import GPTConfig

    config = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=8, n_embd=256)
    rows = tp_across_nodes(config, batch=4, seq=64, iters=args.iters, link=args.link)
    if world().rank == 0:
        import pandas as pd

        if args.csv:  # the model's view, from the α, β, γ fitted by the all-reduce part
            rows = predict_block_allreduces(rows, pd.read_csv(args.csv).iloc[0])
        frame = pd.DataFrame(rows)
        frame.to_csv(args.tp_csv, index=False)
        print(frame[["group", "tp", "nodes", "bytes_sent", "messages_sent", "forward_ms", "forward_min_ms",
                     "block_allreduces_ms"] + (["predicted_block_allreduces_ms"] if args.csv else [])]
              .to_string(index=False))


def emulate(args) -> int:
    """The same sweep on one machine's plain mpiexec, with EmulatedNetwork playing the link: its latency
    and bandwidth are the α, β fitted between the real nodes (read from --emulate-from)."""
    import pandas as pd

    from tplab.comm import world
    from tplab.lab.across_nodes import FLAT
    from tplab.lab.bench import sweep_on_emulated_network

    first = pd.read_csv(args.emulate_from).iloc[0]
    latency, bandwidth = first.inter_alpha_us * 1e-6, first.inter_GBps * 1e9
    rows = sweep_on_emulated_network("allreduce", list(FLAT) + ["hierarchical"], SIZES[args.first: args.first + args.points],
                                     ranks_per_node=int(first.ranks_per_node), latency=latency, bandwidth=bandwidth,
                                     iters=args.iters, warmup=1)
    if world().rank == 0:
        from tplab.toolkit.machine import cpu_model, mpi_library

        machine = (f"{cpu_model(short=True)}, {os.cpu_count()} cores, {mpi_library(short=True)}; one machine, "
                   f"{world().size} ranks, EmulatedNetwork; load average {os.getloadavg()[0]:.1f}")
        frame = pd.DataFrame(rows).assign(link=f"EmulatedNetwork: {latency * 1e6:.1f} us, {bandwidth / 1e9:.3f} GB/s "
                                               "per message between nodes, one link per rank", machine=machine)
        frame.to_csv(args.emulated_csv, index=False)
        print(frame.pivot(index="size", columns="algorithm", values="time_us").round(0).to_string())
    return 0


def around(args) -> int:
    """Bring the nodes up, run this script across them, bring them down (also after a failure)."""
    from tplab import nodes

    layout = nodes.up(nodes.Layout(nodes=args.nodes, ranks_per_node=args.ranks_per_node, rate=args.rate,
                                   latency=args.latency))
    try:
        print(layout.describe(), flush=True)
        link = layout.shaping().describe(layout.netem)
        program = [sys.executable, __file__, "--inside", "--link", link, "--iters", str(args.iters),
                   "--fit-iters", str(args.fit_iters), "--points", str(args.points), "--first", str(args.first)]
        program += ["--csv", str(Path(args.csv).resolve())] if args.csv else []
        program += ["--tp-csv", str(Path(args.tp_csv).resolve())] if args.tp_csv else []
        code = nodes.run_across(layout, program, timeout=args.timeout, env={"OMP_NUM_THREADS": "1"})[0]
    finally:
        nodes.down()
    if code == 0 and args.emulated_csv and args.csv:  # the same ranks on one machine, the link emulated
        program = [layout.mpiexec, "-n", str(layout.ranks), sys.executable, __file__, "--emulate-from",
                   str(Path(args.csv).resolve()), "--emulated-csv", str(Path(args.emulated_csv).resolve()),
                   "--iters", str(args.iters), "--points", str(args.points), "--first", str(args.first)]
        code = subprocess.run(program, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=args.timeout).returncode
    return code


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inside", action="store_true", help="measure (under an mpiexec across nodes)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--rate", default="1gbit", help="each node's outgoing rate (tc units)")
    parser.add_argument("--latency", default=None, help="added per-packet delay (needs netem in the kernel)")
    parser.add_argument("--link", default="", help="a description of the link, stored in every row")
    parser.add_argument("--iters", type=int, default=5, help="timed calls per point (median)")
    parser.add_argument("--fit-iters", type=int, default=30, help="iterations per size of the α-β-γ fits")
    parser.add_argument("--points", type=int, default=len(SIZES), help="how many sizes, from 16 B, 4x apart (0: TP only)")
    parser.add_argument("--first", type=int, default=0, help="skip this many of the smallest sizes")
    parser.add_argument("--csv", default=None)
    parser.add_argument("--tp-csv", default=None, help="also time a TP model split across the nodes, into this CSV")
    parser.add_argument("--emulated-csv", default=None, help="then the same sweep with EmulatedNetwork playing the "
                        "link (its α, β fitted between the nodes), on this machine's plain mpiexec, into this CSV")
    parser.add_argument("--emulate-from", default=None, help="(internal) the nodes' CSV to take α, β from")
    parser.add_argument("--timeout", type=int, default=900)
    arguments = parser.parse_args()
    sys.exit(emulate(arguments) if arguments.emulate_from else inside(arguments) if arguments.inside
             else around(arguments))
