"""The peer-memory all-reduces (examples/cuda_ipc.py: one-shot, two-shot) against NCCL, on one GPU node.

    NCCL_NVLS_ENABLE=0 mpiexec -n 4 python examples/gpu_ipc_allreduce.py [OUT_DIR]     # default build/gpu

1. Correctness: int32 (exact), float16/float32/float64 (within the rounding of a p-term sum) against
   NCCL's all-reduce, counts 0, 1, 7, p+1, 1023, 65537, 2^20+3; the result bitwise identical on every rank.
2. Timing, float32 sum, 1 KiB .. 256 MiB per rank: ncclAllReduce, tplab's ring over NCCL send/recv, and
   the two peer-memory all-reduces; CUDA events around each call after a drained stream and a barrier,
   the slowest rank's median; nccl-tests columns, written to OUT_DIR/gpu_ipc_allreduce_<p>x-<card>.csv.
"""

from __future__ import annotations

import csv
import hashlib
import os
import sys

import cupy
import numpy as np

import tplab
from cuda_ipc import PeerBuffers, peer_allreduce  # (this folder: Python puts a script's folder on its path)
from tplab.comm import nccl_world

REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPOSITORY, "build", "gpu")
comm = nccl_world()
mpi, P, R = comm.mpi, comm.size, comm.rank
MAX = 256 << 20
peers = PeerBuffers(mpi, MAX)
card = cupy.cuda.runtime.getDeviceProperties(comm.device)["name"].decode()
version = cupy.cuda.nccl.get_version()  # major*10000 + minor*100 + patch
machine = (f"{P}x {card} (one node), NCCL {version // 10000}.{version // 100 % 100}.{version % 100}, "
           f"CuPy {cupy.__version__}")


def say(*args):
    if R == 0:
        print(*args, flush=True)


# ---- 1. correctness ----------------------------------------------------------------------------------------
bad = total = 0
for dtype in ["int32", "float16", "float32", "float64"]:
    for count in [0, 1, 7, P + 1, 1023, 65537, (1 << 20) + 3]:
        rng = np.random.default_rng(1000 * R + count)
        host = rng.integers(-1000, 1000, count) if dtype == "int32" else rng.standard_normal(count)
        x = cupy.asarray(host.astype(dtype))
        reference = comm.builtin_allreduce(x.astype("float64") if dtype != "int32" else x)
        for algorithm in ["one_shot", "two_shot"]:
            y = peer_allreduce(x, peers, algorithm)
            if dtype == "int32":
                ok = bool((y == reference).all())
            else:
                tolerance = {"float16": 2e-2, "float32": 1e-5, "float64": 1e-12}[dtype]
                ok = bool(cupy.allclose(y.astype("float64"), reference, rtol=tolerance, atol=tolerance * P))
            digest = hashlib.md5(cupy.asnumpy(y).tobytes()).hexdigest()
            same = len(set(mpi.allgather(digest))) == 1
            everywhere = all(mpi.allgather(ok and same))
            total += 1
            if not everywhere:
                bad += 1
                say(f"  FAILED {algorithm} {dtype} count={count} ok={ok} same_on_every_rank={same}")
say(f"correctness p={P}: {total - bad} of {total} cases ok")


# ---- 2. timing ---------------------------------------------------------------------------------------------
def time_gpu(fn, iters):
    stream = cupy.cuda.get_current_stream()
    times = []
    for _ in range(iters):
        stream.synchronize()
        mpi.Barrier()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return times


implementations = {
    "nccl": lambda x: comm.builtin_allreduce(x),
    "ring/nccl": lambda x: tplab.allreduce(x, comm, algorithm="ring", check=False),
    "one_shot/ipc": lambda x: peer_allreduce(x, peers, "one_shot"),
    "two_shot/ipc": lambda x: peer_allreduce(x, peers, "two_shot"),
}
rows = []
size = 1 << 10
while size <= MAX:
    x = cupy.ones(size // 4, dtype="float32")
    iters = 50 if size <= (16 << 20) else 15
    for name, fn in implementations.items():
        if name == "one_shot/ipc" and size > (64 << 20):
            continue  # reads (p-1)·n: pointless this large
        for _ in range(3):
            fn(x)
        t = max(mpi.allgather(float(np.median(time_gpu(lambda: fn(x), iters)))))
        algbw = size / t / 1e9
        rows.append({"collective": "allreduce", "algorithm": name.split("/")[0], "transport": name.split("/")[1]
                     if "/" in name else "nccl", "ranks": P, "size": size, "count": size // 4, "type": "float32",
                     "redop": "sum", "time_us": t * 1e6, "algbw": algbw, "busbw": algbw * 2 * (P - 1) / P,
                     "wrong": -1, "iters": iters, "machine": machine})  # -1: timed, not checked (part 1 checks)
    say(f"{size:>10} B  " + "  ".join(f"{r['algorithm']}/{r['transport']} {r['time_us']:8.1f} us"
                                     for r in rows if r["size"] == size))
    size *= 4
peers.close()
if R == 0:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"gpu_ipc_allreduce_{P}x-{card.split()[-1].lower()}.csv")
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print("wrote", path)
