"""GPU binding and device choice (tplab.comm.devices, tplab.cluster.gpus) on a machine without GPUs, and the
logic that picks "gpu" for engines that have them (with canned answers from the engines).

The GPU branch itself runs on a GPU machine: tests/gpu/test_gpu_notebook_paths.py and scripts/gpu_notebooks.sh.
"""

import os
import stat

import numpy as np
import pandas as pd
import pytest

from tplab.comm import devices
from tplab.cluster import ClusterError, gpus
from tplab.cluster.processes import mpiexec_args

no_gpu = pytest.mark.skipif(devices.gpu_count() > 0, reason="this machine has a GPU")


def test_device_names():
    assert [devices.is_gpu(d) for d in ("cpu", None, "gpu", "cuda", "cuda:1", "GPU")] == \
        [False, False, True, True, True, True]
    assert devices.torch_device("gpu") == "cuda" and devices.torch_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="'cpu' or 'gpu'"):
        devices.is_gpu("tpu")


@no_gpu
def test_without_gpus_binding_says_none_and_changes_nothing():
    assert devices.gpu_count() == 0
    info = devices.bind_local_gpu()
    assert info["device"] is None and info["name"] is None
    assert info["rank"] == 0 and info["local_rank"] == 0 and info["local_size"] >= 1
    assert devices.bind_local_gpu() == info and devices.bound_gpu() is None and devices.use_bound_gpu() is None
    from tplab.comm import communicator, world

    assert communicator("cpu") is world()
    with pytest.raises(RuntimeError, match="sees no GPU"):
        communicator("gpu")
    from tplab.comm.nccl import bind_local_gpu  # nccl_world's binding: the same place, a clear error

    with pytest.raises(RuntimeError, match="0 visible GPU"):
        bind_local_gpu()


def test_arrays_stay_or_come_home():
    x = np.arange(4.0)
    assert devices.to_device(x, "cpu") is x and devices.to_host(x) is x
    torch = pytest.importorskip("torch")
    assert np.array_equal(devices.to_host(torch.arange(3.0, requires_grad=True) * 2), [0.0, 2.0, 4.0])


def test_card_names_for_file_names():
    assert gpus.card_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert gpus.card_slug("NVIDIA H200") == "h200"
    assert gpus.card_slug("NVIDIA GeForce RTX 4090") == "rtx-4090"
    assert gpus.card_slug("NVIDIA A100-SXM4-80GB") == "a100-sxm4-80gb"
    table = pd.DataFrame({"name": ["NVIDIA H100 80GB HBM3"] * 4, "host": ["n0"] * 4})
    assert gpus.file_tag(table) == "gpu_4x-h100"
    assert gpus.file_tag(pd.DataFrame({"name": [None, None]})) == "cpu"


class FakeCluster:
    """What the engines would answer: one probe (gpu_probe) per rank."""

    def __init__(self, probes):
        self.probes = probes

    def run(self, func):
        return {"gpu_probe": self.probes, "gpu_count": [p["gpus"] for p in self.probes]}[func.__name__]


def probes(gpus_per_node, ranks, cupy=True, ranks_per_node=None):
    return [{"gpus": gpus_per_node, "cupy": cupy, "local_size": ranks_per_node or ranks}] * ranks


def test_auto_means_gpu_only_when_every_engine_can_have_its_own():
    four_gpus = FakeCluster(probes(4, 4))
    assert gpus.has_gpus(four_gpus) and gpus.resolve_device(four_gpus, "auto") == "gpu"
    assert gpus.resolve_device(four_gpus, "cpu") == "cpu" and gpus.resolve_device(four_gpus, "gpu") == "gpu"
    two_nodes = FakeCluster(probes(4, 8, ranks_per_node=4))
    assert gpus.resolve_device(two_nodes) == "gpu"
    cases = {"no GPU": (FakeCluster(probes(0, 4)), "rank 0 sees no GPU"),
             "more engines than GPUs": (FakeCluster(probes(2, 4)), "4 engines share a node with 2 GPU"),
             "no CuPy": (FakeCluster(probes(4, 4, cupy=False)), "no CuPy")}
    for name, (cluster, why) in cases.items():
        assert gpus.resolve_device(cluster, "auto") == "cpu", name
        with pytest.raises(ClusterError, match=why):
            gpus.resolve_device(cluster, "gpu")
    one_without = FakeCluster(probes(4, 4)[:3] + [{"gpus": 0, "cupy": True, "local_size": 4}])
    assert not gpus.has_gpus(one_without) and gpus.resolve_device(one_without) == "cpu"
    with pytest.raises(ValueError, match="device must be one of"):
        gpus.resolve_device(four_gpus, "tpu")


def fake_mpiexec(folder, version_text):
    path = folder / "mpiexec"
    path.write_text(f"#!/bin/sh\ncat <<'EOF'\n{version_text}\nEOF\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_open_mpi_gets_the_flags_it_needs(tmp_path):
    (tmp_path / "ompi4").mkdir(), (tmp_path / "ompi5").mkdir(), (tmp_path / "mpich").mkdir()
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    ompi4 = fake_mpiexec(tmp_path / "ompi4", "mpiexec (OpenRTE) 4.1.6\n\nReport bugs to http://www.open-mpi.org/community/help/")
    ompi5 = fake_mpiexec(tmp_path / "ompi5", "mpiexec (Open MPI) 5.0.8")
    mpich = fake_mpiexec(tmp_path / "mpich", "HYDRA build details:\n    Version: 5.0.2")
    assert mpiexec_args(ompi4) == ["--oversubscribe"] + root
    assert mpiexec_args(ompi5) == ["--oversubscribe"] + root
    assert mpiexec_args(mpich) == [] and mpiexec_args(str(tmp_path / "missing")) == []
