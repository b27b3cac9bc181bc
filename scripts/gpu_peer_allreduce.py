"""tplab's peer-memory and copy-engine all-reduces against NCCL, on one GPU node, in one run.

    NCCL_NVLS_ENABLE=0 mpiexec -n 4 python3 scripts/gpu_peer_allreduce.py [OUT_DIR] [--quick]   # default build/gpu

Implementations (tplab.gpu_collectives.peer_memory, tplab.gpu_collectives.copy_engine; NCCL through CuPy's binding, no wrapper):

    nccl            ncclAllReduce
    one_shot        peer memory, flags in GPU memory, one kernel: every rank reads all p buffers
    one_shot_ll     the same pushed: each rank writes its data, flags beside it, into every peer (LL)
    two_shot        the same, reduce-scatter by pushing chunks to their owners, allgather by pulling
    two_shot_pull   the same, both rounds by reading peers (the input copied into the shared buffer first)
    ring            the same, the textbook ring: 2(p-1) steps, each writing into the right neighbour
    ring_pull       the same ring reading from the left neighbour (its own chunk copied in first)
    copy_engine     two-shot whose bytes move by the GPUs' copy engines (no SMs), flags between rounds
    ring/nccl       tplab's Python ring over NCCL send/recv (tplab.comm.nccl), for reference
    input=registered: the input already lies in the rank's shared buffer (nothing copied in; in place;
                    two_shot and ring then run as two_shot_pull and ring_pull)

1. Correctness against NCCL (float64 reference): int32, int64, float16, bfloat16, float32, float64; counts
   0, 1, 7, p+1, 1023, 4101, 65537, 2^20+3; a misaligned view; every call twice (buffer reuse); the result
   bitwise identical on every rank; and inside a CUDA graph.               -> printed, and correctness rows
2. Latency and bandwidth, float32 sum, 1 KiB .. 256 MiB per rank: `iters` calls back to back between two
   CUDA events (what a layer sees: the host launches while the GPU works), 7 such batches, the median,
   the slowest rank's; and for <= 1 MiB also replayed from a CUDA graph of `iters` calls (no host at all).
   nccl-tests columns, one CSV: OUT_DIR/gpu_peer_allreduce_<p>x-<card>.csv
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import os
import sys
from pathlib import Path

import cupy
import numpy as np
import pandas as pd
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import tplab  # noqa: E402
from tplab.toolkit.bfloat16 import narrow, widen  # noqa: E402
from tplab.comm import nccl_world  # noqa: E402
from tplab.gpu_collectives.copy_engine import CopyEngineComm  # noqa: E402
from tplab.gpu_collectives.peer_memory import PeerMemory  # noqa: E402

BUILD_GPU = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "gpu")  # git-ignored

COMM = MPI.COMM_WORLD
P, R = COMM.size, COMM.rank
NCCL_TYPES = {"float32": 7, "float64": 8, "int32": 2, "int64": 4, "float16": 6}  # ncclFloat32 ... (nccl.h)


def say(*args):
    if R == 0:
        print(*args, flush=True)


def bf16_bits(values: np.ndarray) -> cupy.ndarray:
    """float64 values -> bfloat16 bits (int16, rounded to nearest even) on the GPU."""
    return narrow(cupy.asarray(values.astype(np.float32)))


def bf16_values(bits) -> cupy.ndarray:
    return widen(bits).astype(cupy.float64)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", nargs="?", default=BUILD_GPU,
                        help="where the CSVs go (default: build/gpu in the repository)")
    parser.add_argument("--max-bytes", default=256 << 20, type=int)
    parser.add_argument("--quick", action="store_true", help="correctness and a few sizes only")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(420, exit=True)  # a deadlocked kernel must not eat the whole lease

    nccl = nccl_world()
    raw = nccl.nccl  # CuPy's NcclCommunicator
    pm = PeerMemory(COMM, args.max_bytes)
    ce = CopyEngineComm(COMM, args.max_bytes)
    props = cupy.cuda.runtime.getDeviceProperties(pm.device)
    card = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    v = cupy.cuda.nccl.get_version()
    machine = (f"{P}x {card} (one node, NVLink), NCCL {v // 10000}.{v // 100 % 100}.{v % 100}, "
               f"CuPy {cupy.__version__}, {props['multiProcessorCount']} SMs")
    say(machine)

    def nccl_allreduce(x, out):
        raw.allReduce(x.data.ptr, out.data.ptr, x.size, NCCL_TYPES[str(x.dtype)], 0,
                      cupy.cuda.get_current_stream().ptr)

    # ---- 1. correctness ------------------------------------------------------------------------------
    bad = total = 0

    def verdict(name, got, want, scale, tol):
        nonlocal bad, total
        ok = bool((cupy.abs(got - want) <= tol * scale + 1e-300).all()) if got.size else True
        same = len(set(COMM.allgather(hashlib.sha256(cupy.asnumpy(got).tobytes()).hexdigest()))) == 1
        everywhere = all(COMM.allgather(ok and same))
        total += 1
        if not everywhere:
            bad += 1
            say(f"  FAILED {name}: within tolerance={ok} same on every rank={same}")

    tolerances = {"int32": 0, "int64": 0, "float16": 2e-3 * P, "bfloat16": 1e-2 * P, "float32": 1e-6 * P,
                  "float64": 1e-14 * P}
    for dtype in tolerances:
        for count in [0, 1, 7, P + 1, 1023, 4101, 65537, (1 << 20) + 3]:
            rng = np.random.default_rng([count, R])
            values = rng.standard_normal(count)
            if dtype.startswith("int"):
                x = cupy.asarray(rng.integers(-1000, 1000, count).astype(dtype))
                as64 = x.astype(cupy.int64)
            elif dtype == "bfloat16":
                x = bf16_bits(values)
                as64 = bf16_values(x)
            else:
                x = cupy.asarray(values.astype(dtype))
                as64 = x.astype(cupy.float64)
            want = nccl.builtin_allreduce(as64)
            scale = nccl.builtin_allreduce(cupy.abs(as64).astype(cupy.float64)) if count else as64
            bf16 = dtype == "bfloat16"

            def value(y):
                return bf16_values(y) if bf16 else y.astype(cupy.int64 if dtype.startswith("int") else cupy.float64)

            for algorithm in ["one_shot", "one_shot_ll", "two_shot", "two_shot_pull", "ring", "ring_pull", "auto"]:
                if x.nbytes > pm.limit(algorithm):
                    continue
                first = pm.allreduce(x, algorithm, bf16=bf16)
                again = pm.allreduce(x, algorithm, bf16=bf16)
                verdict(f"{algorithm} {dtype} n={count}", value(first), want, scale, tolerances[dtype])
                verdict(f"{algorithm} {dtype} n={count} (second call)", value(again), value(first), scale, 0)
                if algorithm in ("one_shot", "two_shot", "ring") and count:
                    buf = pm.buffer(count, x.dtype)
                    buf[...] = x
                    pm.allreduce(buf, algorithm, out=buf, bf16=bf16)
                    verdict(f"{algorithm} {dtype} n={count} registered, in place", value(buf.copy()), want,
                            scale, tolerances[dtype])
            if dtype != "bfloat16":
                y = ce.builtin_allreduce(x)
                verdict(f"copy_engine {dtype} n={count}", value(y), want, scale, tolerances[dtype])
            else:
                y = x.copy()
                ce.allreduce_(y, "bf16_bits")
                verdict(f"copy_engine {dtype} n={count}", value(y), want, scale, tolerances[dtype])
    base = cupy.arange(4097, dtype=cupy.float32) + R
    # a view 4 bytes into its allocation
    for algorithm in ["one_shot", "one_shot_ll", "two_shot", "two_shot_pull", "ring", "ring_pull"]:
        got = pm.allreduce(base[1:], algorithm)
        want = nccl.builtin_allreduce(base[1:].astype(cupy.float64))
        verdict(f"{algorithm} misaligned view", got.astype(cupy.float64), want, cupy.abs(want), 1e-6 * P)
    try:                                                             # CUDA graphs: 10 all-reduces captured
        stream = cupy.cuda.Stream(non_blocking=True)
        for algorithm in ["one_shot", "one_shot_ll", "two_shot", "two_shot_pull", "ring", "ring_pull"]:
            x = cupy.asarray(np.random.default_rng(R).standard_normal(1 << 14).astype(np.float32))
            out = cupy.zeros_like(x)
            run = pm.allreduce_init(x, out, algorithm)
            with stream:
                stream.begin_capture()
                for _ in range(10):
                    run()
                graph = stream.end_capture()
                out.fill(0)
                graph.launch(stream)
                stream.synchronize()
            want = nccl.builtin_allreduce(x.astype(cupy.float64))
            verdict(f"{algorithm} in a CUDA graph", out.astype(cupy.float64), want, cupy.abs(want) + 1, 1e-6 * P)
    except Exception as e:  # noqa: BLE001 - reported; the timings still run
        bad += 1
        say(f"  FAILED CUDA graph capture: {type(e).__name__}: {e}")
    say(f"correctness p={P}: {total - bad} of {total} cases ok")
    rows = [{"collective": "allreduce", "algorithm": "correctness", "ranks": P, "cases": total, "failed": bad,
             "machine": machine}]

    # ---- 2. timing ------------------------------------------------------------------------------------
    stream = cupy.cuda.Stream(non_blocking=True)

    def timed(run, iters, graph=False):
        """Per-call microseconds: the median of 7 batches of `iters` calls, the slowest rank's."""
        with stream:
            for _ in range(3):
                run()
            if graph:
                stream.begin_capture()
                for _ in range(iters):
                    run()
                g = stream.end_capture()
                g.launch(stream)
            batches = []
            for _ in range(7):
                stream.synchronize()
                COMM.Barrier()
                start, end = stream.record(), None
                if graph:
                    g.launch(stream)
                else:
                    for _ in range(iters):
                        run()
                end = stream.record()
                end.synchronize()
                batches.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / iters)
        return max(COMM.allgather(float(np.median(batches))))

    sizes = [1 << k for k in range(10, 29, 2) if (1 << k) <= args.max_bytes]
    if args.quick:
        sizes = [1 << 10, 1 << 16, 1 << 20, 1 << 24, 1 << 26]
    for size in sizes:
        n = size // 4
        x = cupy.ones(n, dtype=cupy.float32)
        out = cupy.empty_like(x)
        iters = 20 if size <= (1 << 20) else 10 if size <= (16 << 20) else 5
        runs = {("nccl", "copied"): lambda: nccl_allreduce(x, out)}
        for algorithm in ["one_shot", "one_shot_ll", "two_shot", "two_shot_pull", "ring", "ring_pull"]:
            if size > pm.limit(algorithm):
                continue                                 # reads (p-1)·n: pointless this large
            runs[(algorithm, "copied")] = pm.allreduce_init(x, out, algorithm)
            if algorithm in ("two_shot", "ring"):
                buf = pm.buffer(n, cupy.float32)
                buf.fill(1)
                runs[(algorithm + "_pull", "registered")] = \
                    pm.allreduce_init(buf, buf, algorithm)
        if size <= (1 << 20):                            # the plain call: argument handling each time
            runs[("one_shot", "copied, allreduce() call")] = lambda: pm.allreduce(x, "one_shot", out, check=False)
        y = x.copy()
        runs[("copy_engine", "copied")] = lambda: ce.allreduce_(y, "float")
        if size >= (16 << 20):
            runs[("ring/nccl", "copied")] = lambda: tplab.allreduce(x, nccl, algorithm="ring", check=False)
        line = []
        for (name, where), run in runs.items():
            graphable = name in ("nccl", "one_shot", "one_shot_ll", "two_shot") and where != "copied, allreduce() call"
            modes = ["eager"] + (["graph"] if size <= (1 << 20) and graphable else [])
            for mode in modes:
                try:
                    t = timed(run, iters, graph=mode == "graph")
                except Exception as e:  # noqa: BLE001 - a path that cannot run here is reported, not fatal
                    say(f"  {name} {mode} at {size} B: {type(e).__name__}: {e}")
                    continue
                algbw = size / t / 1e3
                rows.append({"collective": "allreduce", "algorithm": name, "input": where, "mode": mode, "ranks": P,
                             "size": size, "count": n, "type": "float32", "redop": "sum", "time_us": t,
                             "algbw": algbw, "busbw": algbw * 2 * (P - 1) / P, "wrong": -1, "iters": iters,
                             "machine": machine})
                mark = {"registered": "*", "copied, allreduce() call": "()"}.get(where, "")
                line.append(f"{name}{mark}{'/g' if mode == 'graph' else ''} {t:.1f}")
        say(f"{size:>10} B  " + "  ".join(line))
        if R == 0:
            Path(args.out_dir).mkdir(parents=True, exist_ok=True)
            slug = card.split()[-1].lower().replace(" ", "-")
            pd.DataFrame(rows).to_csv(Path(args.out_dir) / f"gpu_peer_allreduce_{P}x-{slug}.csv", index=False)
    COMM.Barrier()
    ce.close()
    pm.close()
    faulthandler.cancel_dump_traceback_later()
    say("done")


if __name__ == "__main__":
    main()
