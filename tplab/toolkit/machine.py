"""Where a measurement ran, in words for the ``machine`` column of the CSVs in data/: the CPU's model and the
libraries a GPU measurement depends on. Every description of a machine comes from here."""

from __future__ import annotations

import platform
import sys


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def software() -> str:
    """The libraries a GPU measurement depends on, in words (for a CSV's machine column)."""
    from mpi4py import MPI

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
    parts.append(MPI.Get_library_version().splitlines()[0].strip()[:40])
    return ", ".join(parts)
