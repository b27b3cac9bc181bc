"""Where does an allreduce's time go? Compare the pieces inside the algorithms with the micro-benchmarks.

    mpiexec -n 4 python examples/diagnose_model.py OUT.csv

(An example kept for history: the diagnosis that made tplab.cost.fit_on time ring steps back to back and
additions into fresh memory instead of a hot ping-pong; notebook 02, section 3, tells that story.)

For each algorithm and size: the median total time of a call, and inside it the summed time of its
sendrecv calls, of its reductions (op.combine), and the rest (entry, allocation, Python). Next to them
the micro-benchmarks the cost model is fitted on, at the message sizes the algorithm really sends:
exchange (hot buffers, barrier before each step), chained ring exchange (p-1 steps back to back over
distinct blocks of a big vector, no barrier between), np.add hot and on distinct (cold) blocks, and a
fresh np.empty + first write (page faults). One row per (algorithm, size), written by rank 0.
"""

import csv
import sys
import time

import numpy as np

import tplab
from tplab.comm import world
from tplab.toolkit.ops import ReduceOp

comm = world()
p, r = comm.size, comm.rank
out = sys.argv[1]
SIZES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20, 8 << 20]
ITERS = 30
clock = {"sendrecv": 0.0, "combine": 0.0}

original_sendrecv, original_combine = type(comm)._sendrecv, ReduceOp.combine


def timed_sendrecv(self, *args):
    t0 = time.perf_counter()
    original_sendrecv(self, *args)
    clock["sendrecv"] += time.perf_counter() - t0


def timed_combine(self, *args, **kwargs):
    t0 = time.perf_counter()
    result = original_combine(self, *args, **kwargs)
    clock["combine"] += time.perf_counter() - t0
    return result


def slowest_median(values):
    return max(comm.allgather_object(float(np.median(values))))


def measure_call(algorithm, x):
    totals, sends, combines = [], [], []
    type(comm)._sendrecv, ReduceOp.combine = timed_sendrecv, timed_combine
    for i in range(ITERS + 3):
        clock.update(sendrecv=0.0, combine=0.0)
        comm.barrier()
        t0 = time.perf_counter()
        tplab.allreduce(x, comm, algorithm=algorithm, check=False)
        if i >= 3:
            totals.append(time.perf_counter() - t0)
            sends.append(clock["sendrecv"])
            combines.append(clock["combine"])
    type(comm)._sendrecv, ReduceOp.combine = original_sendrecv, original_combine
    return slowest_median(totals), slowest_median(sends), slowest_median(combines)


def exchange_hot(nbytes):
    partner = r ^ 1
    send, recv = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    times = []
    for i in range(ITERS + 3):
        comm.barrier()
        t0 = time.perf_counter()
        if partner < p:
            comm.sendrecv(send, partner, recv, partner)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return slowest_median(times)


def ring_chain(block_bytes):
    """p-1 ring steps back to back over distinct blocks of a vector of p blocks: per-step time."""
    vector, incoming = np.ones(block_bytes * p, np.uint8), np.empty(block_bytes, np.uint8)
    right, left = (r + 1) % p, (r - 1) % p
    times = []
    for i in range(ITERS + 3):
        comm.barrier()
        t0 = time.perf_counter()
        for step in range(p - 1):
            k = (r - step - 1) % p
            comm.sendrecv(vector[k * block_bytes:(k + 1) * block_bytes], right, incoming, left)
        if i >= 3:
            times.append((time.perf_counter() - t0) / max(p - 1, 1))
    return slowest_median(times)


def add_hot(nbytes):
    a, b = np.ones(nbytes // 4, np.float32), np.ones(nbytes // 4, np.float32)
    times = []
    for _ in range(ITERS):
        t0 = time.perf_counter()
        np.add(a, b, out=a)
        times.append(time.perf_counter() - t0)
    return slowest_median(times)


def add_cold(nbytes):
    """np.add on a block of a vector 8x larger than the block, a different block each time."""
    count = nbytes // 4
    big, b = np.ones(count * 8, np.float32), np.ones(count, np.float32)
    times = []
    for i in range(ITERS):
        k = i % 8
        t0 = time.perf_counter()
        np.add(big[k * count:(k + 1) * count], b, out=big[k * count:(k + 1) * count])
        times.append(time.perf_counter() - t0)
    return slowest_median(times)


def fresh_array(nbytes):
    times = []
    for _ in range(ITERS):
        t0 = time.perf_counter()
        a = np.empty(nbytes, np.uint8)
        a[:] = 1
        times.append(time.perf_counter() - t0)
        del a
    return slowest_median(times)


rows = []
for size in SIZES:
    x = np.ones(size // 4, np.float32)
    micro = {"exchange_n": exchange_hot(size), "exchange_n_over_p": exchange_hot(max(size // p, 1)),
             "exchange_n_over_2": exchange_hot(max(size // 2, 1)),
             "ring_chain_n_over_p": ring_chain(max(size // p, 1)),
             "add_hot_n": add_hot(size), "add_hot_n_over_p": add_hot(max(size // p, 4)),
             "add_cold_n_over_p": add_cold(max(size // p, 4)), "fresh_n": fresh_array(size)}
    for algorithm in ["ring", "recursive_doubling", "rabenseifner", "builtin"]:
        total, sends, combines = measure_call(algorithm, x)
        rows.append({"ranks": p, "algorithm": algorithm, "size": size, "total_us": total * 1e6,
                     "sendrecv_us": sends * 1e6, "combine_us": combines * 1e6,
                     **{k + "_us": v * 1e6 for k, v in micro.items()}})
        if r == 0:
            print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
if r == 0:
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
