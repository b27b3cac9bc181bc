"""tplab's hand-written all-reduce on GPUs against NCCL's, in one run on one machine.

    mpiexec -n 4 python3 scripts/gpu_collectives.py --out DIR          # one rank per GPU; default build/gpu

1. Correctness: every allreduce algorithm on every GPU transport (NCCL point-to-point, MPI staged
   pipelined, MPI staged naive) against NCCL's all-reduce, for int32/int64/float16/float32/float64 CuPy
   arrays and float32/bfloat16 torch tensors, counts 0, 1, odd, around p, large: integers exactly, floats
   within the rounding bound of a p-term sum, bitwise identical on every rank. -> correctness.csv
2. Timing, float32 sum, 1 KiB .. 256 MiB per rank: NCCL's all-reduce (called straight through CuPy's
   binding; also through torch.distributed when it starts), tplab's builtin wrapper, ring, recursive
   doubling, Rabenseifner over NcclComm, ring over MPI staging (pipelined), the host-staged MPI_Allreduce
   (the course project's way) and MPI_Allreduce on host arrays of the same size. Each point: warm-up, then each
   iteration started together (stream synchronised, MPI barrier) and timed with CUDA events (host clock
   for host MPI); time_us = the slowest rank's median; wrong = elements off NCCL's result.
   -> allreduce.csv in nccl-tests columns with the machine (GPU name, NCCL version) in every row.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import cupy
import numpy as np
from mpi4py import MPI

import tplab
from tplab.comm import StagedComm, nccl_world, world
from tplab.comm.nccl import import_nccl
from tplab.comm.staged import cuda_aware_mpi
from tplab.toolkit.machine import mpi_library

BUILD_GPU = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "gpu")  # git-ignored

COMM = MPI.COMM_WORLD
P, RANK = COMM.size, COMM.rank
ALGORITHMS = ["naive", "ring", "recursive_doubling", "rabenseifner", "tree", "hierarchical", "builtin"]


def say(*args):
    if RANK == 0:
        print(*args, flush=True)


def sizes_between(lo: int, hi: int, factor: int = 4) -> list[int]:
    out = [lo]
    while out[-1] * factor <= hi:
        out.append(out[-1] * factor)
    return out


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def machine_description(staged) -> str:
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    v = import_nccl().get_version()
    nccl = f"{v // 10000}.{v % 10000 // 100}.{v % 100}"
    mpi = mpi_library()[:60]
    gpus = cupy.cuda.runtime.getDeviceCount()
    who = f"{P}x {name}" if P == gpus else f"{P} of the {gpus} {name}"
    try:
        import torch

        torch_version = f", torch {torch.__version__}"
    except ImportError:
        torch_version = ""
    return (f"{who} of one node, NCCL {nccl}, CuPy {cupy.__version__}{torch_version}, {mpi}, "
            f"CUDA-aware MPI: {'yes' if staged.cuda_aware else 'no'}")


# ---- 1. correctness --------------------------------------------------------------------------------------------
def digest(a) -> str:
    return hashlib.sha256(cupy.asnumpy(a).tobytes()).hexdigest()


def check_one(transport, comm, nccl, algorithm, dtype, count) -> dict:
    """One case; collective. Returns the row (identical on every rank)."""
    rng = np.random.default_rng([count, RANK, len(dtype)])
    torch_dtype = dtype.startswith("torch.")
    dt = np.dtype("float32" if torch_dtype else dtype)
    host = (rng.integers(-1000, 1000, size=count) if dt.kind in "iu" else rng.standard_normal(count)).astype(dt)
    x = cupy.asarray(host)
    if torch_dtype:
        import torch

        x = torch.from_dlpack(x).to(getattr(torch, dtype.split(".")[1]))
        host = x.float().cpu().numpy()
    error = ""
    try:
        got = tplab.allreduce(x, comm, algorithm=algorithm)
        want = nccl.builtin_allreduce(x, "sum")
        if torch_dtype:
            ok_type = got.dtype == x.dtype and got.device == x.device
            got, want = got.float().cpu().numpy(), want.float().cpu().numpy()
        else:
            ok_type = isinstance(got, cupy.ndarray) and got.dtype == x.dtype and got.shape == x.shape
            got, want = cupy.asnumpy(got), cupy.asnumpy(want)
    except Exception as e:  # noqa: BLE001 - recorded, and every rank goes on to the next case
        ok_type, got, want, error = False, np.zeros(count), np.ones(count), f"{type(e).__name__}: {e}"[:200]
    scale = np.empty(count)
    COMM.Allreduce(np.abs(host.astype(np.float64)), scale)
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    if dt.kind in "iu":
        ok_values = not np.any(err)
    else:
        eps = 2.0 ** -8 if dtype == "torch.bfloat16" else np.finfo(dt).eps
        ok_values = bool(np.all(err <= 2 * P * eps * scale + 1e-30))
    identical = len(set(COMM.allgather(hashlib.sha256(got.tobytes()).hexdigest()))) == 1
    oks = COMM.allgather(bool(ok_type and ok_values and identical and not error))
    errors = [e for e in COMM.allgather(error) if e]
    return {"transport": transport, "algorithm": algorithm, "type": dtype, "count": count, "ranks": P,
            "ok": all(oks), "max_error": float(COMM.allreduce(err.max(initial=0.0), op=MPI.MAX)),
            "identical_on_ranks": identical, "error": errors[0] if errors else ""}


def correctness(transports, nccl, big: int) -> list[dict]:
    rows = []
    counts = sorted({0, 1, 7, P + 1, 1023, 65537, big + 3})
    for transport, comm in transports.items():
        for algorithm in ALGORITHMS:
            for dtype in ["int32", "int64", "float16", "float32", "float64", "torch.float32", "torch.bfloat16"]:
                for count in counts:
                    if transport == "staged-naive" and count > 65537:
                        continue  # (slow and the same code as below that size)
                    rows.append(check_one(transport, comm, nccl, algorithm, dtype, count))
    bad = [r for r in rows if not r["ok"]]
    say(f"correctness p={P}: {len(rows) - len(bad)} of {len(rows)} cases ok")
    for r in bad[:12]:
        say("  FAILED", r)
    return rows


# ---- 2. timing ------------------------------------------------------------------------------------------------
def time_gpu(fn, iters: int) -> list[float]:
    """Each iteration started together (stream drained, barrier), timed with CUDA events: seconds."""
    stream = cupy.cuda.get_current_stream()
    events = []
    for _ in range(iters):
        stream.synchronize()
        COMM.Barrier()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        events.append((start, end))
    stream.synchronize()
    return [cupy.cuda.get_elapsed_time(s, e) / 1e3 for s, e in events]


def time_host(fn, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        COMM.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def measure(fn, timer, budget_s: float, max_iters: int, warmup: int = 3) -> tuple[list[float], int]:
    for _ in range(warmup):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    probe = max(timer(fn, 2))
    iters = int(COMM.allreduce(min(max_iters, max(5, int(budget_s / max(probe, 1e-6)))), op=MPI.MIN))
    return timer(fn, iters), iters


def implementations(nccl, staged, naive, x, out, host_x, torch_x):
    n = x.size
    raw, types = nccl.nccl, import_nccl()
    impls = {
        ("nccl", "nccl"): (lambda: raw.allReduce(x.data.ptr, out.data.ptr, n, types.NCCL_FLOAT32, types.NCCL_SUM,
                                                 cupy.cuda.get_current_stream().ptr), time_gpu),
        ("builtin", "nccl"): (lambda: tplab.allreduce(x, nccl, algorithm="builtin", check=False), time_gpu),
        ("ring", "nccl"): (lambda: tplab.allreduce(x, nccl, algorithm="ring", check=False), time_gpu),
        ("recursive_doubling", "nccl"): (lambda: tplab.allreduce(x, nccl, algorithm="recursive_doubling",
                                                                 check=False), time_gpu),
        ("rabenseifner", "nccl"): (lambda: tplab.allreduce(x, nccl, algorithm="rabenseifner", check=False), time_gpu),
    }
    if torch_x is not None:
        import torch.distributed as dist

        impls[("torch_all_reduce", "torch-nccl")] = (lambda: dist.all_reduce(torch_x), time_gpu)
    if x.nbytes <= 64 << 20:
        impls[("ring", "mpi-staged-pipelined")] = (lambda: tplab.allreduce(x, staged, algorithm="ring", check=False),
                                                   time_gpu)
        impls[("builtin", "mpi-staged-naive")] = (lambda: tplab.allreduce(x, naive, algorithm="builtin", check=False),
                                                  time_gpu)
        impls[("builtin", "mpi-host")] = (lambda: world().builtin_allreduce(host_x, "sum"), time_host)
    return impls


def start_torch_distributed():
    """torch.distributed's NCCL process group on the same ranks (another NCCL baseline); None if it fails."""
    try:
        import torch
        import torch.distributed as dist

        from tplab.comm.torch_dist import start_process_group

        start_process_group(COMM, torch.device("cuda", cupy.cuda.runtime.getDevice()))
        return dist
    except Exception as e:  # noqa: BLE001 - optional baseline
        say(f"torch.distributed baseline skipped: {type(e).__name__}: {e}")
        return None


def timing(nccl, staged, naive, sizes, machine, budget_s, max_iters, deadline, use_torch, only=None) -> list[dict]:
    dist = start_torch_distributed() if use_torch else None
    rows = []
    for size in sizes:
        n = size // 4
        rng = np.random.default_rng([n, RANK])
        host_x = rng.uniform(-1, 1, size=n).astype(np.float32)
        x, out = cupy.asarray(host_x), cupy.empty(n, dtype=np.float32)
        torch_x = None
        if dist is not None:
            import torch

            torch_x = torch.from_dlpack(x.copy())
        reference = nccl.builtin_allreduce(x, "sum").astype(np.float64)
        scale = nccl.builtin_allreduce(cupy.abs(x), "sum").astype(np.float64)  # sum over ranks of |x|
        for (algorithm, transport), (fn, timer) in implementations(nccl, staged, naive, x, out, host_x,
                                                                   torch_x).items():
            if only and f"{algorithm}/{transport}" not in only:
                continue
            if time.monotonic() > deadline:
                say(f"time limit reached: stopping before {algorithm}/{transport} at {size} B")
                return rows
            try:
                result = fn()
                result = out if result is None and algorithm == "nccl" else result
                if algorithm == "torch_all_reduce":
                    wrong = -1  # (in place, called again and again: not compared; -1 = not checked)
                else:
                    cupy.cuda.get_current_stream().synchronize()
                    got = cupy.asarray(result).astype(np.float64)
                    wrong = int(cupy.count_nonzero(cupy.abs(got - reference) > 2 * P * 1.2e-7 * scale + 1e-30))
                times, iters = measure(fn, timer, budget_s, max_iters)
            except Exception as e:  # noqa: BLE001 - one broken point must not end the sweep
                say(f"  {algorithm}/{transport} at {size} B failed: {type(e).__name__}: {e}")
                continue
            everyone = np.array(COMM.allgather(times))  # (ranks, iterations)
            t = float(np.median(everyone, axis=1).max())
            per_iteration = everyone.max(axis=0)
            algbw = size / t / 1e9
            rows.append({"collective": "allreduce", "algorithm": algorithm, "transport": transport, "ranks": P,
                         "size": size, "count": n, "type": "float32", "redop": "sum", "time_us": t * 1e6,
                         "min_us": float(per_iteration.min()) * 1e6, "max_us": float(per_iteration.max()) * 1e6,
                         "algbw": algbw, "busbw": algbw * 2 * (P - 1) / P,
                         "wrong": -1 if wrong < 0 else sum(COMM.allgather(wrong)),
                         "iters": iters, "machine": machine})
        say(f"  {size:>10} B done")
    if dist is not None:
        dist.destroy_process_group()
    return rows


def table(rows) -> None:
    """Time per size, and each one's ratio to NCCL's (the last lines of the output)."""
    import pandas as pd

    df = pd.DataFrame(rows)
    wide = df.pivot_table(index="size", columns=["algorithm", "transport"], values="time_us")
    wide.columns = [f"{a}/{t}" for a, t in wide.columns]
    if "nccl/nccl" not in wide:
        print(wide.to_string())
        return
    nccl = wide["nccl/nccl"]
    for c in wide.columns:
        if c != "nccl/nccl":
            wide[c] = wide[c].map("{:.1f}".format) + " (" + (wide[c] / nccl).map("{:.2f}x".format) + ")"
    wide["nccl/nccl"] = nccl.map("{:.1f}".format)
    with pd.option_context("display.width", 250, "display.max_columns", 20):
        print(wide.to_string())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=BUILD_GPU,
                    help="where the CSVs go (default: build/gpu in the repository)")
    ap.add_argument("--min-bytes", default="1K")
    ap.add_argument("--max-bytes", default="256M")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of timed iterations per point")
    ap.add_argument("--max-iters", type=int, default=200)
    ap.add_argument("--time-limit", type=float, default=200, help="seconds for the whole timing sweep")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--impls", default="", help="comma-separated algorithm/transport pairs to time (default: all)")
    args = ap.parse_args()
    if RANK == 0:
        os.makedirs(args.out, exist_ok=True)
    t0 = time.monotonic()
    nccl = nccl_world()
    staged, naive = StagedComm(world(), mode="auto"), StagedComm(world(), mode="naive")
    machine = machine_description(staged)
    say(f"{machine}; staged mode {staged.mode}; cuda_aware_mpi() = {cuda_aware_mpi()}")
    if not args.skip_check:
        transports = {"nccl": nccl, f"staged-{staged.mode}": staged, "staged-naive": naive}
        rows = correctness(transports, nccl, big=1 << 20)
        if RANK == 0:
            import pandas as pd

            pd.DataFrame(rows).assign(machine=machine).to_csv(os.path.join(args.out, f"correctness_p{P}.csv"),
                                                               index=False)
        say(f"correctness took {time.monotonic() - t0:.0f} s")
    sizes = sizes_between(parse_bytes(args.min_bytes), parse_bytes(args.max_bytes))
    rows = timing(nccl, staged, naive, sizes, machine, args.budget, args.max_iters,
                  time.monotonic() + args.time_limit, not args.no_torch, [i for i in args.impls.split(",") if i])
    if RANK == 0 and rows:
        import pandas as pd

        pd.DataFrame(rows).to_csv(os.path.join(args.out, f"allreduce_p{P}.csv"), index=False)
        table(rows)
    say(f"total {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
