"""What a call of the public API costs on GPUs: tplab.allreduce on a PeerMemoryComm next to
torch.distributed.all_reduce (NCCL) and tplab's persistent kernel handle, same run, same GPUs.

    NCCL_NVLS_ENABLE=0 mpiexec -n 4 python scripts/gpu_api_allreduce.py OUT_DIR [--max-bytes 256M]

Eager, back to back: each path runs ``iters`` calls in a row on torch's current stream, timed by CUDA events
around the loop (time per call = loop / iters), median of ``reps`` loops, the slowest rank's. Two more
columns say what bounds that time: ``host_us``, the host's time per call (the loop on a wall clock, without
waiting for the GPU), and ``gpu_us_host_ahead``, the GPU's own time per call when the host is ahead of it, as
in a model whose GEMMs take longer than their launches: the same loop queued behind a 10 ms sleep kernel, the
events around the queued calls only. Every size
is checked first: each path's result equals NCCL's (integer-valued float32, so sums are exact). "auto" picks
its kernel by size from timings made first on these GPUs (PeerMemoryComm.tune). Writes
OUT_DIR/gpu_api_allreduce_<p>x-<card>.csv in nccl-tests' columns plus ``path``; prints the table.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupy  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

import tplab  # noqa: E402
from tplab.comm import nccl_world  # noqa: E402
from tplab.comm.torch_dist import TorchDistributedComm, stop_process_group  # noqa: E402
from tplab.gpu_collectives import PeerMemoryComm  # noqa: E402
from tplab.toolkit.arrays import external_stream  # noqa: E402
from tplab.toolkit.machine import software  # noqa: E402

WORLD = MPI.COMM_WORLD
SLEEP_CYCLES = 20_000_000   # about 10 ms at a Hopper GPU's clock: longer than the host takes to queue a loop
SLEEP_US = SLEEP_CYCLES / 2e3   # (at ~2 GHz)


def size_arg(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def per_call_us(run, iters, reps, host_ahead=False):
    """Median over ``reps`` loops of ``iters`` back-to-back calls, in µs per call, the slowest rank's: the
    GPU's time (CUDA events) and the host's (a wall clock around the loop). ``host_ahead``: the loop is
    queued behind a sleep kernel, so the events time the GPU alone."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    times, host = [], []
    for _ in range(reps):
        WORLD.Barrier()
        if host_ahead:
            torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        for _ in range(iters):
            run()
        host.append((time.perf_counter() - began) * 1e6 / iters)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return max(WORLD.allgather(float(np.median(times)))), max(WORLD.allgather(float(np.median(host))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--max-bytes", type=size_arg, default=256 << 20)
    parser.add_argument("--min-bytes", type=size_arg, default=1 << 10)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    nccl = nccl_world()
    torch.cuda.set_device(cupy.cuda.Device().id)
    p, rank = WORLD.size, WORLD.rank
    comm = PeerMemoryComm(nccl, args.max_bytes)
    comm.tune()  # "auto" picks the kernel measured fastest here, by size
    if rank == 0:
        print("kernels by size:", comm.peers.table, flush=True)
    TorchDistributedComm(torch.device("cuda", torch.cuda.current_device()))  # starts the process group
    card = torch.cuda.get_device_name()
    rows, size = [], args.min_bytes
    while size <= args.max_bytes:
        n = size // 4
        x = (torch.arange(n, device="cuda", dtype=torch.float32) % 13) + rank
        want = x.clone()
        dist.all_reduce(want)
        out = torch.empty_like(x)
        persistent = comm.peers.allreduce_init(cupy.from_dlpack(x), cupy.from_dlpack(out), "auto")
        torch_stream = external_stream(torch.cuda.current_stream().cuda_stream)

        def run_persistent():
            with torch_stream:
                persistent()
        dist_buffer = x.clone()
        paths = {"tplab.allreduce": lambda: tplab.allreduce(x, comm),
                 "torch.distributed": lambda: dist.all_reduce(dist_buffer),
                 "persistent kernel": run_persistent}
        checks = {"tplab.allreduce": lambda: tplab.allreduce(x, comm),
                  "persistent kernel": lambda: (run_persistent(), out)[1]}
        wrong = {name: int(not torch.equal(check(), want)) for name, check in checks.items()}
        wrong["torch.distributed"] = 0
        wrong = {k: max(WORLD.allgather(v)) for k, v in wrong.items()}
        iters = max(5, min(200, (64 << 20) // size * 5))
        for name, run in paths.items():
            t, host = per_call_us(run, iters, args.reps)
            ahead, queued = per_call_us(run, min(iters, 200), args.reps, host_ahead=True)
            if queued * min(iters, 200) > 0.8 * SLEEP_US and rank == 0:
                print(f"warning: {name} at {size} B: the host took about as long as the sleep kernel to queue the "
                      f"loop, so gpu_us_host_ahead may include host time", flush=True)
            algbw = size / t / 1e3
            rows.append(dict(size=size, count=n, type="float", redop="sum", time_us=round(t, 2),
                             algbw=round(algbw, 3), busbw=round(algbw * 2 * (p - 1) / p, 3), wrong=wrong[name],
                             host_us=round(host, 2), gpu_us_host_ahead=round(ahead, 2),
                             path=name, kernel=comm.peers.choose(size) if name != "torch.distributed" else "nccl",
                             ranks=p, card=card, software=software()))
        if rank == 0:
            line = "  ".join(f"{r['path']} {r['time_us']:>7.2f} (host {r['host_us']:.2f}, GPU {r['gpu_us_host_ahead']:.2f})"
                             for r in rows[-3:])
            print(f"{size:>11} B  {line}", flush=True)
        size *= 4
    if rank == 0:
        import pandas as pd

        args.out_dir.mkdir(parents=True, exist_ok=True)
        slug = card.lower().replace("nvidia ", "").split()[0]
        path = args.out_dir / f"gpu_api_allreduce_{p}x-{slug}.csv"
        pd.DataFrame(rows).to_csv(path, index=False)
        print(f"wrote {path}")
    comm.close()
    stop_process_group(MPI.COMM_WORLD)   # (rank 0, the rendezvous store's host, last)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
