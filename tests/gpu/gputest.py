"""Helpers for the GPU tests: run them on a GPU machine under ``mpiexec -n K python -m pytest tests/gpu``
(one rank per GPU; K = 1..number of GPUs). Without CuPy or a GPU every module skips at import.

The rules of tests/mpi hold here too: verdicts are agreed on by all ranks (``agree``), a rank that fails
alone aborts the job (conftest.py), and a watchdog turns a hang into a failure.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def gpu_count() -> int:
    if importlib.util.find_spec("cupy") is None:
        return 0
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no driver, no device: no GPU tests
        return 0


def require_gpu() -> None:
    """Skip the calling test module unless CuPy and a GPU are there."""
    if gpu_count() == 0:
        pytest.skip("needs CuPy and a CUDA GPU (run under mpiexec on a GPU machine)", allow_module_level=True)


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mpi"))  # mpitest: agree, COMM, ...
