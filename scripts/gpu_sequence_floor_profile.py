"""Where the sequence-parallel layer's floor goes, kernel by kernel, on one GPU: the course project's layer
unsplit (all tokens) against one rank's share of it split p ways with nothing moved (a NullExchange: the
all-gather K/V, streamed K/V and ring schemes' compute alone), under torch.profiler.

    python scripts/gpu_sequence_floor_profile.py [--p 4 --batch 4 --seq 4096 --hidden 5120 --heads 40]
    python scripts/gpu_sequence_floor_profile.py --device cpu     # a dry run, tiny, no kernel times

Per layer: its median ms (CUDA events, 20 calls after 5; on the CPU the host's clock), the host's time to
queue a call, and the GPU time of each kernel a call (3 profiled calls), times p for the split layer: what the
p ranks spend in all, next to the one GPU's. The split layer runs on a stand-in communicator (rank 0 of p);
no other process is needed.
"""

import argparse
import statistics
import time
from functools import partial

import torch
from torch.profiler import ProfilerActivity, profile

from tplab.comm.shard_exchange import NullExchange
from tplab.sequence import SequenceParallelBlock, exchange_allgather_first_dim, shard
from tplab.sequence.layer import unsplit_layer
from tplab.sequence.scaling import make_block, make_input
from tplab.toolkit.timing import time_calls


class RankZero:
    """The communicator the split layer sees: rank 0 of p (nothing is sent: the exchange moves nothing)."""
    def __init__(self, size):
        self.rank, self.size, self.bytes_sent = 0, size, 0


def median_ms(fn, cuda, iters=20, warmup=5):
    return statistics.median(time_calls(fn, iters=iters, warmup=warmup, cuda=cuda)) * 1e3   # (CPU: perf_counter)


def median_host_ms(fn, cuda, iters=20):
    """The host's time to queue one call (from an idle GPU to the call's return, before its kernels end):
    near the GPU's time, the GPU waits for the launches."""
    times = []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if not cuda:   # (the dry run: tiny, float32)
        args.batch, args.seq, args.hidden, args.heads = 1, 64, 64, 8
    dtype = torch.bfloat16 if cuda else torch.float32
    block = make_block(args.hidden, args.heads, dtype=dtype, device=args.device)
    x = make_input(args.batch, args.seq, args.hidden, dtype=dtype, device=args.device)    # (b, s, h)
    mine = shard(x, 0, args.p, "contiguous", dim=1)                                     # (b, s/p, h)
    comm, nothing = RankZero(args.p), NullExchange(0, args.p)
    layers = {"unsplit, one GPU": (unsplit_layer(block, causal=False), x, 1),
              f"allgather_kv, rank 0 of {args.p}, nothing moved": (SequenceParallelBlock(
                  block, comm, scheme="allgather_kv", causal=False, check=False,
                  gather=partial(exchange_allgather_first_dim, exchange=nothing)), mine, args.p),
              f"streamed_kv, rank 0 of {args.p}, nothing moved": (SequenceParallelBlock(
                  block, comm, scheme="streamed_kv", causal=False, check=False, exchange=nothing), mine, args.p),
              f"ring, rank 0 of {args.p}, nothing moved": (SequenceParallelBlock(
                  block, comm, scheme="ring", causal=False, check=False, exchange=nothing), mine, args.p)}
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.no_grad():
        for name, (layer, inp, ranks) in layers.items():
            ms = median_ms(lambda: layer(inp), cuda)
            host_ms = median_host_ms(lambda: layer(inp), cuda)
            with profile(activities=activities) as prof:
                for _ in range(3):
                    layer(inp)
                if cuda:
                    torch.cuda.synchronize()
            kernels = [(ev.self_device_time_total / 3e3, ev.count // 3, ev.key) for ev in prof.key_averages()
                       if getattr(ev, "self_device_time_total", 0) > 0 and not ev.key.startswith("aten::")]
            total = sum(t for t, _, _ in kernels)
            print(f"\n{name}: {ms:.3f} ms a call (x{ranks}: {ms * ranks:.3f}); kernels {total:.3f} ms a call; "
                  f"the host's launches {host_ms:.3f} ms a call")
            for t, count, key in sorted(kernels, reverse=True)[:10]:
                print(f"  {t:7.3f} ms  x{count:<3d} (x{ranks}: {t * ranks:7.3f})  {key[:90]}")


if __name__ == "__main__":
    main()
