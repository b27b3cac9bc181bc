"""What the links between the GPUs carry at most: the ceiling of any all-reduce's bus bandwidth on this node.

    NCCL_NVLS_ENABLE=0 mpiexec -n 4 python3 scripts/gpu_link_ceiling.py OUT_DIR [--mib-per-peer 64]

An all-reduce of n bytes over p GPUs must send at least 2(p-1)/p·n bytes out of every GPU (reduce-scatter,
then all-gather), unless the switch reduces (NVLS, off here as everywhere in tplab's GPU runs). Its bus
bandwidth, 2(p-1)/p·n / time, is therefore at most what one GPU can send while all the others send too. This
script measures that: every rank sends ``--mib-per-peer`` MiB to every peer at once (and, for comparison, to
one peer only), by the copy engines (cudaMemcpyAsync, one stream per peer) and by the SMs (16-byte stores to
the peers' memory, one or four per thread in flight, or 16-byte loads from it), over CUDA IPC. Each transfer
starts from a barrier on the GPUs (no host skew); the time is the median of ``--reps`` and the slowest rank.
Writes OUT_DIR/gpu_link_ceiling_<p>x-<card>.csv: method, peers at once, bytes per peer, blocks, time, GB/s
out of (or into) each GPU.
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupy  # noqa: E402
from mpi4py import MPI  # noqa: E402

from tplab.gpu_collectives.peer_memory import PeerMemory  # noqa: E402

WORLD = MPI.COMM_WORLD
SOURCE = r"""
__device__ __forceinline__ uint4 load_cg(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v; }
// Every peer in `to` (k of them) gets the same packs: one load, k stores to k GPUs.
extern "C" __global__ void push(const uint4* src, const unsigned long long* to, int k, long long packs) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < packs; i += (long long)gridDim.x * blockDim.x) {
        const uint4 v = src[i];
        for (int s = 0; s < k; s++) ((uint4*)to[s])[i] = v;
    }
}
// The same with four packs per thread in flight (more bytes on the way per SM).
extern "C" __global__ void push4(const uint4* src, const unsigned long long* to, int k, long long packs) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < packs; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) if (i + u * stride < packs) v[u] = src[i + u * stride];
        for (int s = 0; s < k; s++)
#pragma unroll
            for (int u = 0; u < 4; u++) if (i + u * stride < packs) ((uint4*)to[s])[i + u * stride] = v[u];
    }
}
// Every peer in `from` gives its packs: k loads in flight, k local stores.
extern "C" __global__ void pull(uint4* dst, const unsigned long long* from, int k, long long packs) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < packs; i += (long long)gridDim.x * blockDim.x) {
        uint4 v[7];
#pragma unroll
        for (int s = 0; s < 7; s++) if (s < k) v[s] = load_cg((const uint4*)from[s] + i);
#pragma unroll
        for (int s = 0; s < 7; s++) if (s < k) dst[s * packs + i] = v[s];
    }
}
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--mib-per-peer", type=int, default=64)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    cupy.cuda.Device(WORLD.rank % cupy.cuda.runtime.getDeviceCount()).use()
    p, rank = WORLD.size, WORLD.rank
    per_peer = args.mib_per_peer << 20
    peers = PeerMemory(WORLD, p * per_peer)
    card = cupy.cuda.runtime.getDeviceProperties(peers.device)["name"].decode()
    sms = cupy.cuda.runtime.getDeviceProperties(peers.device)["multiProcessorCount"]
    module = cupy.RawModule(code=SOURCE)
    push, push4, pull = (module.get_function(name) for name in ("push", "push4", "pull"))
    src = cupy.arange(per_peer // 4, dtype=cupy.float32)
    local = cupy.empty(max(p - 1, 1) * per_peer, dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    sides = [cupy.cuda.Stream(non_blocking=True) for _ in range(max(p - 1, 1))]

    def slot_at(q, of):                      # where rank `of` writes in rank q's buffer (its own slot)
        return peers.data_pointer(q) + of * per_peer

    def targets(all_peers):
        steps = range(1, p) if all_peers else [1]
        return [(rank + s) % p for s in steps]

    def timed(run):
        """ms of run() after a barrier on the GPUs: median of reps, slowest rank."""
        times = []
        with stream:
            for rep in range(args.reps + 2):
                peers.queue_barrier()
                start = stream.record()
                run()
                end = stream.record()
                end.synchronize()
                if rep >= 2:
                    times.append(cupy.cuda.get_elapsed_time(start, end))
        return max(WORLD.allgather(float(np.median(times))))

    def copy_engines(qs, direction):
        def run():
            ready = stream.record()
            for side, q in zip(sides, qs):
                side.wait_event(ready)
                if direction == "push":
                    dst, source = slot_at(q, rank), src.data.ptr
                else:                                # pull: q's copy of my slot... its own slot in its buffer
                    dst, source = local.data.ptr + qs.index(q) * per_peer, slot_at(q, q)
                cupy.cuda.runtime.memcpyAsync(dst, source, per_peer, 3, side.ptr)
                stream.wait_event(side.record())
        return run

    def sm_kernel(qs, direction, blocks):
        packs = per_peer // 16
        if direction in ("push", "push4"):
            addresses = cupy.asarray(np.array([slot_at(q, rank) for q in qs], dtype=np.uint64))
            kernel = push if direction == "push" else push4
            return lambda: kernel((blocks,), (512,), (src, addresses, np.int32(len(qs)), np.int64(packs)))
        addresses = cupy.asarray(np.array([slot_at(q, q) for q in qs], dtype=np.uint64))
        return lambda: pull((blocks,), (512,), (local, addresses, np.int32(len(qs)), np.int64(packs)))

    rows = []

    def add(method, direction, qs, blocks, ms):
        gbps = len(qs) * per_peer / (ms * 1e-3) / 1e9
        rows.append(dict(method=method, direction=direction, ranks=p, peers_at_once=len(qs), bytes_per_peer=per_peer,
                         blocks=blocks, time_ms=round(ms, 4), GBps_per_gpu=round(gbps, 1), card=card))
        if rank == 0:
            print(f"{method:>12} {direction:>4} to {len(qs)} peer(s) blocks {blocks:>4}: {ms:8.3f} ms "
                  f"{gbps:7.1f} GB/s per GPU", flush=True)

    for all_peers in (True, False):
        qs = targets(all_peers)
        for direction in ("push", "pull"):
            add("copy_engine", direction, qs, 0, timed(copy_engines(qs, direction)))
            for blocks in (sms, 2 * sms, 4 * sms):
                add("sm", direction, qs, blocks, timed(sm_kernel(qs, direction, blocks)))
        for blocks in (sms, 2 * sms):
            add("sm_4_per_thread", "push", qs, blocks, timed(sm_kernel(qs, "push4", blocks)))
    if rank == 0:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        name = "h200" if "H200" in card else "h100" if "H100" in card else card.replace(" ", "-").lower()
        path = args.out_dir / f"gpu_link_ceiling_{p}x-{name}.csv"
        pd.DataFrame(rows).to_csv(path, index=False)
        best = max(r["GBps_per_gpu"] for r in rows if r["peers_at_once"] == p - 1)
        print(f"ceiling of an all-reduce's bus bandwidth here: {best:.0f} GB/s (the best of the all-peers rows) "
              f"-> {path}", flush=True)
    peers.close()


if __name__ == "__main__":
    main()
