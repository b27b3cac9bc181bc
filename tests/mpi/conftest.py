"""Run under ``mpiexec -n K python -m pytest tests/mpi`` (test_under_mpi.py does it for several K).

- A test that fails on any rank aborts the whole MPI job (MPI_Abort): the other ranks would otherwise
  block forever in their next collective. The failing rank prints its report to stderr first.
- A watchdog per test (faulthandler, exit=True) dumps every thread's stack and exits if a test takes
  longer than TPLAB_TEST_WATCHDOG seconds: a deadlock fails within seconds instead of hanging CI.
  (pytest-timeout cannot do this: it does not fire while a rank is blocked inside MPI.)
- Only rank 0 reports to the terminal.
"""

import faulthandler
import sys

import pytest
from mpitest import COMM, WATCHDOG_SECONDS


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    if COMM.rank != 0:
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is not None:
            config.pluginmanager.unregister(reporter)


@pytest.fixture(autouse=True)
def deadlock_watchdog():
    faulthandler.dump_traceback_later(WATCHDOG_SECONDS, exit=True)
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
        COMM.Abort(1)
