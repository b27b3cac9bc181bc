"""Run the tests in tests/mpi/ on real MPI ranks: ``mpiexec -n K python -m pytest tests/mpi`` per K.

Rank counts 1..8 cover powers of two and the folded non-powers (3, 5, 6, 7); ranks oversubscribe the
cores, which is slow but exercises every code path (the collectives at every count, the layers and
experiments at 1-4: modules()). Each launch has a hard time limit on top of the per-test watchdog in
tests/mpi/conftest.py, so nothing here can hang CI.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# many hypothesis examples where it is cheap, fewer when 6-8 ranks share two cores
EXAMPLES = {1: 60, 2: 60, 3: 60, 4: 60, 5: 40, 6: 15, 7: 15, 8: 15}
# The collectives and the wire run at every count. The layers, models and experiments -- exact at any p, and
# slow where 5-8 ranks share two cores -- run at 1-4 (3: a non-power of two).
EVERY_COUNT = ("test_collectives", "test_comm", "test_contract", "test_emulated", "test_errors",
               "test_hierarchical", "test_traffic", "test_alltoall", "test_moe")
WHOLE_SUITE = {1, 2, 3, 4}


def modules(ranks: int) -> list[str]:
    if ranks in WHOLE_SUITE:
        return ["tests/mpi"]
    return [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests" / "mpi").glob("test_*.py"))
            if p.stem.startswith(EVERY_COUNT)]


def mpiexec() -> str:
    candidate = Path(sys.executable).parent / "mpiexec"
    found = str(candidate) if candidate.exists() else shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec (install the mpich wheel or a system MPI)")
    return found


def remove_recorded_shm_files(record):
    """The ranks wrote down the /dev/shm files they mapped (tests/mpi/conftest.py); a job that aborted (a
    failing test) leaves them behind: remove those that nothing maps any more."""
    from tplab.cluster.shm import remove_unused

    paths = set()
    for path in record.parent.glob(record.name + ".*"):
        paths.update(line.strip() for line in path.read_text().splitlines() if line.strip())
    return remove_unused(paths)


@pytest.mark.parametrize("ranks", sorted(EXAMPLES))
def test_mpi_suite(ranks, record_property, tmp_path):
    env = dict(os.environ, TPLAB_UNDER_MPIEXEC="1", OMP_NUM_THREADS="1", TPLAB_SHM_RECORD=str(tmp_path / "shm"),
               TPLAB_HYPOTHESIS_EXAMPLES=str(EXAMPLES[ranks]), PYTHONFAULTHANDLER="1")
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, "-m", "pytest", *modules(ranks), "-q", "-s",
           "-p", "no:cacheprovider", "-p", "no:nbmake", "-x"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired as e:
        remove_recorded_shm_files(tmp_path / "shm")
        pytest.fail(f"mpiexec -n {ranks} did not finish within 600 s\n{e.stdout or ''}\n{e.stderr or ''}")
    remove_recorded_shm_files(tmp_path / "shm")
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1].strip("= ")
    record_property("mpi_summary", f"mpiexec -n {ranks}: {summary}")  # shown at the end (conftest.py)
    assert proc.returncode == 0, f"mpiexec -n {ranks} failed (exit {proc.returncode})\n{proc.stdout}\n{proc.stderr}"
