"""What running next to each other costs: a transformer block's compute and its all-reduces, alone and
together on one GPU per rank (notebook 06: why overlapped communication is not free).

    NCCL_NVLS_ENABLE=0 mpiexec -n 4 python scripts/gpu_contention.py [OUT_DIR] \\
        --paths "torch.distributed,tplab peer,tplab copy engine" --peer-blocks 8,16,32 --sm-carveouts 0,16

Overlap hides communication only where running it next to the compute costs less than running it after.
The two compete: for multiprocessors (cuBLAS sizes a GEMM's waves for all 132 SMs of an H100; NCCL's and
tplab's kernels each hold some), for memory bandwidth, and (copy engines) for nothing else. Per path:

    compute_ms        the course project's block for one micro-batch of 4096 tokens at p=4 (QKV, causal flash
                      attention, output projection, MLP: the shapes one rank computes), ``--units`` times
    comm_ms           the all-reduces of those micro-batches alone (2 x 40 MiB bf16 each), one after another
    together_ms       both queued at once on two streams (communication on the high-priority one),
                      until both are done; compute_together_ms / comm_together_ms: when each finished
    overlap_cost_ms   together_ms - compute_ms: what the communication still costs when it runs alongside
                      (0: hidden completely; comm_ms: as if run after). hidden = 1 - cost / comm_ms
    compute_slowdown  compute_together_ms / compute_ms; comm_slowdown likewise

``--sm-carveouts``: cuBLAS told to leave n SMs free (torch._C._set_sm_carveout_experimental) in the
"together" runs. Times: CUDA events, median of ``--iters`` after ``--warmup``, the slowest rank's median.
Writes contention_gpu-<card>-x<p>[_tag].csv (a ``machine`` column names the card).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_overlap import WORLD, machine_name, slug, sm_carveouts, tplab_gpu_paths  # noqa: E402
from tplab.comm.torch_dist import TorchDistributedComm  # noqa: E402
from tplab.layers.attend import attend  # noqa: E402
from tplab.overlap.streams import side_stream  # noqa: E402

BUILD_GPU = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "gpu")  # git-ignored


def block_compute(tokens, hidden, heads, p, dtype):
    """One rank's share of a block's compute for a micro-batch of ``tokens`` tokens (one sequence)."""
    h, local, d = hidden, hidden // p, hidden // heads
    x = torch.randn(tokens, h, dtype=dtype)
    w_qkv, w_o = torch.randn(3 * local, h, dtype=dtype) * h**-0.5, torch.randn(h, local, dtype=dtype) * local**-0.5
    w_up, w_down = torch.randn(4 * local, h, dtype=dtype) * h**-0.5, torch.randn(h, 4 * local, dtype=dtype) * 0.01

    def run():
        q, k, v = F.linear(x, w_qkv).view(1, tokens, 3, heads // p, d).permute(2, 0, 3, 1, 4)  # (1, heads/p, s, d)
        attn = attend(q, k, v, causal=True)                                                   # (1, heads/p, s, d)
        y = F.linear(attn[0].transpose(0, 1).reshape(tokens, local), w_o)                     # (s, h): partial
        return y, F.linear(F.gelu(F.linear(x + y, w_up)), w_down)                       # (s, h): partial

    return run


set_carveout = getattr(torch._C, "_set_sm_carveout_experimental", lambda sms: None)  # (torch >= 2.7)


def allreduce_of(comm):
    import tplab

    return lambda t: tplab.allreduce(t, comm, algorithm="auto", check=False)


def measure(compute, comm, messages, units, carveout, iters, warmup):
    """(compute_ms, comm_ms, together_ms, compute_together_ms, comm_together_ms): slowest rank's medians."""
    reduce = allreduce_of(comm)
    main, side = torch.cuda.current_stream(), side_stream()

    originals = [m.clone() for m in messages]

    def once(do_compute, do_comm):
        for message, original in zip(messages, originals):  # (all-reduced in place: back to the same values)
            message.copy_(original)
        torch.cuda.synchronize()
        comm.barrier()
        start, computed, communicated, end = (torch.cuda.Event(enable_timing=True) for _ in range(4))
        start.record(main)
        side.wait_event(start)
        if do_compute:
            set_carveout(carveout if do_comm and carveout else None)
            for _ in range(units):
                compute()
            set_carveout(None)
        computed.record(main)
        with torch.cuda.stream(side):
            for i in range(units * len(messages) if do_comm else 0):
                reduce(messages[i % len(messages)])
            communicated.record(side)
        main.wait_event(communicated)
        end.record(main)
        end.synchronize()
        return start.elapsed_time(computed), start.elapsed_time(communicated), start.elapsed_time(end)

    def median_of(do_compute, do_comm):
        runs = [once(do_compute, do_comm) for _ in range(warmup + iters)][warmup:]
        mine = [statistics.median(r[i] for r in runs) for i in range(3)]
        return [max(v[i] for v in comm.allgather_object(mine)) for i in range(3)]

    compute_ms = median_of(True, False)[2]
    comm_ms = median_of(False, True)[2]
    compute_together, comm_together, together = median_of(True, True)
    return compute_ms, comm_ms, together, compute_together, comm_together


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", nargs="?", default=BUILD_GPU,
                        help="where the CSVs go (default: build/gpu in the repository)")
    parser.add_argument("--paths", default="torch.distributed,tplab peer,tplab copy engine")
    parser.add_argument("--peer-blocks", default="8,16,32")
    parser.add_argument("--sm-carveouts", default="0,16")
    parser.add_argument("--tokens", type=int, default=4096, help="one micro-batch (the course project: 1 sequence of 4096)")
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--units", type=int, default=4, help="micro-batches: the course project's batch of 4")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()

    local = WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()  # my index among this node's ranks
    torch.cuda.set_device(local)
    device, dtype, p = torch.device("cuda", local), torch.bfloat16, WORLD.size
    nbytes = args.tokens * args.hidden * 2
    paths = {"torch.distributed": TorchDistributedComm(device, in_place=True)}
    paths.update(tplab_gpu_paths(args.paths, args.peer_blocks, nbytes))
    paths = {name: c for name, c in paths.items() if name.split(" (")[0] in args.paths}
    machine = machine_name(device)
    nccl_env = " ".join(f"{k}={os.environ[k]}" for k in ("NCCL_MAX_CTAS", "NCCL_MIN_CTAS", "TORCH_NCCL_HIGH_PRIORITY")
                        if k in os.environ)
    with torch.device(device):
        compute = block_compute(args.tokens, args.hidden, args.heads, p, dtype)
        messages = [torch.randn(args.tokens, args.hidden, dtype=dtype) for _ in range(2)]  # attention's, MLP's
    rows = []
    for (name, comm), carveout in [(pc, int(c)) for pc in paths.items() for c in sm_carveouts(args.sm_carveouts)]:
        with torch.no_grad():
            compute_ms, comm_ms, together, compute_t, comm_t = measure(compute, comm, messages, args.units, carveout,
                                                                       args.iters, args.warmup)
        cost = together - compute_ms
        rows.append({"machine": machine, "path": name, "ranks": p, "gemm_sm_carveout": carveout,
                     "path_detail": f"{comm.blocks_used} blocks" if getattr(comm, "blocks_used", None) else
                     (nccl_env if name == "torch.distributed" else ""),
                     "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "default (8)"),
                     "tokens": args.tokens * args.units, "hidden": args.hidden, "message_bytes": nbytes,
                     "allreduces": 2 * args.units, "compute_ms": compute_ms, "comm_ms": comm_ms,
                     "together_ms": together, "compute_together_ms": compute_t, "comm_together_ms": comm_t,
                     "overlap_cost_ms": cost, "hidden_fraction": 1 - cost / comm_ms,
                     "compute_slowdown": compute_t / compute_ms, "comm_slowdown": comm_t / comm_ms, "iters": args.iters})
        if WORLD.rank == 0:
            r = rows[-1]
            print(f"{name:28s} carveout {carveout:2d}: compute {compute_ms:.3f} comm {comm_ms:.3f} together {together:.3f}"
                  f" (compute x{r['compute_slowdown']:.2f}, comm x{r['comm_slowdown']:.2f}) hidden {r['hidden_fraction']:.2f}",
                  flush=True)
    if WORLD.rank == 0:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"contention_gpu-{slug(torch.cuda.get_device_name(device))}-x{p}" + (f"_{slug(args.tag)}" if args.tag else "")
        pd.DataFrame(rows).to_csv(out / f"{stem}.csv", index=False)
        print(f"wrote {out / stem}.csv")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
