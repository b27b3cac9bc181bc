"""Do peer copies change when captured in a CUDA graph? One process, two GPUs of one node.

    python scripts/gpu_graph_copies.py OUT_DIR [--reps 9]

Peer copies GPU 0 -> GPU 1 (cudaMemcpyAsync, 64 MiB each; the kind of copy tplab's copy-engine exchange makes)
and bf16 GEMMs (8192^3) on GPU 0, each variant run eagerly and replayed from a CUDA graph of the same calls:

    gemms                    8 GEMMs, nothing else
    peer copies              24 copies on one side stream (their bandwidth: GB/s)
    local copies             the same within GPU 0
    pipeline                 async TP's pattern: copy i on a side stream, GEMM i waits for it; copy i+1 under GEMM i
    pipeline, 3 copies/step  the same with three copies before each GEMM

Per variant and mode: median, min and max of ``reps`` timings (CUDA events), and from one profiled run the
order in which the operations ran with the stream each ran on (G: GEMM, C: copy; the digit numbers the streams
in order of appearance) and the profiler's name for the copies. Writes OUT_DIR/gpu_graph_copies_<card>.csv.
"""

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from tplab.toolkit.timing import time_once

NB = 64 << 20
STEPS = 8


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    import cupy

    if torch.cuda.device_count() < 2 or not torch.cuda.can_device_access_peer(0, 1):
        raise SystemExit("needs two GPUs with peer access")
    torch.cuda.set_device(0)
    src = torch.ones(NB, dtype=torch.uint8, device="cuda:0")
    far = torch.empty(8 * NB, dtype=torch.uint8, device="cuda:1")
    near = torch.empty(8 * NB, dtype=torch.uint8, device="cuda:0")
    far[:NB].copy_(src)                                   # (torch enables peer access)
    torch.cuda.synchronize()
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda:0")
    b, c = torch.randn_like(a), torch.empty_like(a)
    main_stream, side = torch.cuda.Stream(), torch.cuda.Stream()

    def copy(target, i, stream):
        cupy.cuda.runtime.memcpyAsync(target.data_ptr() + (i % 8) * NB, src.data_ptr(), NB, 3, stream.cuda_stream)

    def gemms():
        for _ in range(STEPS):
            torch.mm(a, b, out=c)

    def copies(target):
        def run():
            side.wait_stream(torch.cuda.current_stream())
            for i in range(3 * STEPS):
                copy(target, i, side)
            torch.cuda.current_stream().wait_stream(side)
        return run

    def pipeline(per_step):
        def run():
            here = torch.cuda.current_stream()
            side.wait_stream(here)
            landed = []
            for i in range(STEPS):
                for j in range(per_step):
                    copy(far, i * per_step + j, side)
                landed.append(side.record_event())
            for event in landed:
                here.wait_event(event)
                torch.mm(a, b, out=c)
            here.wait_stream(side)
        return run

    variants = {"gemms": gemms, "peer copies": copies(far), "local copies": copies(near),
                "pipeline": pipeline(1), "pipeline, 3 copies/step": pipeline(3)}
    moved = {"peer copies": 3 * STEPS * NB, "local copies": 3 * STEPS * NB}
    card = torch.cuda.get_device_name(0)
    rows = []
    for name, run in variants.items():
        with torch.cuda.stream(main_stream):
            run()
            run()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=main_stream):
            run()
        for mode, go in (("eager", run), ("graph", graph.replay)):
            ms = timed(go, main_stream, args.reps)
            order, copy_name = streams_used(go, main_stream)
            row = dict(variant=name, mode=mode, median_ms=round(float(np.median(ms)), 3),
                       min_ms=round(min(ms), 3), max_ms=round(max(ms), 3),
                       gbps=round(moved[name] / np.median(ms) / 1e6, 1) if name in moved else None,
                       copies_named=copy_name, order_and_streams=order, card=card)
            rows.append(row)
            print(f"{name:<24} {mode:<5} {row['median_ms']:8.3f} ms ({row['min_ms']:.3f}-{row['max_ms']:.3f})"
                  f"{'' if row['gbps'] is None else '  %s GB/s' % row['gbps']}"
                  f"  {copy_name}  {order}", flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"gpu_graph_copies_{card.lower().replace('nvidia ', '').split()[0]}.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    print(f"wrote {path}")


def timed(go, stream, reps):
    with torch.cuda.stream(stream):   # (CUDA events on this stream, after the GPU's queued work is done)
        return [time_once(go, cuda=True) * 1e3 for _ in range(reps)]


def streams_used(go, stream):
    """The GPU's operations of one run in the order they started, each as G (GEMM) or C (copy) and its stream's
    number; and the profiler's name for the copies."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.cuda.stream(stream):
            go()
        torch.cuda.synchronize()
    ops = sorted((e for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith("Memset")),
                 key=lambda e: e.time_range.start)
    numbers, copy_names = {}, set()
    order = []
    for e in ops:
        gemm = "nvjet" in e.name or "gemm" in e.name.lower()
        if not gemm:
            copy_names.add(e.name.split(" (")[0])
        order.append(("G" if gemm else "C") + str(numbers.setdefault(e.device_resource_id, len(numbers))))
    return " ".join(order), "/".join(sorted(copy_names)) or "-"


if __name__ == "__main__":
    main()
