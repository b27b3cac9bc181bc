"""Run under ``mpiexec -n K python -m pytest tests/mpi`` (test_under_mpi.py does it for several K).

- A test that fails on any rank aborts the whole MPI job (MPI_Abort): the other ranks would otherwise
  block forever in their next collective. The failing rank prints its report to stderr first.
- A watchdog per test (faulthandler, exit=True) dumps every thread's stack and exits if a test takes
  longer than TPLAB_TEST_WATCHDOG seconds: a deadlock fails within seconds instead of hanging CI.
  (pytest-timeout cannot do this: it does not fire while a rank is blocked inside MPI.)
- Only rank 0 reports to the terminal.
- A job that aborts leaves MPICH's shared-memory files in /dev/shm (MPI_Finalize would remove them): each
  rank writes the ones it maps to $TPLAB_SHM_RECORD.<rank>, and test_under_mpi.py removes them afterwards.
"""

import faulthandler
import os
import sys

import pytest
from mpitest import COMM, arm_watchdog, watchdog_to_terminal


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    watchdog_to_terminal(config)
    if COMM.rank != 0:
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


_recorded: set = set()


def record_shm_files():
    """Append the /dev/shm files this rank maps (MPICH's, made at MPI_Init or by shared windows) to its record."""
    record = os.environ.get("TPLAB_SHM_RECORD")
    if not record:
        return
    # (as tplab.cluster.shm.mapped_files does; importing tplab.cluster here would load ipyparallel on every rank)
    with open("/proc/self/maps") as f:
        fields = [line.split(maxsplit=5) for line in f]
    new = {x[5].strip() for x in fields if len(x) == 6 and x[5].startswith("/dev/shm/")
           and not x[5].strip().endswith("(deleted)")} - _recorded
    if new:
        _recorded.update(new)
        with open(f"{record}.{COMM.rank}", "a") as f:
            f.writelines(path + "\n" for path in sorted(new))


@pytest.fixture(autouse=True)
def deadlock_watchdog():
    record_shm_files()
    arm_watchdog()
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        faulthandler.cancel_dump_traceback_later()
        sys.stderr.write(
            f"\n[rank {COMM.rank} of {COMM.size}] FAILED {item.nodeid} ({report.when})\n"
            f"{report.longreprtext}\n[rank {COMM.rank}] aborting the MPI job\n"
        )
        sys.stderr.flush()
        record_shm_files()
        COMM.Abort(1)
