"""Where a measurement ran, in words for the ``machine`` column of the CSVs in data/: the CPU's model and the
libraries a GPU measurement depends on. Every description of a machine comes from here."""

from __future__ import annotations

import platform
import re
import sys


def cpu_model(short: bool = False) -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` knows. ``short``: without
    "(R)", "(TM)", "CPU" and "Processor" (for file names: "Intel Xeon Platinum 8480+")."""
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        name = platform.processor() or platform.machine()
    if not short:
        return name
    return " ".join(w for w in re.sub(r"\((R|TM)\)", "", name).split() if w not in ("CPU", "Processor"))


def mpi_library(short: bool = False) -> str:
    """The MPI library's first line of version text ("Open MPI v4.1.6, package: ..."); ``short``: only its
    name and version ("Open MPI v4.1.6")."""
    from mpi4py import MPI

    first = MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip()  # (Open MPI ends it with NUL)
    return " ".join(first.replace("Version:", "").split(",")[0].split()) if short else first


def software() -> str:
    """The libraries a GPU measurement depends on, in words (for a CSV's machine column)."""
    parts = []
    if "cupy" in sys.modules:
        import cupy

        try:  # (loaded by then wherever an NcclComm exists: tplab.comm.nccl.import_nccl)
            from cupy.cuda import nccl

            v = nccl.get_version()
            parts.append(f"NCCL {v // 10000}.{v % 10000 // 100}.{v % 100}")
        except Exception:  # noqa: BLE001 - only a label
            pass
        parts.append(f"CuPy {cupy.__version__}")
    if "torch" in sys.modules:
        parts.append(f"torch {sys.modules['torch'].__version__}")
    parts.append(mpi_library()[:40])
    return ", ".join(parts)
