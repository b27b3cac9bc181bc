"""GPU tests: skipped without CuPy and a GPU; under mpiexec they behave like tests/mpi (abort the job
when a rank fails, watchdog per test, only rank 0 reports). See gputest.py."""

from gputest import gpu_count

if gpu_count():
    import faulthandler
    import sys

    import pytest
    from mpi4py import MPI
    from mpitest import arm_watchdog, watchdog_to_terminal   # (gputest put tests/mpi on the path)

    WATCHDOG_SECONDS = 120  # NCCL setup and CuPy kernel compilation take seconds the first time

    @pytest.hookimpl(trylast=True)
    def pytest_configure(config):
        watchdog_to_terminal(config)
        if MPI.COMM_WORLD.rank != 0:
            reporter = config.pluginmanager.getplugin("terminalreporter")
            if reporter is not None:
                config.pluginmanager.unregister(reporter)

    @pytest.fixture(autouse=True)
    def deadlock_watchdog():
        arm_watchdog(WATCHDOG_SECONDS)
        yield
        faulthandler.cancel_dump_traceback_later()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        outcome = yield
        report = outcome.get_result()
        if report.failed and MPI.COMM_WORLD.size > 1:
            faulthandler.cancel_dump_traceback_later()
            sys.stderr.write(f"\n[rank {MPI.COMM_WORLD.rank}] FAILED {item.nodeid} ({report.when})\n"
                             f"{report.longreprtext}\n[rank {MPI.COMM_WORLD.rank}] aborting the MPI job\n")
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
