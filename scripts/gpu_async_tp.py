"""Async tensor parallelism on GPUs: a bf16 transformer layer whose collectives move under its GEMMs
(tplab.overlap.async_tp, data moved by the copy engines), timed against the same layer computing alone,
NCCL's collectives alone, and the plain layer over NCCL (notebook 06).

    NCCL_NVLS_ENABLE=0 bash scripts/mpi_run.sh -n 4 python3 scripts/gpu_async_tp.py OUT_DIR [--layers 4]

One rank per GPU, the course project's layer (hidden 5120, 40 heads, sequence 4096, batch 4, a 4h GELU MLP,
bf16, causal), one block and a stack of ``--layers`` blocks. Every row is one variant, CUDA events around one
forward pass after a barrier, ``--warmup`` untimed passes, the median of ``--iters`` interleaved rounds,
the slowest rank's median (tplab.overlap.metrics.time_forwards):

    compute              the plain tensor-parallel layer with its collectives as no-ops (NullComm)
    nccl_comm            the layer's two all-reduces of (b, s, h) alone, torch.distributed (NCCL), back to back
    plain_nccl           the plain layer over torch.distributed: compute, then each all-reduce
    sequence_parallel    the same weights under sequence parallelism over NCCL (all-gather and reduce-scatter
                         instead of each all-reduce, LayerNorm on s/p tokens), not overlapped
    exchange_alone       the copy engines' two gathers and two scatters of the layer, without the GEMMs
                         (one peer at a time; ``_all_peers_at_once``: every peer's copy on its own stream)
    async_no_transfers   AsyncTPBlock(attention="by_query_rows") on a NullExchange: its smaller GEMMs, attention
                         by query blocks and reductions, with nothing moving (what the decomposition itself costs)
    async_tp             AsyncTPBlock(attention="by_query_rows"): the layer on sequence shards, every shard
                         moving under a GEMM, the attention cut by query rows (the names without
                         ``_whole_attention`` all cut it: they were measured before the whole attention became
                         AsyncTPBlock's default, and keep their meaning in data/)
    async_tp_all_peers_at_once  the same, every peer's copy at once (CopyEngineExchange(peers_at_once=p-1))
    async_tp_gemm_pushes the same, the partial sums written by the GEMMs straight into the peers' slots over
                         NVLink (CopyEngineExchange(pushes="gemm")); the gathers still by copy engines
    async_tp_kernel_barriers  the same as async_tp with one-block barrier kernels instead of stream operations
    compute_graph, async_tp_graph, plain_nccl_graph   (``--graphs``) compute, async_tp and plain_nccl, each a
                         CUDA graph's replay: the GPU's time with the host's queueing taken out
    async_tp_graph_kernel_barriers  (``--graphs``) async_tp_graph with barrier kernels
    async_tp_graph_all_peers_at_once  (``--graphs``) async_tp_graph with every peer's copy at once
    async_tp_graph_no_meetings  (``--graphs``) async_tp_graph with one barrier a call (graph_meetings=False: the
                         stack holds an even number of calls)
    async_tp_whole_attention, async_no_transfers_whole_attention  async_tp and async_no_transfers with the
                         attention in one call, only the output projection cut (AsyncTPBlock's default)
    async_tp_graph_whole_attention  (``--graphs``) async_tp_whole_attention as a graph, without meetings (compare
                         it with async_tp_graph_no_meetings)
    async_no_transfers_graph, exchange_alone_graph  (``--graphs``) async_no_transfers and exchange_alone (the
                         latter on an exchange of its own, without meetings) as graphs: a graph's cost taken apart

and, for the stack, ``hidden_fraction = 1 - (async_tp - compute) / nccl_comm``: the share of NCCL's
communication time that the async layer does not add to the compute. ``max_rel_diff``: the async layer's
output against the plain layer's rows, relative to its largest value (bf16 rounding: ~1e-2; a lost or
doubled partial: ~1). The host's time to queue one async pass is printed too (it must stay below the GPU's).

Writes OUT_DIR/async_tp_gpu_<p>x-<card>.csv (variant, layers, ms, ..., run: a rerun into the same folder adds its
rows with the next run number) and prints a summary. ``--clocks``: each
stack variant runs for 2 s while nvidia-smi samples SM clock and power (OUT_DIR/clocks.csv); ``--profile``: one pass
with and without transfers under torch.profiler (Chrome traces per rank, and where the compute stream's time
went), and the latency of one stream-operation barrier.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from gpu_overlap import Block  # noqa: E402  (the same bf16 tensor-parallel block notebook 06 measures)
from tplab.comm.torch_dist import TorchDistributedComm  # noqa: E402
from tplab.layers import mappings  # noqa: E402
from tplab.overlap import without_communication  # noqa: E402
from tplab.overlap.async_tp import AsyncTPBlock, my_rows  # noqa: E402
from tplab.comm.shard_exchange import NullExchange  # noqa: E402
from tplab.overlap.metrics import time_forwards  # noqa: E402

WORLD = MPI.COMM_WORLD
CUT = dict(attention="by_query_rows")   # the variants without _whole_attention in their name (docstring)


def sequence_parallel(blocks, on: bool):
    for block in blocks:
        block.attention.sequence_parallel = block.mlp.sequence_parallel = on


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4, help="blocks in the stack")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pieces", type=lambda v: [int(m) for m in v.split(",") if m], default=[],
                        help="also the stack with every copy in pieces of these many MiB (e.g. 4,16)")
    parser.add_argument("--blas", choices=["cublas", "cublaslt"], help="torch.backends.cuda.preferred_blas_library")
    parser.add_argument("--variants", default="", help="only these variants (comma-separated; default: all)")
    parser.add_argument("--graphs", action="store_true",
                        help="also the stack as CUDA graph replays: compute_graph, async_tp_graph (on an exchange of its "
                             "own; _kernel_barriers: with barrier kernels), plain_nccl_graph -- the host's queueing "
                             "taken out of them all")
    parser.add_argument("--host-profile", action="store_true",
                        help="also profile the host's queueing of one async pass (cProfile, rank 0 prints the top)")
    parser.add_argument("--clocks", action="store_true",
                        help="also run each stack variant for 2 s while nvidia-smi samples SM clock and power")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one pass of the stack with and without transfers (torch.profiler): "
                             "kernel time, copy time and the longest gaps of the compute stream, per rank 0")
    args = parser.parse_args()
    from tplab.gpu_collectives.copy_engine_exchange import CopyEngineExchange

    local = WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    torch.cuda.set_device(local)
    import cupy

    cupy.cuda.Device(local).use()
    device, dtype, p, r = torch.device("cuda", local), torch.bfloat16, WORLD.size, WORLD.rank
    if args.blas:      # which library torch's matmuls go through (cuBLASLt's kernels may memset a workspace first)
        torch.backends.cuda.preferred_blas_library(args.blas)
    nccl = TorchDistributedComm(device, in_place=True)
    card = torch.cuda.get_device_name(device)
    torch.manual_seed(0)
    with torch.device(device):
        blocks = [Block(args.hidden, args.heads, nccl, dtype) for _ in range(args.layers)]
        x = torch.randn(args.batch, args.seq, args.hidden, dtype=dtype)        # (b, s, h), the same everywhere
    x_rows = my_rows(x, r, p)                                                  # (s/p, b, h): mine
    exchange = CopyEngineExchange(WORLD, x_rows.numel() * x_rows.element_size())
    stack, fast = nn.Sequential(*blocks), nn.Sequential(*[AsyncTPBlock(b, exchange, **CUT) for b in blocks])
    kernel_barriers = CopyEngineExchange(WORLD, x_rows.numel() * x_rows.element_size(), barrier_kernels=True)
    by_kernels = nn.Sequential(*[AsyncTPBlock(b, kernel_barriers, **CUT) for b in blocks])
    all_at_once = CopyEngineExchange(WORLD, x_rows.numel() * x_rows.element_size(), peers_at_once=p - 1)
    by_all_at_once = nn.Sequential(*[AsyncTPBlock(b, all_at_once, **CUT) for b in blocks])
    gemm_pushes = CopyEngineExchange(WORLD, x_rows.numel() * x_rows.element_size(), pushes="gemm")
    pieces = {mib: CopyEngineExchange(WORLD, x_rows.numel() * x_rows.element_size(), piece_bytes=mib << 20)
              for mib in args.pieces}
    by_pieces = {mib: nn.Sequential(*[AsyncTPBlock(b, ex, **CUT) for b in blocks]) for mib, ex in pieces.items()}
    by_gemms = nn.Sequential(*[AsyncTPBlock(b, gemm_pushes, **CUT) for b in blocks])
    idle = NullExchange(r, p)
    still = nn.Sequential(*[AsyncTPBlock(b, idle, **CUT) for b in blocks])   # (nothing moves)
    whole = nn.Sequential(*[AsyncTPBlock(b, exchange, attention="whole") for b in blocks])
    still_whole = nn.Sequential(*[AsyncTPBlock(b, idle, attention="whole") for b in blocks])
    ar = torch.empty_like(x)

    def nccl_comm(layers):
        def run():
            for _ in range(2 * layers):
                dist.all_reduce(ar)
        return run

    def exchange_alone(layers, exchange=exchange):
        def run():
            for _ in range(2 * layers):
                gathered = exchange.start_gather(x_rows)
                scatter = exchange.start_scatter(x_rows)
                for q in gathered.order[1:]:
                    gathered.shard(q)
                    scatter.out_for(q)             # (what it holds moves: only the time counts here)
                    scatter.send(q)
                gathered.done()
                scatter.finish()
        return run

    def sp(model):
        def run():
            sequence_parallel(blocks, True)
            try:
                return model(x_rows)
            finally:
                sequence_parallel(blocks, False)
        return run

    def no_comm(model):
        def run():
            with without_communication(model):
                return model(x)
        return run

    rows, graphs = [], {}
    with torch.no_grad(), mappings.argument_checks_off():
        want = my_rows(blocks[0](x), r, p)                         # the check: one block, plain, over NCCL
        diffs = []
        for model in (fast[0], by_all_at_once[0], by_gemms[0], by_kernels[0], whole[0]):
            got = model(x_rows)
            torch.cuda.synchronize()
            diffs.append(((got.float() - want.float()).abs().max() / want.float().abs().max()).item())
        worst = max(WORLD.allgather(max(diffs)))
        started = time.perf_counter()
        fast(x_rows)
        queued = time.perf_counter() - started
        torch.cuda.synchronize()
        gpu = time.perf_counter() - started
        sizes = [(1, blocks[0], fast[0], still[0])] + [(args.layers, stack, fast, still)] * (args.layers > 1)
        for layers, model, async_model, no_transfers in sizes:          # (--layers 1: the block alone, once)
            forwards = {"compute": no_comm(model), "nccl_comm": nccl_comm(layers), "plain_nccl": lambda m=model: m(x),
                        "sequence_parallel": sp(model), "exchange_alone": exchange_alone(layers),
                        "async_no_transfers": lambda m=no_transfers: m(x_rows),
                        "async_tp": lambda m=async_model: m(x_rows)}
            forwards["exchange_alone_all_peers_at_once"] = exchange_alone(layers, all_at_once)
            forwards["async_tp_all_peers_at_once"] = lambda m=(by_all_at_once if layers > 1 else by_all_at_once[0]): m(x_rows)
            forwards["async_tp_gemm_pushes"] = lambda m=(by_gemms if layers > 1 else by_gemms[0]): m(x_rows)
            forwards["async_tp_whole_attention"] = lambda m=(whole if layers > 1 else whole[0]): m(x_rows)
            forwards["async_no_transfers_whole_attention"] = lambda m=(still_whole if layers > 1 else still_whole[0]): m(x_rows)
            if layers > 1:
                forwards["async_tp_kernel_barriers"] = lambda: by_kernels(x_rows)
                for mib, model in by_pieces.items():
                    forwards[f"async_tp_pieces_{mib}MiB"] = lambda m=model: m(x_rows)
            if layers > 1 and args.graphs:
                graphs = graphed_variants(stack, blocks, x, x_rows, no_comm, want_stack=my_rows(stack(x), r, p),
                                          still=still, exchange_alone=exchange_alone)
                forwards |= graphs
            if args.variants:
                forwards = {k: v for k, v in forwards.items() if k in args.variants.split(",")}
            times = time_forwards(forwards, nccl, iters=args.iters, warmup=args.warmup, cuda=True)
            rows += [{"variant": name, "layers": layers, "ms": seconds * 1e3} for name, seconds in times.items()]
        if args.host_profile:
            host_profile({"async_no_transfers": lambda: still(x_rows), "async_tp": lambda: fast(x_rows)}, r)
        if args.clocks:
            clocks = sample_clocks({"compute": no_comm(stack), "async_no_transfers": lambda: still(x_rows),
                                    "async_tp": lambda: fast(x_rows), "plain_nccl": lambda: stack(x)}, r)
            if r == 0:
                print(clocks.to_string())
                Path(args.out_dir).mkdir(parents=True, exist_ok=True)
                clocks.to_csv(Path(args.out_dir) / "clocks.csv", index=False)
        if args.profile:
            latency = barrier_latency(exchange)
            if r == 0:
                print(f"stream-operation barrier: {latency['idle']:.1f} us idle, {latency['busy']:.1f} us next to a GEMM")
            profiled = [("compute", no_comm(stack))]
            profiled += [(name, lambda m=model: m(x_rows)) for name, model in
                         [("async_no_transfers", still), ("async_tp", fast),
                          ("async_no_transfers_whole_attention", still_whole), ("async_tp_whole_attention", whole)]
                         + [(f"async_tp_pieces_{mib}MiB", model) for mib, model in by_pieces.items()]]
            for name, forward in profiled:
                profile(name, forward, Path(args.out_dir), r)
            for name in ("compute_graph", "async_no_transfers_graph", "async_tp_graph"):
                if name in graphs:                       # (--graphs, and a stack of more than one layer)
                    profile(name, graphs[name], Path(args.out_dir), r)
    if r == 0:
        software = f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
        df = pd.DataFrame(rows)
        df["ms_per_layer"] = df["ms"] / df["layers"]
        for column, value in [("ranks", p), ("card", card), ("tokens", args.batch * args.seq), ("hidden", args.hidden),
                              ("heads", args.heads), ("dtype", "bfloat16"), ("iters", args.iters),
                              ("max_rel_diff", worst), ("software", software)]:
            df[column] = value
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        slug = re.sub(r"[^a-z0-9]+", "-", card.lower()).strip("-")
        path = out / f"async_tp_gpu_{p}x-{slug}.csv"
        df["run"] = 1
        if path.exists():   # every run is kept, numbered (column run): a rerun into the same folder adds to it
            before = pd.read_csv(path)
            if "run" not in before:
                before["run"] = 1
            df["run"] = int(before["run"].max()) + 1
            pd.concat([before, df], ignore_index=True).to_csv(path, index=False)
        else:
            df.to_csv(path, index=False)
        print(f"{p}x {card}: async layer vs plain rows max_rel_diff {worst:.2e}; host queues the stack in "
              f"{queued * 1e3:.1f} ms, the GPU runs it in {gpu * 1e3:.1f} ms")
        print(df.pivot(index="variant", columns="layers", values="ms_per_layer").round(3).to_string())
        stack_rows = df[df.layers == args.layers].set_index("variant")["ms_per_layer"]
        pairs = [("compute", "async_tp"), ("compute", "async_tp_whole_attention"),
                 ("compute_graph", "async_tp_graph"), ("compute_graph", "async_tp_graph_no_meetings"),
                 ("compute_graph", "async_tp_graph_whole_attention")]
        for compute, layer in pairs:     # hidden: 1 - (what the layer adds to the compute) / NCCL's time alone
            if {compute, layer, "nccl_comm"} <= set(stack_rows.index):
                exposed = stack_rows[layer] - stack_rows[compute]
                print(f"per layer of the stack: {compute} {stack_rows[compute]:.3f} ms, {layer} "
                      f"{stack_rows[layer]:.3f} ms, NCCL comm alone {stack_rows['nccl_comm']:.3f} ms -> hidden "
                      f"{1 - exposed / stack_rows['nccl_comm']:.1%}")


def graphed_variants(stack, blocks, x, x_rows, no_comm, want_stack, still, exchange_alone):
    """The stack captured into CUDA graphs (tplab.overlap.metrics.captured): the compute alone, the decomposed
    layer with nothing moving, the exchange alone (no meetings, on an exchange of its own), the async layer
    on exchanges of its own (replayable stream barriers; barrier kernels), and the plain layer over NCCL. A
    replay queues a whole pass at once, so each is the GPU's time, not the host's. Checks each async graph's
    output against the plain stack's rows (bf16 rounding)."""
    from tplab.gpu_collectives.copy_engine_exchange import CopyEngineExchange
    from tplab.overlap.metrics import captured

    graphs = {"compute_graph": captured(no_comm(stack)), "plain_nccl_graph": captured(lambda: stack(x)),
              "async_no_transfers_graph": captured(lambda: still(x_rows))}
    alone = CopyEngineExchange(WORLD, x_rows.numel() * x_rows.element_size(), graph_meetings=False)
    exchange_alone(len(blocks), alone)()                 # eager first: the scatter area is made outside a capture
    graphs["exchange_alone_graph"] = captured(exchange_alone(len(blocks), alone))
    variants = {"async_tp_graph": {}, "async_tp_graph_kernel_barriers": dict(barrier_kernels=True),
                "async_tp_graph_all_peers_at_once": dict(peers_at_once=WORLD.size - 1),
                "async_tp_graph_no_meetings": dict(graph_meetings=False),
                "async_tp_graph_whole_attention": dict(graph_meetings=False, attention="whole")}
    for name, options in variants.items():
        attention = options.pop("attention", CUT["attention"])
        exchange = CopyEngineExchange(WORLD, x_rows.numel() * x_rows.element_size(), **options)
        fast = nn.Sequential(*[AsyncTPBlock(b, exchange, attention=attention) for b in blocks])
        fast(x_rows)                                     # eager first: the scatter area is made outside a capture
        graphs[name] = captured(lambda fast=fast: fast(x_rows))
        got = graphs[name]().float()
        torch.cuda.synchronize()
        diff = ((got - want_stack.float()).abs().max() / want_stack.float().abs().max()).item()
        worst = max(WORLD.allgather(diff))
        if WORLD.rank == 0:
            print(f"{name}: the stack's rows against the plain stack's, max_rel_diff {worst:.2e}")
        if worst > 0.05:
            raise RuntimeError(f"{name} differs from the plain stack by {worst:.2e} (bf16 rounding: ~1e-2)")
    return graphs


def profile(name, forward, out: Path, rank: int) -> None:
    """One pass under torch.profiler (every rank: the passes are collective); rank 0 prints where the compute
    stream's time went: kernels, idle gaps (waits on the copies or the barriers) and the longest gaps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(2):
        forward()
    torch.cuda.synchronize()
    WORLD.Barrier()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward()        # (two passes: the summary reads the second, past the ranks' start-up skew)
        forward()
        torch.cuda.synchronize()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"trace_{name}_rank{rank}.json"
    prof.export_chrome_trace(str(path))
    for turn in range(WORLD.size):   # (each rank prints its own, in turn)
        WORLD.Barrier()
        if turn == rank:
            summarize(name, path, prof, rank)
            sys.stdout.flush()
    WORLD.Barrier()


def summarize(name, path, prof, rank):
    import json

    events = [e for e in json.loads(path.read_text())["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    streams = {}
    for e in events:
        streams.setdefault(e["args"].get("stream"), []).append(e)
    busy = {sid: sum(e["dur"] for e in evs if e["cat"] == "kernel") for sid, evs in streams.items()}
    main_stream = max(busy, key=busy.get)
    kernels = sorted(streams[main_stream], key=lambda e: e["ts"])
    kernels = kernels[len(kernels) // 2:]                       # the second pass
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    busy[main_stream] = sum(e["dur"] for e in kernels if e["cat"] == "kernel")
    before_copy_work = sum(b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(kernels, kernels[1:])
                           if b["cat"] != "kernel")   # (a memset or copy of the compute stream, waiting for an engine)
    gaps = sorted(((b["ts"] - (a["ts"] + a["dur"]), a["name"][:50], b["name"][:50]) for a, b in zip(kernels, kernels[1:])),
                  reverse=True)
    copies = {sid: sum(e["dur"] for e in evs if e["cat"] == "gpu_memcpy") for sid, evs in streams.items()}
    memsets = sum(1 for e in kernels if e["cat"] == "gpu_memset")
    print(f"\nrank {rank}, {name}: {memsets} memsets in the pass; compute stream {main_stream}: span {span / 1e3:.3f} ms, "
          f"kernels {busy[main_stream] / 1e3:.3f} ms, idle {(span - busy[main_stream]) / 1e3:.3f} ms; "
          f"(before its memsets and copies: {before_copy_work / 1e3:.3f} ms); copies per stream (ms): "
          f"{ {sid: round(c / 1e3, 3) for sid, c in copies.items() if c} }")
    for gap, before, after in gaps[:8]:
        print(f"  gap {gap / 1e3:.3f} ms  after {before}  before {after}")
    by_name = {}   # every stream's kernels of the second pass, by name: what ran, how often, for how long
    for e in events:
        if e["cat"] == "kernel" and e["ts"] >= kernels[0]["ts"]:
            count, total = by_name.get(e["name"][:70], (0, 0.0))
            by_name[e["name"][:70]] = (count + 1, total + e["dur"])
    for kernel, (count, total) in sorted(by_name.items(), key=lambda item: -item[1][1])[:6]:
        print(f"  {total / 1e3:7.3f} ms in {count:3d} x {kernel}")


def host_profile(forwards, rank, top=25):
    """Where the host's time goes while it queues one pass (cProfile, every rank: the passes are collective;
    rank 0 prints its own): the GPU idles wherever the host falls behind it."""
    import cProfile
    import io
    import pstats

    for name, forward in forwards.items():
        forward()
        torch.cuda.synchronize()
        WORLD.Barrier()
        profiler = cProfile.Profile()
        started = time.perf_counter()
        profiler.enable()
        forward()
        profiler.disable()
        queued = time.perf_counter() - started
        torch.cuda.synchronize()
        gpu = time.perf_counter() - started
        if rank == 0:
            stats = pstats.Stats(profiler, stream=io.StringIO()).stats   # {(file, line, name): (cc, nc, tt, ct, callers)}
            rows = sorted(((tt, ct, nc, f"{Path(file).name}:{line}({fn})") for (file, line, fn), (_, nc, tt, ct, _)
                           in stats.items()), reverse=True)[:top]
            print(f"\nhost profile, {name}: queued in {queued * 1e3:.1f} ms (under cProfile), GPU done after "
                  f"{gpu * 1e3:.1f} ms; own time, time with callees (ms), calls, us per call:")
            for tt, ct, nc, where in rows:
                print(f"  {tt * 1e3:7.3f} {ct * 1e3:7.3f} {nc:5d} {tt / nc * 1e6:8.1f}  {where}")
        WORLD.Barrier()


def sample_clocks(forwards, rank, seconds=2.0):
    """Each variant run back to back for ``seconds`` while nvidia-smi samples every GPU's SM clock and power
    every 50 ms: a GPU at its power limit lowers its clocks, and moving bytes over NVLink draws power too.
    Returns (rank 0) the median SM clock (MHz) and power (W) per variant and GPU."""
    import subprocess

    samples = None
    if rank == 0:
        samples = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,index,clocks.sm,power.draw",
                                    "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
    windows = {}
    for name, forward in forwards.items():
        torch.cuda.synchronize()
        WORLD.Barrier()
        started, runs = time.time(), 0
        while WORLD.allreduce(time.time() - started < seconds, op=MPI.LAND):  # (every rank runs as many)
            forward()
            runs += 1
        torch.cuda.synchronize()
        windows[name] = (started + 0.5, time.time())       # (the first half second: clocks still settling)
    if rank != 0:
        return None
    samples.terminate()
    rows = []
    for line in samples.communicate()[0].splitlines():
        try:
            stamp, gpu, clock, power = [v.strip() for v in line.split(",")]
            when = time.mktime(time.strptime(stamp.split(".")[0], "%Y/%m/%d %H:%M:%S")) + float("0." + stamp.split(".")[1])
        except ValueError:
            continue
        for name, (a, b) in windows.items():
            if a <= when <= b:
                rows.append({"variant": name, "gpu": int(gpu), "sm_clock_mhz": float(clock), "power_w": float(power)})
    return pd.DataFrame(rows).groupby(["variant", "gpu"]).median().reset_index()


def barrier_latency(exchange, iters=50):
    """Microseconds per stream-memory-operation barrier (the exchange's scatter barrier) queued back to back:
    on an idle GPU, and while a long GEMM runs on another stream (the slowest rank's median of 5 loops)."""
    import statistics

    from tplab.gpu_collectives.copy_engine_exchange import _cupy_stream

    if exchange.scatter_barriers is None:   # (made with the scatter area, by the exchange's first scatter)
        raise RuntimeError("barrier_latency: run an async-TP block on this exchange first")
    results = {}
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    for busy in (False, True):
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            WORLD.Barrier()
            if busy:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(20):
                        a @ a
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                exchange.scatter_barriers.queue(_cupy_stream(torch.cuda.current_stream()))
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / iters)
        results["busy" if busy else "idle"] = max(WORLD.allgather(statistics.median(times)))
    torch.cuda.synchronize()
    return results


if __name__ == "__main__":
    main()
