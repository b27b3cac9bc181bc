"""Is a fresh 1 MiB+ array expensive here? A probe for benchmark hygiene: compares copying into a
preallocated array with creating a fresh one, optionally after importing MPI (some MPI libraries hook
mmap/munmap to keep their registration caches right, which can make every large allocation expensive).

    python scripts/copy_probe.py [--mpi]
"""
import sys
import time

import numpy as np

if "--mpi" in sys.argv:
    from mpi4py import MPI

    print(MPI.Get_library_version().splitlines()[0])
for n in [1 << 19, 1 << 20, 1 << 22, 1 << 24]:
    x = np.ones(n // 4, np.float32)
    y = np.empty_like(x)
    pre, fresh = [], []
    for _ in range(30):
        t = time.perf_counter(); np.copyto(y, x); pre.append(time.perf_counter() - t)
        t = time.perf_counter(); z = np.array(x, copy=True); fresh.append(time.perf_counter() - t); del z
    print(f"{n:>9} B  preallocated {np.median(pre) * 1e6:8.1f} us   fresh array {np.median(fresh) * 1e6:8.1f} us")
