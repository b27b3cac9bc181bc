"""Device binding and the ``device=`` knob of the notebooks' engine functions, on CPU ranks.

On a machine without GPUs every rank binds to nothing (device None), and ``device="cpu"`` is the path the
notebooks always took: the same pictures, tables and timings as without the argument. The same functions
with ``device="gpu"`` are checked on a GPU machine by tests/gpu/test_gpu_notebook_paths.py.
"""

import numpy as np
import pytest
from mpitest import COMM, agree

import tplab.lab.bench
import tplab.lab.verify
from tplab.comm import devices
from tplab.collectives.snapshots import trace_allreduce
from tplab.comm import communicator, world

P = COMM.size
pytestmark = pytest.mark.skipif(devices.gpu_count() > 0, reason="the CPU-rank checks; GPUs: tests/gpu")


def test_binding_without_gpus_gives_the_node_local_rank_and_no_device():
    info = devices.bind_local_gpu()
    agree(info["device"] is None and info["rank"] == COMM.rank, str(info))
    # one machine: the node-local ranks are the ranks themselves, all on one node
    agree(info["local_rank"] == COMM.rank and info["local_size"] == P, str(info))
    agree(devices.bind_local_gpu() == info and communicator("cpu") is world())


def test_device_cpu_is_the_path_the_notebooks_always_took():
    agree(trace_allreduce("ring", device="cpu") == trace_allreduce("ring"))
    if P >= 3:
        agree(trace_allreduce("recursive_doubling", ranks=P - 1, device="cpu")
              == trace_allreduce("recursive_doubling", ranks=P - 1))
    rows = tplab.lab.verify.allreduce_table(counts=[0, 1, 2 * P + 1], dtypes=("int64", "float64"), ops=("sum",),
                                        device="cpu")
    agree(len(rows) == 3 * 2 * 5 and all(r["ok"] for r in rows), str([r for r in rows if not r["ok"]]))
    traffic = tplab.lab.verify.count_traffic(device="cpu")
    agree(traffic == tplab.lab.verify.count_traffic(), "counted bytes differ between the two calls")
    point = tplab.lab.bench.time_collective("allreduce", "ring", 256, iters=2, device="cpu")
    agree(point["wrong"] == 0 and point["time_us"] > 0 and point["ranks"] == P, str(point))
    rows = tplab.lab.bench.sweep("allreduce", ["ring", "builtin"], [8, 64], iters=2, device="cpu")
    agree([(r["algorithm"], r["size"]) for r in rows] == [("ring", 8), ("builtin", 8), ("ring", 64), ("builtin", 64)])


def test_arrays_for_the_host_stay_where_they_are():
    x = np.arange(3.0)
    agree(devices.to_device(x, "cpu") is x and devices.to_host(x) is x)
