"""GPUs for a cluster's engines: which engines see one, each engine bound to its own, the machine named.

One engine per GPU, as one MPI rank per GPU everywhere in tplab: engine (rank) r takes the GPU of its
node-local rank (``tplab.comm.devices.bind_local_gpu``; across nodes too). These are the functions behind the
Cluster methods a notebook calls:

    cluster.has_gpus()                 True when every engine sees a GPU
    device = cluster.resolve_device("auto")    "gpu" when every engine can have a GPU of its own, else "cpu"
    gpus = cluster.bind_gpus()         DataFrame, one row per rank: local_rank, device, name, memory_gib, host
    machine, tag = describe(cluster, gpus)     "4x NVIDIA H100 80GB HBM3 (1 node), NCCL ..., ...", "gpu_4x-h100"

On a machine without GPUs ``has_gpus`` is False, ``resolve_device("auto")`` is "cpu" and ``bind_gpus`` says
device None for every rank: nothing fails, and the CPU path is untouched.
"""

from __future__ import annotations

import re

from tplab.comm import devices
from tplab.toolkit.machine import software as libraries
from tplab.cluster.failures import ClusterError

DEVICES = ("auto", "cpu", "gpu")


def has_gpus(cluster) -> bool:
    """True if every engine sees at least one GPU."""
    return all(n > 0 for n in cluster.run(devices.gpu_count))


def resolve_device(cluster, device="auto") -> str:
    """"cpu" or "gpu" for a notebook's ``device`` knob. "auto" is "gpu" when every engine sees a GPU, no
    node has more engines than GPUs (one GPU per engine, as NCCL needs) and CuPy is there (the GPU
    transports use it); otherwise "cpu". Asking for "gpu" where that does not hold is a ClusterError
    that says why."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, not {device!r}")
    if device == "cpu":
        return "cpu"
    probes = cluster.run(devices.gpu_probe)
    problems = sorted({problem for rank, probe in enumerate(probes) for problem in _problems(rank, probe)})
    if not problems:
        return "gpu"
    if device == "auto":
        return "cpu"
    raise ClusterError("device='gpu', but " + "; ".join(problems))


def _problems(rank, probe) -> list[str]:
    if probe["gpus"] == 0:
        return [f"rank {rank} sees no GPU"]
    found = []
    if probe["local_size"] > probe["gpus"]:
        found.append(f"{probe['local_size']} engines share a node with {probe['gpus']} GPU(s): start one engine "
                     "per GPU")
    if not probe["cupy"]:
        found.append(f"rank {rank} has no CuPy (pip install cupy-cuda12x or cupy-cuda13x)")
    return found


def bind_gpus(cluster):
    """Bind every engine to the GPU of its node-local rank (CuPy's and torch's current device); one row
    per rank: rank, local_rank, device (None without GPUs), name, memory_gib, host. Binding twice is
    harmless (an engine keeps its first GPU)."""
    import pandas as pd

    rows = cluster.run(devices.bind_local_gpu)
    columns = ["rank", "local_rank", "device", "name", "memory_gib", "host"]
    return pd.DataFrame([{k: row[k] for k in columns} for row in rows], columns=columns)


def describe(cluster, gpus) -> tuple[str, str]:
    """(machine, tag) for a GPU run's CSVs: the ``machine`` column in words (cards, nodes, NCCL, CuPy, torch,
    MPI) and a short tag for file names, e.g. "gpu_4x-h100"."""
    names = sorted(set(gpus["name"].dropna()))
    if not names:
        raise ClusterError("no engine is bound to a GPU: call cluster.bind_gpus() on a machine with GPUs")
    nodes = gpus["host"].nunique()
    cards = " + ".join(f"{int((gpus['name'] == name).sum())}x {name}" for name in names)
    software = cluster.run(libraries)[0]
    machine = f"{cards} ({nodes} node{'s' if nodes > 1 else ''}), one engine per GPU; {software}"
    return machine, file_tag(gpus)


def file_tag(gpus) -> str:
    """"gpu_4x-h100" from the bound GPUs' names: the count and the model, for file names."""
    names = list(gpus["name"].dropna())
    if not names:
        return "cpu"
    return f"gpu_{len(names)}x-{card_slug(max(set(names), key=names.count))}"


def card_slug(name: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA GeForce RTX 4090" -> "rtx-4090": the vendor's words dropped,
    then the words up to the first with a digit in it."""
    words = [w for w in re.split(r"[\s_]+", name.strip()) if w and w.lower() not in ("nvidia", "geforce", "tesla")]
    kept = []
    for word in words:
        kept.append(word)
        if re.search(r"\d", word):
            break
    return re.sub(r"[^a-z0-9]+", "-", "-".join(kept).lower()).strip("-") or "gpu"
