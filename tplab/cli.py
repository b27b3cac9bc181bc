"""The ``tplab`` command.

    tplab info                       versions, MPI library, GPUs
    tplab demo --ranks 4 --out build start a local MPI cluster, execute the notebooks, summarise, stop
    tplab doctor [--clean]           clusters, engines and /dev/shm files here, their owners and liveness;
                                     --clean removes those provably tplab's and orphaned
    mpiexec -n 4 tplab bench allreduce --algorithms ring,recursive_doubling,builtin -b 8 -e 64M -f 2
                                     time collectives (nccl-tests-like flags and columns)
    mpiexec -n 4 tplab bench allreduce --device gpu --peer-memory 256M -b 1K -e 256M -f 4 \
        -a builtin,ring,peer_one_shot_ll,peer_one_shot,peer_two_shot,peer_ring,auto
                                     the same on a GPU node: one rank per GPU, NCCL as the built-in, and
                                     the peer-memory kernels (tplab.gpu_collectives.peer_memory) next to it
    mpiexec -n 4 tplab bench allreduce --device gpu --peer-memory 64M -b 1K -e 4M -f 4 --graph \
        -a peer_one_shot,peer_registered,nccl,symm_mem_one_shot,symm_mem_two_shot
                                     from CUDA graphs, next to the anchors (tplab.lab.anchors: NCCL,
                                     NCCL's symmetric kernels, torch's symmetric-memory all-reduces);
                                     peer_registered: tplab on an input already in its shared buffer
    tplab nodes up --nodes 2 --ranks-per-node 2 --rate 10gbit --latency 20us
    tplab nodes run -- python -m pytest tests/mpi/test_hierarchical.py
    tplab nodes ipcluster -n 4 | login -- CMD | status | down
                                     several nodes on this machine (network namespaces, root): tplab.nodes
"""

from __future__ import annotations

import argparse
import sys


def cmd_info(args) -> int:
    import platform

    import numpy

    import tplab

    print(f"tplab {tplab.__version__}, Python {platform.python_version()}, numpy {numpy.__version__}")
    try:
        from tplab.toolkit.machine import mpi_library

        print(f"mpi4py {__import__('mpi4py').__version__}; {mpi_library()}")
    except Exception as e:  # noqa: BLE001 - report, don't fail: info is a diagnostic
        print(f"mpi4py: not usable ({e})")
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"torch {torch.__version__}; CUDA GPUs: {gpus}")
    except ImportError:
        print("torch: not installed")
    return 0


def cmd_demo(args) -> int:
    from tplab.lab.demo import run_demo

    return run_demo(ranks=args.ranks, out=args.out, notebooks=args.notebooks, timeout=args.timeout)


def cmd_doctor(args) -> int:
    from tplab.cluster.doctor import clean, examine, format_report

    report = examine()
    print(format_report(report))
    if args.clean:
        done = clean(report)
        print("\n".join(done) if done else "nothing to clean")
    return 0


def parse_size(text: str) -> int:
    """'8', '64K', '64M', '1G' -> bytes (powers of 1024, as nccl-tests reads them)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text and text[-1] in units else int(text)


# --peer-memory: one kernel each, by name
PEER_KERNELS = ("peer_one_shot_ll", "peer_one_shot_lamport", "peer_one_shot", "peer_two_shot_lamport", "peer_two_shot",
                "peer_ring")


def cmd_bench(args) -> int:
    import tplab
    from tplab.comm import communicator
    from tplab.lab.bench import REGISTERED, sweep

    from tplab.lab import anchors

    comm = communicator(args.device)            # host MPI, or NCCL on each rank's GPU
    nccl = comm
    known = list(tplab.ALGORITHMS[args.collective])
    gpu_allreduce = args.device == "gpu" and args.collective == "allreduce"
    if args.peer_memory and gpu_allreduce:
        from tplab.gpu_collectives import PeerMemoryComm

        comm = PeerMemoryComm(nccl, args.peer_memory)   # "auto": the peer-memory kernels, by size
        known += list(PEER_KERNELS) + [REGISTERED]
    known += list(anchors.ANCHORS) if gpu_allreduce else []
    default = [a for a in known if a != "auto" and a not in anchors.ANCHORS]
    algorithms = args.algorithms.split(",") if args.algorithms else default
    unknown = [a for a in algorithms if a not in known]
    graph_only = set(PEER_KERNELS) | set(anchors.ANCHORS) | ({"auto", REGISTERED} if args.peer_memory else set())
    problem = None
    if unknown:
        hint = " (peer_* need --device gpu --peer-memory SIZE)" if any(a.startswith("peer_") for a in unknown) else ""
        problem = f"unknown {args.collective} algorithms {unknown}; choose from {known}{hint}"
    elif args.graph and (args.device != "gpu" or set(algorithms) - graph_only):
        problem = (f"--graph times what a CUDA graph can hold, on GPUs: {sorted(graph_only)} "
                   f"(not {sorted(set(algorithms) - graph_only)}: they need the host inside the call)")
    elif {a for a in algorithms if a in anchors.ANCHORS}:
        problem = anchors.unavailable([a for a in algorithms if a in anchors.ANCHORS])
    if problem:
        if comm.rank == 0:
            print(f"tplab bench: {problem}", file=sys.stderr)
        return 2
    if any(a in anchors.ANCHORS for a in algorithms):
        anchors.start(algorithms, comm.device)
    sizes, size = [], args.minbytes
    while size <= args.maxbytes:
        sizes.append(size)
        size = size * args.stepfactor if args.stepfactor > 1 else size + args.stepbytes
    options = dict(dtype=args.datatype, op=args.op, iters=args.iters, warmup=args.warmup_iters, osu=args.osu,
                   validate=args.check, csv_path=args.csv, extra={"machine": args.machine or ""}, progress=True,
                   device=args.device, graph=args.graph)
    rows = []
    for name in algorithms:
        if name in PEER_KERNELS:  # builtin on peer memory with that kernel (one_shot only up to its buffer)
            comm.kernel = name.removeprefix("peer_")
            fits = [s for s in sizes if s <= comm.peers.limit(comm.kernel)]
            rows += sweep(args.collective, ["builtin"], fits, comm=comm, label=name, **options)
            comm.kernel = "auto"
        elif name == REGISTERED:  # (the shared buffer holds the input: up to its size)
            fits = [s for s in sizes if s <= comm.peers.nbytes]
            rows += sweep(args.collective, [name], fits, comm=comm, **options)
        else:  # "builtin" is NCCL's where peer memory is attached: the anchor
            rows += sweep(args.collective, [name], sizes, comm=nccl if name == "builtin" else comm, **options)
    if comm.rank == 0:
        print(format_table(rows, osu=args.osu))
    if any(a in anchors.ANCHORS for a in algorithms):
        anchors.stop()
    return 0 if all(int(r["wrong"]) <= 0 for r in rows) else 1


def format_table(rows, osu=False) -> str:
    """nccl-tests' columns (out-of-place only: tplab's collectives return new arrays), or OSU's."""
    if osu:
        lines = [f"# {'Size':>10} {'algorithm':>20} {'Avg Latency(us)':>16} {'Min Latency(us)':>16} "
                 f"{'Max Latency(us)':>16} {'Iterations':>10}"]
        lines += [f"  {r['size']:>10} {r['algorithm']:>20} {r['time_us']:>16.2f} {r['min_us']:>16.2f} "
                  f"{r['max_us']:>16.2f} {r['iters']:>10}" for r in rows]
        return "\n".join(lines)
    lines = [f"# {rows[0]['collective']} on {rows[0]['ranks']} ranks" if rows else "# nothing measured",
             f"# {'size':>10} {'count':>10} {'type':>8} {'redop':>6} {'algorithm':>20} {'time':>10} "
             f"{'algbw':>8} {'busbw':>8} {'#wrong':>7}",
             f"# {'(B)':>10} {'(elements)':>10} {'':>8} {'':>6} {'':>20} {'(us)':>10} {'(GB/s)':>8} "
             f"{'(GB/s)':>8} {'':>7}"]
    for r in rows:
        lines.append(f"  {r['size']:>10} {r['count']:>10} {r['type']:>8} {r['redop']:>6} {r['algorithm']:>20} "
                     f"{r['time_us']:>10.2f} {r['algbw']:>8.3f} {r['busbw']:>8.3f} {r['wrong']:>7}")
    return "\n".join(lines)


def cmd_nodes(args) -> int:
    import subprocess

    from tplab import nodes

    try:
        if args.action == "up":
            layout = nodes.up(nodes.Layout(nodes=args.nodes, ranks_per_node=args.ranks_per_node, subnet=args.subnet,
                                           rate=args.rate or None, latency=args.latency or None))
            print(f"up: {layout.describe()}\nhostfile {layout.hostfile}\n"
                  f"run across them: tplab nodes run -- python your_script.py")
        elif args.action == "down":
            removed = nodes.down()
            print(f"down: removed {', '.join(removed)}" if removed else "down: no tplab nodes were up")
        elif args.action == "status":
            print(nodes.status())
        elif args.action == "ipcluster":
            layout = nodes.current()
            full = nodes.ipcluster_command(layout, engines=args.ranks, cluster_id=args.cluster_id)
            # a cluster of that id left by earlier nodes (down ended its processes) would block the start
            stop = [*full[:full.index("start")], "stop", f"--cluster-id={args.cluster_id}"]
            subprocess.run(stop, capture_output=True, timeout=60)
            print("+ " + " ".join(full), file=sys.stderr, flush=True)
            code = subprocess.run(full).returncode
            if code == 0:
                print(f"connect from node 0: tplab nodes login -- python -c \"import tplab.cluster as c; "
                      f"print(c.connect('{args.cluster_id}', n={args.ranks or layout.ranks}).run_df(c.engine_rank))\"\n"
                      f"stop: tplab nodes login -- ipcluster stop --cluster-id={args.cluster_id} (or tplab nodes down)")
            return code
        else:  # run, login
            command = args.command
            if not command:
                print(f"tplab nodes {args.action}: give the program, e.g. tplab nodes {args.action} -- python try.py",
                      file=sys.stderr)
                return 2
            layout = nodes.current()
            full = (nodes.mpiexec_command(layout, ranks=args.ranks) if args.action == "run"
                    else nodes.in_login_node(layout)) + command
            print("+ " + " ".join(full), file=sys.stderr, flush=True)
            return subprocess.run(full).returncode
    except (nodes.NodesError, ValueError) as e:
        print(f"tplab nodes {args.action}: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tplab", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions, MPI library and GPUs")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("demo", help="execute the notebooks on a local MPI cluster into an output folder")
    p.add_argument("--ranks", "-n", type=int, default=4, help="MPI engines (default 4)")
    p.add_argument("--out", default="build", help="output folder (default build/)")
    p.add_argument("--notebooks", nargs="*", default=None, help="notebooks to run (default: all)")
    p.add_argument("--timeout", type=int, default=900, help="seconds per cell (default 900)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("doctor", help="clusters, engines and shared-memory files on this machine, and their owners")
    p.add_argument("--clean", action="store_true",
                   help="stop orphaned tplab clusters and remove their /dev/shm files (nothing else)")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("bench", help="time collectives on the ranks of this MPI job (run under mpiexec)")
    p.add_argument("collective", choices=["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"])
    p.add_argument("--algorithms", "-a", default=None, help="comma-separated (default: all but auto)")
    p.add_argument("-b", "--minbytes", type=parse_size, default=8, help="smallest size per rank (8, 1K, 1M)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=1 << 20, help="largest size per rank")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="multiply the size by this each step")
    p.add_argument("-i", "--stepbytes", type=parse_size, default=1 << 20, help="add this when -f is 1")
    p.add_argument("-n", "--iters", type=int, default=None,
                   help="timed iterations per point (median; default 20, or OSU's counts with --osu)")
    p.add_argument("-w", "--warmup-iters", type=int, default=3, help="untimed iterations first")
    p.add_argument("-d", "--datatype", default="float32")
    p.add_argument("-o", "--op", default="sum")
    p.add_argument("--csv", default=None, help="append each point to this CSV; a rerun skips points already there")
    p.add_argument("--osu", action="store_true", help="OSU latency mode: average latency, OSU's iteration counts")
    p.add_argument("--no-check", dest="check", action="store_false", help="skip validation (#wrong = -1)")
    p.add_argument("--graph", action="store_true",
                   help="GPU: time -n calls replayed from one CUDA graph (the GPU's own time, no host launches)")
    p.add_argument("--machine", default=None, help="a description of the machine, stored in every row")
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"],
                   help="gpu: one rank per GPU (bound by node-local rank), arrays on the GPU, NCCL as the built-in")
    p.add_argument("--peer-memory", type=parse_size, default=0,
                   help="GPU all-reduce on a PeerMemoryComm with buffers of this size per rank (enables "
                        "peer_one_shot_ll, peer_one_shot_lamport, peer_one_shot, peer_two_shot_lamport, peer_two_shot, "
                        "peer_ring; auto picks "
                        "among them by size; "
                        "peer_registered: auto on an input already in the shared buffer, in place)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("nodes", help="several nodes on this machine: network namespaces joined by a shaped link "
                                     "(root, iproute2), MPI across them with mpiexec and a hostfile")
    p.add_argument("action", choices=["up", "down", "status", "run", "login", "ipcluster"],
                   help="run: the program on every rank (mpiexec across the nodes); login: a command on node 0; "
                        "ipcluster: an ipyparallel cluster with engines on every node")
    p.add_argument("--nodes", type=int, default=2, help="up: how many nodes (default 2)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="up: MPI slots per node in the hostfile (default 2)")
    p.add_argument("--rate", default="10gbit", help="up: each node's outgoing rate, tc units (default 10gbit; '' = unshaped)")
    p.add_argument("--latency", default="", help="up: added delay per packet, e.g. 20us (needs the kernel's netem)")
    p.add_argument("--subnet", default="10.213.0.0/24", help="up: private subnet inside the namespaces")
    p.add_argument("-n", "--ranks", type=int, default=None, help="run, ipcluster: MPI ranks (default: every slot)")
    p.add_argument("--cluster-id", default="multi",
                   help="ipcluster: the cluster's id (default multi; one of that id is stopped first)")
    p.add_argument("command", nargs="*", help="run: the program and its arguments, after --")
    p.set_defaults(func=cmd_nodes)

    argv = list(sys.argv[1:] if argv is None else argv)
    program = []  # `tplab nodes run -- PROGRAM ...`: everything after -- is the program's, options included
    if argv[:2] in (["nodes", "run"], ["nodes", "login"]) and "--" in argv:
        argv, program = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    args = parser.parse_args(argv)
    if program:
        args.command = args.command + program
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
