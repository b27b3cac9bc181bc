"""Communication/computation overlap of a bf16 tensor-parallel transformer layer on GPUs (notebook 06).

    NCCL_NVLS_ENABLE=0 mpiexec -n 4 python scripts/gpu_overlap.py [OUT_DIR]     # default build/gpu
    NCCL_NVLS_ENABLE=0 CUDA_DEVICE_MAX_CONNECTIONS=1 mpiexec -n 4 python scripts/gpu_overlap.py OUT_DIR
    (Open MPI passes environment variables on with -x: mpiexec -x CUDA_DEVICE_MAX_CONNECTIONS=1 -x NCCL_NVLS_ENABLE=0 ...)

One rank per GPU. The course project's configuration: hidden 5120, 40 heads, sequence 4096, batch 4, bf16, a
4h GELU MLP, at p = 4: the block (LayerNorm, attention, LayerNorm, MLP, residuals; 2 all-reduces of
b·s·h·2 B = 160 MiB each), its MLP and attention alone, and the MLP under sequence parallelism (all-gather
of chunk i+1 and reduce-scatter of chunk i-1 while chunk i computes). For each (tplab.overlap.metrics):

    compute_ms          the layer with its collectives as no-ops (NullComm)
    comm_ms             the layer's collectives alone, back to back (standalone communication)
    no_overlap_ms       the layer as it is: compute, then all-reduce, on one stream
    overlapped_ms       chunked into k pieces (k = 1, 2, 4, 8; layer "block_mb": k micro-batches of the
                        batch instead of blocks of the sequence, QKV included; layer "stack_mb": a stack of
                        --stack-layers blocks in micro-batches, overlapping across layers too -- its times
                        are the stack's, column `layers` says how many): chunk i's all-reduce on a side CUDA
                        stream (event: "chunk i ready"; the compute stream waits on "all-reduce i done"
                        only where it uses the result) while chunk i+1 is computed
    exposed_ms          overlapped_ms - compute_ms;  hidden_fraction = 1 - exposed / comm_ms

Knobs recorded in every row: `--tails` (the block's last MLP cut into t pieces, column `tail`),
`--sm-carveouts` (cuBLAS asked to leave n multiprocessors to the communication kernels while the
overlapped layer runs -- torch._C._set_sm_carveout_experimental; the baselines run without it; column
`gemm_sm_carveout`), `--peer-blocks` (grid of the "tplab peer" kernels; one path per value), and NCCL's own
environment (NCCL_MAX_CTAS, NCCL_MIN_CTAS, TORCH_NCCL_HIGH_PRIORITY: column `nccl_env`). `--tag` goes into
the file name, so that launches with different environments keep their own CSV. `--graphs` times every
variant (the plain layer too) as a CUDA graph replay (column `cuda_graph`): chunked, a layer is so many
Python calls that the host falls behind the GPU; `--profile` only prints that (host queueing time against
GPU time) and torch.profiler's table. Every row checks the timed overlapped layer against the plain one
(`max_rel_diff`, relative to the output's largest value: bf16 rounding is ~1e-2, a lost or doubled
all-reduce ~1).

Times: CUDA events around each forward pass, after a barrier; `--warmup` untimed passes, the median of
`--iters`, the slowest rank's median. Two communication paths, each row says which (`path`):

    torch.distributed   NCCL's own all-reduce (ProcessGroupNCCL; init from the MPI rank and size,
                        MASTER_ADDR=127.0.0.1 and a free port chosen by rank 0, broadcast over MPI)
    tplab ring / NCCL   tplab's hand-written ring over NCCL send/recv (tplab.comm.nccl.nccl_world()),
                        if it imports and starts here (skipped with the reason printed otherwise)

CUDA_DEVICE_MAX_CONNECTIONS is read from the environment (it must be set before CUDA starts) and recorded.
It is the number of hardware queues the GPU's streams are mapped onto (default 8). With 1, every kernel
enters one queue in the order the host launched it: the all-reduce kernel of chunk i, launched before
chunk i+1's GEMM, is certain to start first and take its SMs; with 8, the scheduler may start the big GEMM
first and let it fill the GPU, so the communication kernel waits and less is hidden. Megatron-LM sets it to
1 for its overlapped tensor parallelism. Run the script twice (unset and =1) and compare.

Outputs in OUT_DIR: overlap_gpu-<card>-x<p>_cdmc-<value>.csv (one row per layer, path and k, with a
`machine` column naming the card), a timeline of the block at k=4 as Chrome trace JSON and PNG (CUDA events
on the compute and the communication stream), and a summary printed by rank 0. The target (notebook 06): the
block's exposed communication <= 25% of its standalone communication (hidden_fraction >= 0.75) for some k.

`--device cpu` runs the same measurement on CPU ranks in float32, through tplab's MPI communicator and its
progress threads (path "tplab MPI"), at a small default size (hidden 512, 8 heads, sequence 256, batch 2),
and writes overlap_cpu-<cpu>_<p>-ranks_<mpi>.csv: the CPU reference of data/ comes from

    OMP_NUM_THREADS=1 mpiexec -n 4 python scripts/gpu_overlap.py data/ --device cpu --layers block,mlp
"""

from __future__ import annotations

import argparse
import os
from functools import partial
import re
import sys
import time
import warnings
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tplab.comm.torch_dist import TorchDistributedComm  # noqa: E402
from tplab.layers import ColumnParallelLinear, ParallelAttention, ParallelMLP, RowParallelLinear  # noqa: E402
from tplab.overlap import Tracer, overlap_sweep, overlapped, pipeline_model, with_comm, write_chrome_trace  # noqa: E402
from tplab.overlap import progress_thread  # noqa: E402
from tplab.toolkit.machine import cpu_model, mpi_library  # noqa: E402

BUILD_GPU = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "gpu")  # git-ignored

WORLD = MPI.COMM_WORLD
# torch 2.13 renames all_gather_into_tensor / reduce_scatter_tensor (the GPU image's torch 2.11 has only these)
warnings.filterwarnings("ignore", category=FutureWarning, message=".*(all_gather_into_tensor|reduce_scatter_tensor)")


class Block(nn.Module):
    """A tensor-parallel transformer block (pre-norm GPT): x + attention(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, hidden, heads, comm, dtype):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden, dtype=dtype), nn.LayerNorm(hidden, dtype=dtype)
        self.attention = ParallelAttention(hidden, heads, comm, bias=True, dtype=dtype)
        self.mlp = ParallelMLP(ColumnParallelLinear(hidden, 4 * hidden, comm, dtype=dtype),
                               RowParallelLinear(4 * hidden, hidden, comm, dtype=dtype))

    def forward(self, x, cache=None):
        x = x + self.attention(self.norm1(x), cache)
        return x + self.mlp(self.norm2(x))


class WithSMCarveout(nn.Module):
    """``layer`` with cuBLAS's matmuls told to leave ``sms`` multiprocessors free while it runs: a GEMM sized
    for all 132 SMs stalls on its last wave when a communication kernel holds some of them."""

    def __init__(self, layer, sms: int):
        super().__init__()
        self.layer, self.sms = layer, sms

    def forward(self, x):
        torch._C._set_sm_carveout_experimental(self.sms)
        try:
            return self.layer(x)
        finally:
            torch._C._set_sm_carveout_experimental(None)


def with_sm_carveout(layer, sms: int):
    return WithSMCarveout(layer, sms) if sms else layer


def sm_carveouts(values: str) -> list[int]:
    """The carveouts asked for, those above 0 only where this torch can set them (it says which it skipped)."""
    asked = [int(v) for v in values.split(",")]
    if hasattr(torch._C, "_set_sm_carveout_experimental"):
        return asked
    if WORLD.rank == 0 and any(asked):
        print(f"torch {torch.__version__} cannot set an SM carveout: only carveout 0 is measured", flush=True)
    return [v for v in asked if v == 0] or [0]


def machine_name(device) -> str:
    if device.type == "cuda":
        card = torch.cuda.get_device_name(device)
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        return f"{WORLD.size}x {card}, torch {torch.__version__}, NCCL {nccl}"
    return (f"{WORLD.size} MPI ranks on a {os.cpu_count()}-core {cpu_model(short=True)} ({mpi_library(short=True)}), "
            f"torch {torch.__version__}, {torch.get_num_threads()} thread(s) per rank")


def slug(text) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def tplab_nccl_comm():
    """tplab.comm.nccl.nccl_world(), or (None, why not)."""
    try:
        from tplab.comm.nccl import nccl_world

        return nccl_world(), ""
    except Exception as e:  # noqa: BLE001 - reported, and those rows skipped
        return None, f"{type(e).__name__}: {e}"


def tplab_gpu_paths(names: str, peer_blocks: str, nbytes: int) -> dict:
    """tplab's GPU all-reduces named in ``names`` (a comma-separated list), for messages up to ``nbytes``:
    "tplab copy engine", "tplab peer" (one per grid size in ``peer_blocks``), "tplab ring" (over NCCL)."""
    paths = {}
    if "tplab copy engine" in names:  # bytes moved by copy engines, flags between rounds
        from tplab.gpu_collectives.copy_engine import CopyEngineComm

        # in place: the forward-only layer hands over a fresh partial product (no copy, as measured before)
        paths["tplab copy engine"] = CopyEngineComm(WORLD, nbytes, in_place=True)
        if WORLD.rank == 0:
            print(f"tplab copy engine: barriers by {paths['tplab copy engine'].stream_barriers.kind}", flush=True)
    if "tplab peer" in names:  # the two-shot peer-memory kernel (SMs move the bytes)
        from tplab.comm import nccl_world
        from tplab.gpu_collectives import PeerMemoryComm

        for i, blocks in enumerate(int(b) for b in peer_blocks.split(",")):  # few blocks: SMs left to GEMMs
            paths[f"tplab peer{f' ({blocks} blocks)' if i else ''}"] = peer = PeerMemoryComm(nccl_world(), nbytes,
                                                                                             blocks=blocks)
            peer.kernel, peer.blocks_used = "two_shot", blocks
    if "tplab ring" in names:
        comm, why = tplab_nccl_comm()
        if comm is not None:
            paths["tplab ring"] = comm
        elif WORLD.rank == 0:
            print(f"tplab ring over NCCL skipped: {why}", flush=True)
    return paths


def profile_host(block, x, paths, chunk_counts, tail):
    """Is the host keeping ahead of the GPU? For each path and k: the host's time to queue one forward pass of
    the block in micro-batches, and the time until the GPU is done (rank 0's; a pass that the host cannot
    queue faster than the GPU runs it leaves the GPU idle between kernels). Then torch.profiler's table of
    the largest k on the first path: a synchronising call (cudaStreamSynchronize, cudaMemcpy to the host)
    would show there."""
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x.is_cuda else [])

    def once(layer):
        sync()
        WORLD.Barrier()
        t = time.perf_counter()
        layer(x)
        queued = time.perf_counter() - t
        sync()
        return queued * 1e3, (time.perf_counter() - t) * 1e3

    with torch.no_grad():
        for path, comm in paths.items():
            with with_comm(block, comm):
                for k in chunk_counts:
                    layer = overlapped(block, k, split="batch", tail=tail) if k > 1 else block
                    times = [once(layer) for _ in range(8)][3:]
                    if WORLD.rank == 0:
                        print(f"{path:24s} k={k}: host queues in {sorted(q for q, _ in times)[2]:.3f} ms, "
                              f"done after {sorted(d for _, d in times)[2]:.3f} ms", flush=True)
        path, comm = next(iter(paths.items()))
        with with_comm(block, comm), profile(activities=activities) as prof:
            once(overlapped(block, max(chunk_counts), split="batch", tail=tail))
    if WORLD.rank == 0:
        print(f"\n{path}, k={max(chunk_counts)}, tail {tail}:\n"
              f"{prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=30)}", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", nargs="?", default=BUILD_GPU,
                        help="where the CSVs go (default: build/gpu in the repository)")
    parser.add_argument("--hidden", type=int, help="default 5120 (GPU), 512 (CPU)")
    parser.add_argument("--heads", type=int, help="default 40 (GPU), 8 (CPU)")
    parser.add_argument("--seq", type=int, help="default 4096 (GPU), 256 (CPU)")
    parser.add_argument("--batch", type=int, help="default 4 (GPU), 2 (CPU)")
    parser.add_argument("--algorithm", default="ring", help="tplab's algorithm (the tplab paths)")
    parser.add_argument("--chunks", default="1,2,4,8")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--layers", default="block,mlp,attention,mlp_sp")
    parser.add_argument("--stack-layers", type=int, default=4, help='blocks in layer "stack_mb"')
    parser.add_argument("--paths", help='default "torch.distributed,tplab ring" (GPU; also "tplab copy engine", '
                        '"tplab peer"), "tplab MPI" (CPU; "tplab MPI,torch.distributed" adds gloo)')
    parser.add_argument("--peer-blocks", default="16", help='grid(s) of the "tplab peer" kernels (SMs taken), e.g. 8,16')
    parser.add_argument("--tails", default="1", help="pieces of the block's last MLP (OverlappedBlock tail), e.g. 1,4")
    parser.add_argument("--sm-carveouts", default="0", help="SMs cuBLAS leaves free in the overlapped layer, e.g. 0,16")
    parser.add_argument("--tag", default="", help="added to the output file names")
    parser.add_argument("--graphs", action="store_true", help="time every variant as a CUDA graph replay (GPU)")
    parser.add_argument("--profile", action="store_true", help="only say where the host's time goes: host vs GPU "
                        "time of the block in micro-batches per path and chunk count, and torch.profiler's table")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--repeats", type=int, default=1, help="measure every sweep this many times (noise)")
    args = parser.parse_args()

    cuda = args.device == "cuda"
    for name, gpu_default, cpu_default in [("hidden", 5120, 512), ("heads", 40, 8), ("seq", 4096, 256), ("batch", 4, 2),
                                           ("paths", "torch.distributed,tplab ring", "tplab MPI")]:
        if getattr(args, name) is None:
            setattr(args, name, gpu_default if cuda else cpu_default)
    connections = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "default (8)")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cuda:
        local = WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        torch.cuda.set_device(local)
        device, dtype = torch.device("cuda", local), torch.bfloat16
        paths = {"torch.distributed": TorchDistributedComm(device, in_place=True)}
        stem = f"overlap_gpu-{slug(torch.cuda.get_device_name(device))}-x{WORLD.size}_cdmc-{slug(connections.split()[0])}"
        stem += f"_{slug(args.tag)}" if args.tag else ""
    else:
        from tplab.comm import world

        device, dtype = torch.device("cpu"), torch.float32
        paths = {"tplab MPI": world()}
        if "torch.distributed" in args.paths:  # gloo: a check of the GPU path's plumbing on CPU ranks
            paths["torch.distributed"] = TorchDistributedComm(device, in_place=True)
        stem = f"overlap_cpu-{slug(cpu_model(short=True))}-{os.cpu_count()}-core_{WORLD.size}-ranks_{slug(mpi_library(short=True))}"
    machine = machine_name(device)
    csv = out / f"{stem}.csv"
    if WORLD.rank == 0:
        print(f"{machine}; CUDA_DEVICE_MAX_CONNECTIONS={connections}; "
              f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE', 'unset')}", flush=True)

    torch.manual_seed(0)  # the same weights on every rank (each keeps its shard): not needed for timing
    first_comm = next(iter(paths.values()))
    with torch.device(device):
        block = Block(args.hidden, args.heads, first_comm, dtype)
        x = torch.randn(args.batch, args.seq, args.hidden, dtype=dtype)  # (b, s, h), replicated
    # (layer, its input): the block, its two halves, and the MLP under sequence parallelism (the same
    # weights; input: my slice of the sequence, (s/p, b, h); an all-gather before, a reduce-scatter after)
    mlp_sp = ParallelMLP(block.mlp.up, block.mlp.down, sequence_parallel=True)
    x_sp = x.transpose(0, 1).chunk(WORLD.size)[WORLD.rank].contiguous()
    layers = {"block": (block, x), "mlp": (block.mlp, x), "attention": (block.attention, x), "mlp_sp": (mlp_sp, x_sp),
              "block_mb": (block, x)}  # the block cut into micro-batches (split="batch"; k <= batch)
    if "stack_mb" in args.layers:  # blocks applied in turn, pipelined in micro-batches across the layers
        with torch.device(device):
            more = [Block(args.hidden, args.heads, first_comm, dtype) for _ in range(args.stack_layers - 1)]
        layers["stack_mb"] = (nn.Sequential(block, *more), x)
    nbytes = args.batch * args.seq * args.hidden * x.element_size()  # one all-reduce of the whole layer
    if cuda:
        paths.update(tplab_gpu_paths(args.paths, args.peer_blocks, nbytes))
    paths = {name: c for name, c in paths.items() if name.split(" (")[0] in args.paths}
    chunk_counts = [int(k) for k in args.chunks.split(",")]
    if args.profile:
        return profile_host(block, x, paths, chunk_counts, max(int(t) for t in args.tails.split(",")))

    nccl_env = " ".join(f"{k}={os.environ[k]}" for k in ("NCCL_MAX_CTAS", "NCCL_MIN_CTAS", "NCCL_MAX_NCHANNELS",
                                                          "TORCH_NCCL_HIGH_PRIORITY") if k in os.environ)
    variants = [(int(t), c) for t in args.tails.split(",") for c in sm_carveouts(args.sm_carveouts)]
    runs = [(r, path, comm, layer_name, variant) for r in range(args.repeats) for path, comm in paths.items()
            for layer_name in args.layers.split(",") for variant in variants
            if variant == variants[0] or layer_name in ("block", "block_mb", "stack_mb")]  # (the knobs change those only)
    frames = []
    for repeat, path, comm, layer_name, (tail, carveout) in runs:
        layer, layer_input = layers[layer_name]
        for m in layer.modules():  # tplab's hand-written algorithm; torch.distributed ignores it
            if hasattr(m, "algorithm"):
                m.algorithm = args.algorithm
        t = time.perf_counter()
        split = "batch" if layer_name.endswith("_mb") else "sequence"
        if layer_name == "stack_mb":
            make = lambda stack, k: overlapped(list(stack), k, split="batch", tail=tail)  # noqa: E731
        else:
            make = partial(overlapped, split=split, tail=tail) if "block" in layer_name else overlapped
        with with_comm(layer, comm):
            counts = [k for k in chunk_counts if split == "sequence" or k <= args.batch]
            df = overlap_sweep(layer, layer_input, comm, counts, iters=args.iters, warmup=args.warmup, cuda=cuda,
                               make_overlapped=lambda layer, k: with_sm_carveout(make(layer, k), carveout),
                               graphs=args.graphs and cuda)
        df = pipeline_model(df)
        df.insert(0, "machine", machine)
        df.insert(1, "path", path)
        df["layer"] = layer_name
        df["layers"] = len(layer) if layer_name == "stack_mb" else 1
        if cuda:
            df["cuda_device_max_connections"] = connections
            df["nccl_nvls_enable"] = os.environ.get("NCCL_NVLS_ENABLE", "unset")
        df["batch"], df["seq"], df["heads"], df["repeat"] = args.batch, args.seq, args.heads, repeat
        df["tail"], df["gemm_sm_carveout"], df["nccl_env"] = tail, carveout, nccl_env
        df["path_detail"] = (f"two_shot kernel, {comm.blocks_used} blocks" if path.startswith("tplab peer") else
                             "copy engines; barriers by " + comm.stream_barriers.kind if path == "tplab copy engine"
                             else nccl_env)
        if not cuda:  # other work on the machine: the 1-minute load average when this sweep ended
            df["load_average"] = round(os.getloadavg()[0], 2)
            df["progress_thread_waits"] = {True: "yield", False: "spin", None: "yield if oversubscribed"}[
                progress_thread.yield_cpu]
        frames.append(df)
        if WORLD.rank == 0:
            cols = ["chunks", "compute_ms", "comm_ms", "no_overlap_ms", "compute_chunked_ms", "overlapped_ms",
                    "exposed_ms", "hidden_fraction"]
            print(f"\n{path}, {layer_name}, tail {tail}, SM carveout {carveout} ({time.perf_counter() - t:.0f} s)\n"
                  f"{df[cols].round(3).to_string(index=False)}", flush=True)
            pd.concat(frames).to_csv(csv, index=False)  # written as it goes: a crash keeps what was measured

    # a timeline of the block at k = 4 for every path, from CUDA events on both streams on GPUs
    import matplotlib

    matplotlib.use("Agg")
    from tplab.lab.plots import plot_timeline

    by_batch = "block_mb" in args.layers.split(",")  # the timeline of the best-placed variant measured
    chunked = overlapped(block, min(4, args.batch) if by_batch else 4, split="batch" if by_batch else "sequence",
                         tail=max(variants)[0])
    for path, comm in paths.items():
        with torch.no_grad(), with_comm(block, comm):
            for _ in range(3):
                chunked(x)
            tracer = Tracer(comm, gpu=cuda)
            with tracer:
                chunked(x)
        df = tracer.gather()
        if WORLD.rank == 0:
            name = f"{stem}_{slug(path)}" if path != next(iter(paths)) else stem  # the first keeps its old name
            write_chrome_trace(df, out / f"{name}_trace_k4.json")
            what = f"{'micro-batches' if by_batch else 'sequence blocks'}, k={chunked.chunks}, tail {chunked.tail}"
            what += ", eager" if args.graphs else ""  # (a graph replay records no CUDA events in between)
            fig = plot_timeline(df, title=f"block, {what}, {path}, {machine}" +
                                (f", CUDA_DEVICE_MAX_CONNECTIONS={connections}" if cuda else ""))
            fig.savefig(out / f"{name}_timeline_k4.png", dpi=110)
    if WORLD.rank == 0:
        best = pd.concat(frames).query("layer in ['block', 'block_mb', 'stack_mb']").sort_values("hidden_fraction",
                                                                                                 ascending=False)
        columns = ["layer", "path", "chunks", "tail", "gemm_sm_carveout", "comm_ms", "compute_ms", "overlapped_ms",
                   "exposed_ms", "hidden_fraction"]
        print(f"\nwrote {csv}\nbest block rows:\n{best[columns].head(12).round(3).to_string(index=False)}")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
