"""tplab's hand-written all-to-all (pairwise, Bruck) and all-to-all-v over NCCL point-to-point, against NCCL's
own all-to-all (torch.distributed.all_to_all_single), in one run on the same GPUs.

    NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD bash scripts/mpi_run.sh -n 4 python3 scripts/gpu_alltoall.py OUT_DIR
    PYTHONPATH=$PWD mpiexec -n 4 python3 scripts/gpu_alltoall.py OUT_DIR --device cpu      # a dry run (gloo)

A mixture-of-experts layer does two all-to-alls (dispatch, combine): while decoding a few tokens per rank
(latency), while prefilling megabytes (bandwidth). One MPI rank per GPU.

1. Correctness, bf16 and float32, tokens of ``--hidden`` values: tplab.collectives.alltoall (pairwise and
   bruck) and alltoallv (random counts per pair, zeros included, the same matrix on every rank) over
   tplab.comm.nccl_world(), each compared bitwise with all_to_all_single (with split sizes for the v form).
   Any mismatch stops the run before timing.
2. Timing, bf16: decode sizes (1, 2, 4, ... 64 tokens for every destination, hidden 4096) and prefill sizes
   (1 MiB .. ``--max-bytes`` per rank, x4 steps). Each point: ``--warmup`` untimed calls, then ``--iters``
   calls each started together (stream synchronised, MPI barrier), timed with CUDA events; time_us = the
   slowest rank's median. nccl-tests columns: size (bytes one rank sends, its whole input), count (elements),
   type, time_us, algbw = size / time, busbw = algbw · (p-1)/p, path:
       nccl_all_to_all_single   NCCL's all-to-all (one group of p-1 sends and receives)
       tplab_pairwise           p-1 steps, one sendrecv each (NCCL send/recv)
       tplab_bruck              ⌈lg p⌉ steps, packed blocks
       tplab_alltoallv          pairwise with counts (equal here), empty blocks skipped
       tplab_peer_memory        one kernel: each rank writes each destination's block into that peer's
                                buffer over NVLink (tplab.gpu_collectives.peer_alltoall; GPUs only)
   -> OUT_DIR/gpu_alltoall_<p>x-<card>.csv, the machine (GPU, NCCL, torch) in every row.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from tplab.collectives import alltoall, alltoallv
from tplab.comm import world
from tplab.comm.torch_dist import start_process_group
from tplab.toolkit.timing import slowest_median, time_calls

COMM = MPI.COMM_WORLD
P, RANK = COMM.size, COMM.rank
COLUMNS = ["size", "count", "type", "time_us", "algbw", "busbw", "path", "tokens", "ranks", "card", "machine",
           "iters", "warmup", "date"]


def say(*args):
    if RANK == 0:
        print(*args, flush=True)


def setup(device_kind: str):
    """(tplab communicator, torch device): NCCL point-to-point on this rank's GPU, or MPI on the CPU."""
    if device_kind == "cuda":
        from tplab.comm import nccl_world

        comm = nccl_world()  # binds GPU <node-local rank>
        device = torch.device("cuda", torch.cuda.current_device() if comm.device is None else comm.device)
        torch.cuda.set_device(device)
        start_process_group(COMM, device)
    else:
        comm, device = world(), torch.device("cpu")
        start_process_group(COMM, device)
    return comm, device


def vendor(x, send=None, recv=None):
    """NCCL's all-to-all (gloo's on the CPU) through torch.distributed: rows by destination."""
    out = torch.empty((sum(recv) if recv else x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send)
    return out


def counts_matrix(seed: int, largest: int) -> np.ndarray:
    rng = np.random.default_rng(seed)  # the same on every rank
    m = rng.integers(0, largest + 1, size=(P, P))
    m[rng.random((P, P)) < 0.25] = 0
    return m


def correctness(comm, device, hidden: int, peers=None) -> list[str]:
    failures = []
    for dtype in (torch.bfloat16, torch.float32):
        gen = torch.Generator().manual_seed(RANK)
        for tokens in (0, 1, 3, 64):
            x = torch.randn(P, tokens, hidden, generator=gen).to(dtype).to(device)
            want = vendor(x.reshape(P * tokens, hidden)).reshape(x.shape)
            for algorithm in ("pairwise", "bruck"):
                got = alltoall(x, comm, algorithm=algorithm)
                if not torch.equal(got, want):
                    failures.append(f"alltoall {algorithm} {dtype} {tokens} tokens")
            if peers is not None and not torch.equal(through_peer_memory(peers, x), want):
                failures.append(f"alltoall through peer memory {dtype} {tokens} tokens")
        for seed, largest in ((1, 0), (2, 1), (3, 5), (4, 300)):
            m = counts_matrix(seed, largest)
            send, recv = [int(c) for c in m[RANK]], [int(c) for c in m[:, RANK]]
            x = torch.randn(sum(send), hidden, generator=gen).to(dtype).to(device)
            if not torch.equal(alltoallv(x, send, comm, recv), vendor(x, send, recv)):
                failures.append(f"alltoallv {dtype} counts seed {seed}")
    everyone = COMM.allgather(failures)
    return [f"rank {r}: {f}" for r, fs in enumerate(everyone) for f in fs]


def paths(comm, peers=None):
    chosen = {
        "nccl_all_to_all_single": lambda x, c: vendor(x.reshape(-1, x.shape[-1])),
        "tplab_pairwise": lambda x, c: alltoall(x, comm, algorithm="pairwise", check=False),
        "tplab_bruck": lambda x, c: alltoall(x, comm, algorithm="bruck", check=False),
        "tplab_alltoallv": lambda x, c: alltoallv(x.reshape(-1, x.shape[-1]), c, comm, c, check=False),
    }
    if peers is not None:
        chosen["tplab_peer_memory"] = lambda x, c: through_peer_memory(peers, x, check=False)
    return chosen


def through_peer_memory(peers, x, check=True):
    """tplab.gpu_collectives.peer_alltoall on a torch tensor (CuPy views both ways, no copies)."""
    import cupy

    from tplab.gpu_collectives.peer_alltoall import peer_alltoall

    return torch.from_dlpack(peer_alltoall(peers, cupy.from_dlpack(x.contiguous()), check=check))


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1].upper()]) if text[-1].upper() in units else int(text)


def machine(device) -> tuple[str, str]:
    if device.type != "cuda":
        return "cpu", f"{P} CPU ranks (dry run), torch {torch.__version__}"
    name = torch.cuda.get_device_name(device)
    card = name.replace("NVIDIA", "").split()[0].lower()
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return card, f"{P}x {name}, NCCL {nccl}, torch {torch.__version__}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", nargs="?", default=os.path.join("build", "gpu"))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run on CPU ranks")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--max-bytes", type=parse_bytes, default=64 << 20,
                        help="largest prefill size per rank (bytes, or e.g. 64M); prefill starts at 1M")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()

    comm, device = setup(args.device)
    card, described = machine(device)
    say(f"p = {P}: {described}")
    peers = None
    if device.type == "cuda":  # shared buffers for the peer-memory path: p blocks of the largest input's share
        from tplab.gpu_collectives.peer_memory import PeerMemory

        peers = PeerMemory(COMM, args.max_bytes + (1 << 20))
    failures = correctness(comm, device, min(args.hidden, 256), peers)
    if failures:
        say("correctness FAILED, nothing timed:\n  " + "\n  ".join(failures[:20]))
        raise SystemExit(1)
    say("correctness: tplab's all-to-all (pairwise, bruck, peer memory) and all-to-all-v equal all_to_all_single bitwise")

    decode = [(t, "decode") for t in (1, 2, 4, 8, 16, 32, 64)]
    per_token = args.hidden * 2  # bf16
    prefill, size = [], 1 << 20
    while size <= args.max_bytes:
        prefill.append((max(1, size // (P * per_token)), "prefill"))
        size *= 4
    host = world()
    cuda = device.type == "cuda"
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    rows = []
    for tokens, phase in decode + prefill:
        x = torch.randn(P, tokens, args.hidden, generator=torch.Generator().manual_seed(RANK)).to(torch.bfloat16)
        x = x.to(device)
        counts = [tokens] * P
        for path, fn in paths(comm, peers).items():
            times = time_calls(lambda: fn(x, counts), iters=args.iters, warmup=args.warmup, barrier=COMM.Barrier,
                               cuda=cuda)
            seconds = slowest_median(times, host)
            algbw = x.nbytes / seconds / 1e9
            rows.append({"size": x.nbytes, "count": x.numel(), "type": "bfloat16", "time_us": seconds * 1e6,
                         "algbw": algbw, "busbw": algbw * (P - 1) / P, "path": path, "tokens": tokens,
                         "ranks": P, "card": card, "machine": described, "iters": args.iters,
                         "warmup": args.warmup, "date": stamp, "phase": phase})
            say(f"{phase:8s} {x.nbytes:>11d} B  {path:24s} {seconds * 1e6:10.1f} us  "
                f"busbw {algbw * (P - 1) / P:7.2f} GB/s")
    if RANK == 0:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        target = out / f"gpu_alltoall_{P}x-{card}.csv"
        with open(target, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS + ["phase"])
            writer.writeheader()
            writer.writerows(rows)
        print(f"{len(rows)} rows -> {target}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
