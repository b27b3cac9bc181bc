"""The course project's sequence-parallel scaling study on GPUs: CPU-staged MPI next to direct GPU transfers.

One MPI rank per GPU; run it once per p (the world size is p), all runs appending to one CSV:

    for p in 1 2 4; do
      PYTHONPATH=$PWD mpiexec -n $p python3 scripts/gpu_sequence_parallel.py [OUT_DIR]      # Open MPI as root:
    done                                                                                  #  --allow-run-as-root

The course project's layer (tplab.sequence.SequenceParallelBlock: LayerNorm, Q/K/V, attention, output projection,
MLP; the tokens split over the GPUs, the weights replicated) at its configuration (hidden 5120, sequence
4096, batch 4; 40 heads; fp32, and bf16), strong scaling (the same problem on p GPUs) and weak scaling
(sequence 4096·p). Paths for the two all-gathers of K and V, side by side in the same run on the same GPUs:

    staged_ring   the course project's path: shard.cpu() -> tplab's ring all-gather over host MPI -> .to("cuda")
    staged_mpi    the same with the MPI library's own MPI_Allgatherv on the host copies
    direct_ring   tplab's ring all-gather over tplab.comm.nccl (NCCL send/recv, GPU to GPU over NVLink)
    direct_nccl   NCCL's own all-gather (ncclAllGather) through the same communicator: the vendor
    direct_peer   tplab's peer-memory all-gather (tplab.gpu_collectives.peer_memory: CUDA IPC, flags in GPU memory,
                  every peer read at once in one kernel)
    direct_copy_engine  K and V pulled by the copy engines (CopyEngineExchange: no SM), for the all-gather scheme
                  (with head groups: next to the attention) and the streamed K/V scheme; for ring attention
                  each step's block pulled from the left neighbour (CopyEngineExchange.start_pass)
    direct_vendor only when tplab.comm.nccl is not usable here: torch.distributed's NCCL all_gather_into_tensor
    torch_nccl    the same, by name only (--paths torch_nccl): NCCL's all-gather as a torch program calls it
    compute_only  NullExchange: nothing crosses a link, but every rank still writes p copies of its own K and V
                  block into the gathered tensor (what a real gather writes), and the streamed scheme and the
                  ring merge p blocks (each its own: the ring's compute with nothing moving)
    fused_kv      tplab.sequence.FusedKV: Q, K and V in one Triton GEMM whose epilogue writes each K/V tile into
                  every rank's memory (TMA stores over NVLink), then one barrier: the all-gather run under the GEMM
                  (about half of its cost hidden on 4x H100; bf16/fp16, Hopper or newer, Triton with descriptors)
    compute_floor nothing moves and nothing is written: the gather hands back a tensor of the gathered shape made
                  once (values wrong by design). The layer's compute alone, the floor under every path
and, over tplab.comm.nccl, ring attention and Ulysses (--schemes). Ring attention computes each block with a
fused kernel that returns the block's log-sum-exp (cuDNN's in bf16, FlashAttention's for a causal
rectangle) and moves the blocks on a second CUDA stream. ``--head-groups 1,4,8`` also runs the all-gather
scheme with K and V gathered in that many groups of heads on a second stream, each group attended as soon as
it arrives (tplab.sequence.allgather_kv): the rows' path is then ``<path>_g<G>`` (e.g. direct_peer_g4) and
``head_groups`` says G (1: the scheme as it was, one K and one V gather on the compute stream).
``--side-stream`` also runs it with one group's gathers on the second stream, under the Q projection
(``side_stream=True``; path ``<path>_side``). Timing: CUDA events around each forward
(they count the time the GPU waits for the host: copies and host MPI), --warmup untimed calls, the median of
--iters, the slowest rank. The unsplit layer on one GPU is timed in every run (rank 0) as the baseline of
``speedup``; the SP output is checked against it on every rank (``max_rel_error``). ``--graphs`` also times
the paths of ``--graph-paths`` (and the one-GPU layer) as CUDA graph replays: two layer calls captured in one
graph, as a stack of layers replays them, timed per call, so that the host's time to queue a call drops out
(the rows' path gets the suffix ``_graph``, their ``speedup`` is against the one-GPU layer's graph, row
``one_gpu_graph``; the copy engines' graphs use exchanges of their own, made for the row; a path a capture
refuses is reported and skipped). ``--components`` adds
rows timing the pieces of one all-gather (PCIe copies, host MPI, NVLink) for the cost model
(tplab.cost.staged_vs_direct). Output: OUT_DIR/sequence_parallel_gpu_<card>.csv with a ``machine`` column.

One short run at p = 4 only (strong scaling; bf16 and fp32; the overlapped variants next to the paths they
start from; a few minutes on 4 H100s):

    PYTHONPATH=$PWD mpiexec -n 4 python3 scripts/gpu_sequence_parallel.py OUT_DIR --modes strong --no-components \
        --paths direct_peer,direct_nccl,direct_ring --head-groups 1,4,8

A CPU dry run of the same code, tiny, on host MPI: add ``--device cpu --hidden 64 --heads 8 --seq 64 --batch 1``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import faulthandler
import os
import socket
import statistics
import sys
import warnings
from functools import partial
from pathlib import Path

for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):  # no multicast
    os.environ.setdefault(name, "0" if name == "NCCL_NVLS_ENABLE" else "1")

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tplab  # noqa: E402
from tplab.comm import world  # noqa: E402
from tplab.cost.sequence_parallel import attention_bytes  # noqa: E402
from tplab.sequence import SequenceParallelBlock, shard, unsplit_layer  # noqa: E402
from tplab.sequence.gather import (  # noqa: E402
    exchange_allgather_first_dim,
    from_host,
    staged_allgather_first_dim,
    to_host,
)
from tplab.sequence.online_softmax import OnlineSoftmax  # noqa: E402
from tplab.sequence.scaling import make_block, make_input  # noqa: E402
from tplab.toolkit.machine import mpi_library  # noqa: E402
from tplab.toolkit.timing import time_calls  # noqa: E402

BUILD_GPU = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "gpu")  # git-ignored

COLUMNS = ["machine", "gpu", "run_ranks", "kind", "mode", "p", "dtype", "scheme", "layout", "causal", "path", "transport",
           "head_groups", "component", "hidden", "heads", "seq_len", "batch", "tokens_per_rank", "time_s",
           "fastest_rank_s",
           "unsplit_time_s", "speedup", "efficiency", "tokens_per_s", "weak_efficiency", "bytes_per_rank",
           "predicted_bytes_per_rank", "max_rel_error", "iters", "warmup", "date"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def log(*args):
    if MPI.COMM_WORLD.rank == 0:
        print(*args, flush=True)


def bind_gpu() -> int:
    """One rank per GPU, by rank among the ranks on this node (as tplab.comm.nccl binds)."""
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=MPI.COMM_WORLD.rank)
    local = node.Get_rank()
    node.Free()
    torch.cuda.set_device(local)
    return local


def machine_description(host, device) -> str:
    if device == "cpu":  # (a dry run of the script on CPU ranks)
        return f"CPU dry run: {os.cpu_count()} cores; torch {torch.__version__}; {mpi_library()}"
    props = torch.cuda.get_device_properties(0)
    try:
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception:  # noqa: BLE001 - only a label
        nccl = "?"
    return (f"{torch.cuda.device_count()}x {props.name} ({props.total_memory / 2**30:.0f} GiB); torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, NCCL {nccl}; host MPI {mpi_library()}; "
            f"{socket.gethostname()}")


def tplab_nccl(host):
    """tplab's NCCL transport if it works here (checked with a small all-gather), else (None, reason)."""
    try:
        from tplab.comm.nccl import nccl_world

        comm = nccl_world()
        got = tplab.allgather(torch.full((3,), float(host.rank), device="cuda"), comm, algorithm="ring")
        want = torch.arange(host.size, dtype=torch.float32).repeat_interleave(3)
        problem = "" if got.is_cuda and torch.equal(got.cpu(), want) else f"wrong all-gather {got}"
    except Exception as e:  # noqa: BLE001 - any failure means: use the vendor path instead
        comm, problem = None, f"{type(e).__name__}: {e}"
    problems = [p for p in host.allgather_object(problem) if p]
    return (comm, "") if not problems else (None, problems[0])


def torch_distributed_allgather(host, device):
    """The vendor path without tplab.comm.nccl: torch.distributed's NCCL all_gather_into_tensor (gloo on CPU)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        port = None
        if host.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(host.allgather_object(port)[0])
        if device == "cuda":
            dist.init_process_group("nccl", rank=host.rank, world_size=host.size,
                                    device_id=torch.device("cuda", torch.cuda.current_device()))
        else:
            dist.init_process_group("gloo", rank=host.rank, world_size=host.size)

    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*deprecated", category=FutureWarning)

    def vendor_allgather(x, comm):  # (m, ...) -> (p·m, ...)
        out = torch.empty((comm.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    return vendor_allgather


def peer_gather(peers):
    """tplab.gpu_collectives.peer_memory's all-gather as a ``gather`` of tplab.sequence: (m, ...) -> (p·m, ...)."""
    def gather(x, comm):
        return peers.allgather_torch(x)
    return gather


def copy_engine_gather(main, side):
    """The all-gather K/V scheme's ``gather`` through the copy engines: ``main`` on the compute stream (one head
    group), ``side`` on the side stream (head groups, or side_stream=True; a CopyEngineExchange serves one
    stream)."""
    def gather(x, comm):
        on_side = torch.cuda.current_stream() != torch.cuda.default_stream()
        return exchange_allgather_first_dim(x, comm, side if on_side else main)
    return gather


def null_gather(rank, size):
    """A ``gather`` that moves nothing (every block is this rank's own): the scheme's compute alone."""
    from tplab.comm.shard_exchange import NullExchange

    return partial(exchange_allgather_first_dim, exchange=NullExchange(rank, size))


def ready_gather():
    """A ``gather`` that moves and writes nothing: a tensor of the gathered shape, made once per shape (K and V
    share it). The layer's compute alone, with no exchange's work at all: the floor under every path."""
    made = {}

    def gather(x, comm):
        key = (tuple(x.shape), x.dtype, x.device)
        if key not in made:
            made[key] = torch.zeros((comm.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        return made[key]
    return gather


def message_exchange(host):
    from tplab.comm.shard_exchange import MessageExchange

    return MessageExchange(host)


def fused_kv_works() -> bool:
    """Whether the fused K/V gather can run here: Triton with tensor descriptors, a GPU with TMA (Hopper on)."""
    try:
        import triton.tools.tensor_descriptor  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability()[0] >= 9


OPTIONS = {"allgather_kv": {"algorithm", "gather", "head_groups", "side_stream", "fused_kv"},  # what each takes
           "streamed_kv": {"exchange"}, "ring": {"exchange"}}


def paths_here(host, nccl, nccl_problem, schemes, device, peers=None, exchange=None, torch_nccl=False):
    """(name, transport description, communicator, scheme options, schemes it runs, whether tplab's counters
    see its bytes: a library's own collective does not go through them). ``exchange``: a CopyEngineExchange
    for the streamed K/V scheme."""
    messages = set(schemes) - {"streamed_kv"}  # (streamed K/V moves GPU memory through an exchange only)
    staged = "GPU->host copy (tensor.cpu()), {} on host memory over MPI, host->GPU copy"
    paths = [("staged_ring", staged.format("tplab ring all-gather"), host,
              {"gather": partial(staged_allgather_first_dim, algorithm="ring", check=False)}, {"allgather_kv"}, True),
             ("staged_mpi", staged.format("MPI_Allgatherv"), host,
              {"gather": partial(staged_allgather_first_dim, algorithm="builtin", check=False)}, {"allgather_kv"},
              False)]
    if nccl is not None:
        paths += [("direct_ring", "tplab ring over tplab.comm.nccl (NCCL send/recv, GPU to GPU)", nccl,
                   {"algorithm": "ring"}, messages, True),
                  ("direct_nccl", "ncclAllGather through tplab.comm.nccl (the vendor's collective)", nccl,
                   {"algorithm": "builtin"}, {"allgather_kv"}, False)]
        if peers is not None:
            paths += [("direct_peer", "tplab peer-memory all-gather (CUDA IPC, flags in GPU memory, one kernel)",
                       nccl, {"gather": peer_gather(peers)}, {"allgather_kv"}, False)]
        if exchange is not None:
            from tplab.comm.shard_exchange import NullExchange

            paths += [("direct_copy_engine", "tplab CopyEngineExchange (CUDA IPC; the copy engines pull every peer's "
                       "block over NVLink -- ring attention: the left neighbour's, each step -- no SM; the GPU waits "
                       "on events and stream barriers)", nccl,
                       {"exchange": exchange[0], "gather": copy_engine_gather(*exchange)},
                       {"allgather_kv", "streamed_kv", "ring"}, False),
                      ("compute_only", "NullExchange: nothing moves, every block is this rank's own (values wrong "
                       "by design): the scheme's compute and the gathered tensor's writes", nccl, {"exchange": NullExchange(host.rank, host.size),
                                                                          "gather": null_gather(host.rank, host.size)},
                       {"allgather_kv", "streamed_kv", "ring"}, False)]
    if torch_nccl and device == "cuda":   # (asked for by name: it makes torch.distributed's own communicator)
        paths += [("torch_nccl", "torch.distributed's NCCL all_gather_into_tensor (the vendor's all-gather through "
                   "torch: NCCL as a torch program calls it)", host, {"gather": torch_distributed_allgather(host, device)},
                   {"allgather_kv"}, False)]
    if nccl is not None and fused_kv_works():
        paths += [("fused_kv", "FusedKV: Q/K/V in one Triton GEMM whose epilogue writes each K/V tile into every "
                   "rank's memory (CUDA IPC, TMA stores over NVLink), then one barrier", nccl, {"fused_kv": True},
                   {"allgather_kv"}, False)]
    if nccl is not None or device == "cpu":
        paths += [("compute_floor", "nothing moves or is written: the gather hands back a tensor of the gathered shape "
                   "made once (values wrong by design): the layer's compute alone", nccl or host,
                   {"gather": ready_gather()}, {"allgather_kv"}, False)]
    if nccl is None and device == "cpu":  # the dry run walks the direct path's code with host MPI standing in for NCCL
        paths += [("direct_ring", "tplab ring over host MPI (CPU dry run)", host, {"algorithm": "ring"}, messages,
                   True),
                  ("direct_messages", "MessageExchange over host MPI (CPU dry run)", host,
                   {"gather": partial(exchange_allgather_first_dim, exchange=message_exchange(host))},
                   {"allgather_kv", "streamed_kv"}, False)]
    if nccl is None:
        paths += [("direct_vendor", f"torch.distributed NCCL all_gather_into_tensor (tplab.comm.nccl: {nccl_problem})",
                   host, {"gather": torch_distributed_allgather(host, device)}, {"allgather_kv"}, False)]
    return paths


def slowest(times, host):
    medians = host.allgather_object(statistics.median(times))
    return max(medians), min(medians)


def measure(fn, host, args):
    with torch.no_grad():
        return slowest(time_calls(fn, iters=args.iters, warmup=args.warmup, barrier=host.barrier,
                                  cuda=args.device == "cuda"), host)


GRAPH_CALLS = 2   # layer calls per graph: a stack's replay; an even count also keeps FusedKV's halves apart


def graph_replay(layer, x, args):
    """``layer`` captured in one CUDA graph, GRAPH_CALLS calls on a static copy of x, after eager warm-up calls
    (compilation, the exchanges' areas): (replay, the last call's output, the static input)."""
    static = x.clone()
    with torch.no_grad():
        for _ in range(max(1, args.warmup)):
            layer(static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [layer(static) for _ in range(GRAPH_CALLS)]
    return graph.replay, outs[-1], static


def graph_options(base_name, options, scheme, exchange):
    """The options of a path's graph row: the copy engines' get exchanges of their own (a captured call makes
    an exchange meet its peers before every later call: the eager rows after it would pay for that), closed
    after the row. -> (options, the exchanges to close)."""
    if base_name != "direct_copy_engine":
        return options, []
    from tplab.gpu_collectives.copy_engine_exchange import CopyEngineExchange

    fresh = [CopyEngineExchange(MPI.COMM_WORLD, exchange[0].slot) for _ in "ms"]
    made = {"exchange": fresh[0], "gather": copy_engine_gather(*fresh)}
    return {**options, **{key: value for key, value in made.items() if key in OPTIONS.get(scheme, ())}}, fresh


def same_everywhere(tensors, host):
    """Rank 0's values on every rank (the seeds should already agree; this makes sure)."""
    for t in tensors:
        buf = to_host(t).numpy()  # a host copy (bf16 as int16)
        host.mpi.Bcast(buf, root=0)
        t.data.copy_(from_host(torch.from_numpy(buf), like=t))


def unsplit_time(whole, x_full, host, args) -> float:
    """Rank 0 times the whole layer on its one GPU while the others wait; every rank gets the time."""
    time_s = None
    if host.rank == 0:
        with torch.no_grad():
            time_s = statistics.median(time_calls(lambda: whole(x_full), iters=args.iters, warmup=args.warmup,
                                                  cuda=args.device == "cuda"))
    return host.allgather_object(time_s)[0]


def unsplit_graph_time(whole, x_full, host, args) -> float:
    """The unsplit layer as graph replays (graph_replay), timed on rank 0 per call; every rank gets the time."""
    time_s = None
    if host.rank == 0:
        replay, _, _ = graph_replay(whole, x_full, args)
        time_s = statistics.median(time_calls(replay, iters=args.iters, warmup=args.warmup, cuda=True)) / GRAPH_CALLS
    return host.allgather_object(time_s)[0]


def layer_rows(host, paths, block, whole, dtype_name, mode, args, base):
    """The unsplit layer and every (path, scheme) at this p, for one dtype and mode. ``base``: the unsplit
    layer's time at the starting size (the per-rank problem of weak scaling)."""
    p, dtype = host.size, DTYPES[dtype_name]
    s = args.seq * p if mode == "weak" else args.seq
    if s % (p * (2 if args.layout == "zigzag" else 1)):
        log(f"  skip {mode}: sequence {s} does not split over {p} ranks")
        return []
    x_full = make_input(args.batch, s, args.hidden, dtype=dtype, device=args.device, seed=1)  # (b, s, h)
    same_everywhere([x_full], host)
    with torch.no_grad():
        expected = whole(x_full)  # (b, s, h): the unsplit layer's output
        if args.causal:  # the reference itself, against the model's own Block (bf16: its rounding)
            differ = float((expected - block(x_full)).abs().max().float() / expected.abs().max().float())
            assert differ < (1e-3 if dtype == torch.float32 else 3e-2), f"unsplit layer != Block: {differ:.1e}"
    unsplit = base if s == args.seq else unsplit_time(whole, x_full, host, args)
    common = {"kind": "layer", "mode": mode, "p": p, "dtype": dtype_name, "layout": args.layout,
              "causal": args.causal, "hidden": args.hidden, "heads": args.heads, "seq_len": s, "batch": args.batch,
              "tokens_per_rank": args.batch * s // p, "unsplit_time_s": unsplit}
    rows = [{**common, "kind": "unsplit", "p": 1, "tokens_per_rank": args.batch * s, "path": "one_gpu",
             "scheme": "none", "time_s": unsplit, "speedup": 1.0, "efficiency": 1.0,
             "tokens_per_s": args.batch * s / unsplit}]
    unsplit_graph = None
    if args.graphs and args.device == "cuda":
        graphed = unsplit_graph = unsplit_graph_time(whole, x_full, host, args)
        rows.append({**rows[0], "path": "one_gpu_graph", "time_s": graphed, "speedup": unsplit / graphed,
                     "efficiency": unsplit / graphed, "tokens_per_s": args.batch * s / graphed})
        log(f"  {mode:6} {dtype_name:8} one GPU: {unsplit * 1e3:.2f} ms eagerly, {graphed * 1e3:.2f} ms replayed")
    x = shard(x_full, host.rank, p, args.layout, dim=1)  # (b, s/p, h)
    # one GPU: nothing to gather, every path is the same code; run each scheme once
    runs = [("single_gpu", "one GPU, no communication", host, {}, set(args.schemes), True)] if p == 1 else paths
    for base_name, base_transport, comm, base_options, schemes, counted in runs:
        here = [sc for sc in args.schemes if sc in schemes and (mode == "strong" or sc in args.weak_schemes)]
        variants = [(sc, g, False) for sc in here for g in (args.head_groups if sc == "allgather_kv" else [None])]
        if args.side_stream and "allgather_kv" in here:
            variants.append(("allgather_kv", 1, True))
        for scheme, groups, side in variants:
            if "fused_kv" in base_options and (side or (groups or 1) > 1 or dtype not in (torch.bfloat16, torch.float16)):
                continue  # (one 16-bit GEMM sends K and V: no groups, no side stream)
            if scheme == "ulysses" and args.heads % p:
                log(f"  skip ulysses: {args.heads} heads over {p} ranks")
                continue
            options = {key: value for key, value in base_options.items() if key in OPTIONS.get(scheme, ())}
            name, transport = base_name, base_transport
            if args.eager_merge and args.device == "cuda" and scheme in ("ring", "streamed_kv"):
                name, transport = f"{name}_eager", f"{transport}; each merge as eager passes"
            if args.flash_blocks and args.device == "cuda" and scheme in ("ring", "streamed_kv"):
                name, transport = f"{name}_flash", f"{transport}; every block on FlashAttention's kernel"
            if groups is not None:
                options["head_groups"] = groups
                if groups > 1:  # a variant of the path: its own name, so that each row's (scheme, path) is unique
                    name = f"{base_name}_g{groups}"
                    transport = f"{base_transport}; K/V in {groups} head groups, overlapped"
            if side:
                options["side_stream"] = True
                name, transport = f"{base_name}_side", f"{base_transport}; the gathers on the side stream, under Q"
            faulthandler.dump_traceback_later(args.watchdog, exit=True)
            if options.get("fused_kv") is True:  # made for this layer's weights and shapes (collective)
                from tplab.sequence.fused_kv import FusedKV

                options["fused_kv"] = FusedKV(block.attention, MPI.COMM_WORLD, batch=args.batch,
                                              tokens_per_rank=x.shape[1])
            layer = SequenceParallelBlock(block, comm, scheme=scheme, layout=args.layout, causal=args.causal,
                                          check=False, **options)
            with torch.no_grad():
                sent = comm.bytes_sent
                y = layer(x)
                sent = comm.bytes_sent - sent
                scale = expected.abs().max().float()
                error = float((y - shard(expected, host.rank, p, args.layout, dim=1)).abs().max().float() / scale)
            time_s, fastest = measure(lambda: layer(x), host, args)
            predicted = attention_bytes(scheme, args.batch, s, args.hidden, p, bytes_per_element=x.element_size())
            rows.append({**common, "scheme": scheme, "path": name, "transport": transport, "head_groups": groups,
                         "time_s": time_s, "fastest_rank_s": fastest, "speedup": unsplit / time_s,
                         "efficiency": unsplit / time_s / p, "tokens_per_s": args.batch * s / time_s,
                         "weak_efficiency": base / time_s if mode == "weak" else None,
                         "bytes_per_rank": max(host.allgather_object(sent)) if counted else None,
                         "predicted_bytes_per_rank": predicted if p > 1 else 0,
                         "max_rel_error": max(host.allgather_object(error))})
            log(f"  {mode:6} {dtype_name:8} {scheme:12} {name:16} {time_s * 1e3:9.2f} ms  "
                f"speedup {unsplit / time_s:5.2f}x  error {rows[-1]['max_rel_error']:.1e}")
            if args.graphs and args.device == "cuda" and base_name in args.graph_paths and p > 1:
                graphed_row = graph_row(rows[-1], unsplit_graph, host, block, comm, scheme, base_name, options, x,
                                        expected, args)
                rows += [graphed_row] if graphed_row else []
            if layer.fused_kv is not None:
                layer.fused_kv.close()
    del x_full, expected
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def graph_row(eager, unsplit, host, block, comm, scheme, base_name, options, x, expected, args):
    """The row ``eager`` again, its layer replayed from a CUDA graph (graph_replay): time per call and error,
    its speedup against the one-GPU layer's graph (``unsplit``: like for like); None if a rank's capture failed."""
    p = host.size
    options, exchanges = graph_options(base_name, options, scheme, PATH_EXCHANGES.get("exchange"))
    if options.get("fused_kv") is not None:   # (its own, as the exchanges: the eager row's is closed after it)
        from tplab.sequence.fused_kv import FusedKV

        options["fused_kv"] = FusedKV(block.attention, MPI.COMM_WORLD, batch=args.batch, tokens_per_rank=x.shape[1])
    layer = SequenceParallelBlock(block, comm, scheme=scheme, layout=args.layout, causal=args.causal, check=False,
                                  **options)
    try:   # (a path whose calls a capture refuses, on one rank or all: reported, skipped on every rank)
        replay, y, _ = graph_replay(layer, x, args)
        problem = ""
    except Exception as e:  # noqa: BLE001 - reported
        replay = y = None
        problem = f"{type(e).__name__}: {e}"
    problems = [q for q in host.allgather_object(problem) if q]
    row = None
    if problems:
        log(f"  {eager['path']}_graph: not captured: {problems[0].splitlines()[0][:200]}")
    else:
        with torch.no_grad():
            time_s, fastest = measure(replay, host, args)
            replay()
            error = float((y - shard(expected, host.rank, p, args.layout, dim=1)).abs().max().float()
                          / expected.abs().max().float())
        time_s, fastest = time_s / GRAPH_CALLS, fastest / GRAPH_CALLS
        row = {**eager, "path": f"{eager['path']}_graph", "transport": f"{eager['transport']}; {GRAPH_CALLS} layer "
               "calls captured in one CUDA graph, replayed (time per call)", "time_s": time_s, "fastest_rank_s": fastest,
               "unsplit_time_s": unsplit, "speedup": unsplit / time_s, "efficiency": unsplit / time_s / p,
               "tokens_per_s": eager["tokens_per_s"] * eager["time_s"] / time_s,
               "max_rel_error": max(host.allgather_object(error))}
        log(f"  {row['mode']:6} {row['dtype']:8} {scheme:12} {row['path']:16} {time_s * 1e3:9.2f} ms  "
            f"speedup {unsplit / time_s:5.2f}x (against the one-GPU graph)  error {row['max_rel_error']:.1e}")
    if layer.fused_kv is not None:
        layer.fused_kv.close()
    del layer, replay, y
    torch.cuda.synchronize()
    for exchange in exchanges:
        exchange.close()
    torch.cuda.empty_cache()
    return row


PATH_EXCHANGES = {}   # main's copy-engine exchanges (graph rows make their own of the same size)


def component_rows(host, nccl, vendor, dtype_name, args, peers=None, exchange=None):
    """The pieces of one K (or V) all-gather at the strong configuration: what the cost model adds up."""
    p, dtype = host.size, DTYPES[dtype_name]
    shard_gpu = torch.randn(args.batch, args.seq // p, args.hidden, device=args.device).to(dtype)  # (b, s/p, h)
    host_shard = to_host(shard_gpu)
    gathered_host = tplab.allgather(host_shard, host, algorithm="builtin", check=False)
    pieces = [("d2h_copy", lambda: shard_gpu.cpu()),
              ("host_ring_allgather", lambda: tplab.allgather(host_shard, host, algorithm="ring", check=False)),
              ("host_mpi_allgather", lambda: tplab.allgather(host_shard, host, algorithm="builtin", check=False)),
              ("h2d_copy", lambda: gathered_host.to(args.device))]
    if nccl is not None:
        pieces += [("direct_ring_allgather", lambda: tplab.allgather(shard_gpu, nccl, algorithm="ring", check=False)),
                   ("direct_nccl_allgather", lambda: tplab.allgather(shard_gpu, nccl, algorithm="builtin",
                                                                     check=False))]
    elif vendor is not None:
        pieces += [("direct_vendor_allgather", lambda: vendor(shard_gpu, host))]
    if peers is not None:
        pieces += [("peer_memory_allgather", lambda: peers.allgather_torch(shard_gpu))]
    if exchange is not None:  # (K and V stacked, as the streamed scheme sends them: twice the bytes)
        both = torch.stack([shard_gpu, shard_gpu])
        pieces += [("copy_engine_gather_kv", lambda: exchange.start_gather(both).done())]
    rows = []
    for name, fn in pieces:
        time_s, fastest = measure(fn, host, args)
        rows.append({"kind": "component", "component": name, "p": p, "dtype": dtype_name, "hidden": args.hidden,
                     "seq_len": args.seq, "batch": args.batch, "bytes_per_rank": shard_gpu.numel() * shard_gpu.element_size(),
                     "time_s": time_s, "fastest_rank_s": fastest})
        log(f"  component {name:24} {time_s * 1e3:9.3f} ms")
    return rows


def upgrade_header(csv_path: Path) -> None:
    """A CSV written by an older version of this script (fewer columns) is rewritten with today's columns
    (empty where it had none), so that the rows appended next line up with the header."""
    if not csv_path.exists():
        return
    with open(csv_path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames == COLUMNS:
            return
        old = list(reader)
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(old)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", default=BUILD_GPU,
                        help="where the CSVs go (default: build/gpu in the repository)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--modes", default="strong,weak")
    parser.add_argument("--schemes", default="allgather_kv,ulysses,ring,streamed_kv")
    parser.add_argument("--weak-schemes", default="allgather_kv", help="schemes also run in weak scaling")
    parser.add_argument("--paths", default="all",
                        help="comma-separated paths to run (staged_ring, staged_mpi, direct_ring, direct_nccl, "
                             "direct_peer, direct_copy_engine, direct_vendor, compute_only, compute_floor), or all")
    parser.add_argument("--head-groups", default="1",
                        help="comma-separated G: the all-gather scheme with K/V in G head groups, overlapped "
                             "(1: as it was)")
    parser.add_argument("--side-stream", action="store_true",
                        help="also the all-gather scheme with one head group's gathers on the side stream, while "
                             "the layer computes Q (the rows' path gets the suffix _side)")
    parser.add_argument("--flash-blocks", action="store_true",
                        help="ring and streamed K/V: every block's attention on FlashAttention's kernel, not cuDNN's "
                             "(tplab.layers.attend.cudnn_with_lse = False; the rows' path gets the suffix _flash)")
    parser.add_argument("--eager-merge", action="store_true",
                        help="ring and streamed K/V: each online-softmax merge as eager passes, not the default "
                             "Triton kernel (tplab.sequence.merge_kernel; the rows' path gets the suffix _eager)")
    parser.add_argument("--graphs", action="store_true",
                        help="also time each path of --graph-paths, and the one-GPU layer, as CUDA graph replays "
                             "(two layer calls a graph; path suffix _graph)")
    parser.add_argument("--graph-paths", default="compute_only,direct_copy_engine,fused_kv,direct_peer,direct_nccl,torch_nccl",
                        help="the paths --graphs replays from graphs")
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--layout", default="contiguous", choices=["contiguous", "zigzag"])
    parser.add_argument("--causal", action="store_true", help="causal attention (the course project: full attention)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--no-components", action="store_true")
    parser.add_argument("--watchdog", type=float, default=300.0, help="seconds before a stuck config aborts")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the script")
    args = parser.parse_args()
    OnlineSoftmax.merge_kernel = not args.eager_merge
    sys.modules["tplab.layers.attend"].cudnn_with_lse = not args.flash_blocks   # (the package exports attend())
    args.schemes, args.weak_schemes = args.schemes.split(","), args.weak_schemes.split(",")
    args.head_groups = [int(g) for g in args.head_groups.split(",")]
    args.graph_paths = args.graph_paths.split(",")
    if any(g < 1 or args.heads % g for g in args.head_groups):  # (the layer has as many K/V heads as heads)
        parser.error(f"--head-groups: each G must divide the {args.heads} heads")

    if args.device == "cuda":
        bind_gpu()
    host = world()
    faulthandler.dump_traceback_later(args.watchdog, exit=True)
    nccl, problem = tplab_nccl(host) if args.device == "cuda" else (None, "CPU dry run")
    peers = None
    if nccl is not None and host.size > 1:
        try:                                          # the largest K or V shard: weak scaling, float32
            from tplab.gpu_collectives.peer_memory import PeerMemory

            peers = PeerMemory(host.mpi if hasattr(host, "mpi") else MPI.COMM_WORLD,
                               args.batch * args.seq * args.hidden * 4)
        except Exception as e:  # noqa: BLE001 - reported; the other paths still run
            log(f"  direct_peer skipped: {type(e).__name__}: {e}")
    exchange = None
    if nccl is not None and host.size > 1:
        try:                                          # one rank's K and V, stacked: strong (or weak) scaling, fp32
            from tplab.gpu_collectives.copy_engine_exchange import CopyEngineExchange

            per_rank = args.seq if "weak" in args.modes else args.seq // host.size  # tokens per rank at most
            exchange = [CopyEngineExchange(host.mpi if hasattr(host, "mpi") else MPI.COMM_WORLD,   # compute stream,
                                           2 * args.batch * per_rank * args.hidden * 4) for _ in "ms"]  # side stream
        except Exception as e:  # noqa: BLE001 - reported; the other paths still run
            log(f"  direct_copy_engine skipped: {type(e).__name__}: {e}")
    PATH_EXCHANGES["exchange"] = exchange
    paths = paths_here(host, nccl, problem, args.schemes, args.device, peers, exchange,
                       torch_nccl="torch_nccl" in args.paths.split(","))
    if args.paths != "all":
        chosen = args.paths.split(",")
        log(f"  paths here: {[path[0] for path in paths]}; running {[c for c in chosen if c in [q[0] for q in paths]]}")
        paths = [path for path in paths if path[0] in chosen]
    vendor = next((path[3]["gather"] for path in paths if path[0] == "direct_vendor"), None)
    machine = machine_description(host, args.device)
    log(f"p = {host.size}: {machine}\n  direct path: {'tplab.comm.nccl' if nccl else 'torch.distributed (' + problem + ')'}")

    out = Path(args.out_dir)
    if args.device == "cuda":
        card = torch.cuda.get_device_properties(0).name.replace("NVIDIA ", "").replace(" ", "-")
        csv_path = out / f"sequence_parallel_gpu_{torch.cuda.device_count()}x-{card}.csv"
    else:
        csv_path = out / "sequence_parallel_cpu_dry_run.csv"
    rows = []
    for dtype_name in args.dtypes.split(","):
        block = make_block(args.hidden, args.heads, dtype=DTYPES[dtype_name], device=args.device, seed=0)
        same_everywhere(list(block.parameters()), host)  # sequence parallelism replicates the weights
        whole = unsplit_layer(block, causal=args.causal)  # the course project's "1 GPU": the layer, all tokens
        x_start = make_input(args.batch, args.seq, args.hidden, dtype=DTYPES[dtype_name], device=args.device, seed=1)
        same_everywhere([x_start], host)
        base = unsplit_time(whole, x_start, host, args)  # the starting problem on one GPU
        del x_start
        for mode in args.modes.split(","):
            rows += layer_rows(host, paths, block, whole, dtype_name, mode, args, base)
        del block, whole
        if args.device == "cuda":
            torch.cuda.empty_cache()
        if not args.no_components and host.size > 1:
            rows += component_rows(host, nccl, vendor, dtype_name, args, peers, exchange and exchange[0])
    faulthandler.cancel_dump_traceback_later()
    if host.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        upgrade_header(csv_path)
        fresh = not csv_path.exists()
        with open(csv_path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            if fresh:
                writer.writeheader()
            stamp = datetime.datetime.now().isoformat(timespec="seconds")
            for row in rows:
                gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "none (CPU)"
                writer.writerow({"machine": machine, "gpu": gpu, "run_ranks": host.size, "iters": args.iters,
                                 "warmup": args.warmup, "date": stamp, **row})
        print(f"{len(rows)} rows -> {csv_path}", flush=True)


if __name__ == "__main__":
    main()
