"""Where a small all-reduce's GPU time goes: the peer-memory kernels and their parts, replayed from CUDA graphs.

    NCCL_NVLS_ENABLE=0 mpiexec -n 4 python3 scripts/gpu_time_parts.py OUT_DIR [--stage NAME]

Per call, replayed from a CUDA graph of 50 calls (median of 9 replays, the slowest rank), float32: an empty
kernel (what any kernel in a graph costs), the agreement alone (``agree_only``: each rank sends its arguments'
signature to every peer and waits for theirs), one_shot / one_shot_ll / one_shot_lamport at 1-256 KiB (and
one_shot_lamport at 512 KiB and 1 MiB) with the agreement and without it (signature 0: the kernel alone, as when
the ranks have agreed before), two_shot_lamport at 16 KiB to its limit (2 MiB at p = 4) and two_shot at 256 KiB-16 MiB.
Every result is checked.
Writes OUT_DIR/gpu_allreduce_time_parts_<card>.csv (one row per part; ``stage`` names the code measured).
"""

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupy  # noqa: E402
from mpi4py import MPI  # noqa: E402

from tplab.gpu_collectives import peer_memory  # noqa: E402
from tplab.gpu_collectives.peer_memory import PeerMemory  # noqa: E402

WORLD = MPI.COMM_WORLD


def graph_us(run, iters=50, reps=9):
    """µs per call of ``run`` replayed from a CUDA graph of ``iters`` calls: median of ``reps``, slowest rank."""
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        for _ in range(3):
            run()
        stream.synchronize()
        WORLD.Barrier()
        stream.begin_capture()
        for _ in range(iters):
            run()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(reps):
            WORLD.Barrier()
            start = stream.record()
            graph.launch(stream)
            end = stream.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / iters)
    return max(WORLD.allgather(float(np.median(times))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--stage", default="as committed", help="a name for the code measured (a CSV column)")
    parser.add_argument("--lamport-threads", type=int, default=0, help="the Lamport kernels' threads per block "
                        "at every size (default: peer_memory.LAMPORT_THREADS, by size)")
    args = parser.parse_args()
    if args.lamport_threads:
        peer_memory.LAMPORT_THREADS = (args.lamport_threads, args.lamport_threads)
    cupy.cuda.Device(WORLD.rank % cupy.cuda.runtime.getDeviceCount()).use()
    peers = PeerMemory(WORLD, 64 << 20)
    card = cupy.cuda.runtime.getDeviceProperties(peers.device)["name"].decode()
    if WORLD.rank == 0:
        print(f"programmatic dependent launch in graphs: {'yes' if peers.programmatic else 'no'}", flush=True)
    empty = cupy.RawKernel(r'extern "C" __global__ void empty() {}', "empty")
    rows = []

    def add(kernel, size, agreement, us):
        rows.append(dict(stage=args.stage, ranks=WORLD.size, size=size, kernel=kernel, agreement=agreement,
                         graph_us=round(us, 3), card=card))
        if WORLD.rank == 0:
            said = "with" if agreement else "without"
            print(f"{kernel:>14} {size:>8} B {said:>7} agreement  {us:7.2f} us", flush=True)

    add("empty kernel", 0, False, graph_us(lambda: empty((1,), (512,), ())))
    add("agree_only", 0, True, graph_us(lambda: peers.launch_agreement(12345)))
    for size in (1 << 10, 16 << 10, 64 << 10, 256 << 10, 512 << 10, 1 << 20):
        x = cupy.ones(size // 4, cupy.float32)
        out = cupy.empty_like(x)
        for kernel in ("one_shot", "one_shot_ll", "one_shot_lamport"):
            if size > peers.limit(kernel) or (size > 256 << 10 and kernel != "one_shot_lamport"):
                continue                                   # (past 256 KiB: the one "auto" runs there)
            for agreement in (True, False):
                run = peers.allreduce_init(x, out, kernel, sig=None if agreement else 0)
                add(kernel, size, agreement, graph_us(run))
                if not all(WORLD.allgather(bool((out == WORLD.size).all()))):
                    raise SystemExit(f"{kernel} at {size} B: wrong sums")
    for size in (16 << 10, 64 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 16 << 20):   # the two-shots
        x = cupy.ones(size // 4, cupy.float32)
        out = cupy.empty_like(x)
        for kernel in ("two_shot_lamport", "two_shot"):
            if size > peers.limit(kernel) or (kernel == "two_shot" and size < 256 << 10):
                continue
            add(kernel, size, True, graph_us(peers.allreduce_init(x, out, kernel)))
            if not all(WORLD.allgather(bool((out == WORLD.size).all()))):
                raise SystemExit(f"{kernel} at {size} B: wrong sums")
    peers.close()
    if WORLD.rank == 0:
        import pandas as pd

        args.out_dir.mkdir(parents=True, exist_ok=True)
        path = args.out_dir / f"gpu_allreduce_time_parts_{card.lower().replace('nvidia ', '').split()[0]}.csv"
        pd.DataFrame(rows).to_csv(path, index=False)
        print(f"wrote {path}")


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main()
