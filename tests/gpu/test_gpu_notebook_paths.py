"""What notebooks 01-05 run on the engines in GPU mode (``device="gpu"``), small, under mpiexec on a GPU machine:

    mpiexec -n 4 python -m pytest tests/gpu/test_gpu_notebook_paths.py -q -s      # one rank per GPU

Each function takes its GPU path (CuPy arrays or CUDA tensors on the rank's bound GPU, NCCL point-to-point)
and must give what its CPU path gives: the same step pictures and byte counts, correct tables, timings that
are numbers. scripts/gpu_notebooks.sh runs this first, so that a failure is named before the notebooks run.
"""

from gputest import require_gpu

require_gpu()

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from mpitest import COMM, agree  # noqa: E402

import tplab.lab.bench  # noqa: E402
import tplab.lab.verify  # noqa: E402
from tplab.comm import devices  # noqa: E402
from tplab.collectives.snapshots import trace_allreduce  # noqa: E402
from tplab.comm import communicator, nccl_world  # noqa: E402

P = COMM.size


def test_each_rank_is_bound_to_the_gpu_of_its_node_local_rank():
    info = devices.bind_local_gpu()
    agree(info["device"] == info["local_rank"] and info["name"], str(info))
    import cupy

    agree(cupy.cuda.runtime.getDevice() == info["device"] == torch.cuda.current_device(), "current device")
    agree(communicator("gpu") is nccl_world(), "the GPU communicator is nccl_world()")


def test_pictures_are_the_same_on_gpus():
    for algorithm in ["naive", "ring", "recursive_doubling", "rabenseifner", "tree"]:
        agree(trace_allreduce(algorithm, device="gpu") == trace_allreduce(algorithm, device="cpu"), algorithm)
    if P >= 3:
        agree(trace_allreduce("rabenseifner", ranks=P - 1, device="gpu")
              == trace_allreduce("rabenseifner", ranks=P - 1, device="cpu"), "on p - 1 ranks")


def test_correctness_table_and_traffic_on_gpus():
    rows = tplab.lab.verify.allreduce_table(counts=[0, 1, 2 * P + 1, 1000], device="gpu")
    agree(all(r["ok"] for r in rows), str([r for r in rows if not r["ok"]][:3]))
    agree(tplab.lab.verify.count_traffic(device="gpu") == tplab.lab.verify.count_traffic(device="cpu"), "bytes counted")


def test_sweeps_time_gpu_arrays_against_nccl():
    rows = tplab.lab.bench.sweep("allreduce", ["ring", "rabenseifner", "builtin"], [8, 1 << 20], iters=3, device="gpu")
    agree(len(rows) == 6 and all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows), str(rows))
    osu = tplab.lab.bench.sweep("allreduce", ["ring"], [64], osu=True, device="gpu")
    agree(osu[0]["wrong"] == 0 and osu[0]["iters"] == 1000 and osu[0]["time_us"] > 0, str(osu))


def test_cost_model_fit_on_gpus():
    from tplab.cost import fit_on

    machine, exchange, reduction = fit_on(nccl_world(), sizes=[8, 4096, 1 << 20], iters=3)
    agree(machine.alpha > 0 and machine.beta > 0 and machine.gamma > 0, str(machine))
    agree(len(exchange) == len(reduction) == 3, "rows")


def test_forward_time_against_the_tp_degree_on_gpus():
    from tplab.models import GPTConfig
    from tplab.models.speed import forward_time_vs_tp

    config = GPTConfig(vocab_size=64, block_size=64, n_layer=1, n_head=4, n_kv_head=4, n_embd=64)
    rows = forward_time_vs_tp(config, batch=2, seq=16, iters=2, warmup=1, new_tokens=2, device="cuda")
    agree([r["tp"] for r in rows] == [t for t in (1, 2, 4, 8) if t <= P and P % t == 0 and 4 % t == 0], str(rows))
    agree(all(r["device"] == "cuda" and r["forward_ms"] > 0 and r["tokens_per_s"] > 0 for r in rows), str(rows))


@pytest.mark.parametrize("mode", ["strong", "weak"])
def test_sequence_parallel_scaling_on_gpus(mode):
    from tplab.sequence.scaling import scaling_study

    rows = scaling_study(hidden=64, heads=4, seq_len=48, batch=1, mode=mode, iters=2, warmup=1, device="gpu",
                         scheme=["allgather_kv", "ring"])
    agree(len(rows) > 0 and all(math.isfinite(r["speedup"]) and r["speedup"] > 0 for r in rows), str(rows))
    agree(all(r["bytes_per_rank"] == r["predicted_bytes_per_rank"] for r in rows), "bytes == formula")
