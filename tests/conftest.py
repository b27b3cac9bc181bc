"""Top-level test configuration.

tests/mpi/ holds tests that run *inside* ``mpiexec -n K python -m pytest tests/mpi``; test_under_mpi.py
launches them for several K. A plain ``pytest`` run must not collect them itself.
"""

import os

collect_ignore = [] if os.environ.get("TPLAB_UNDER_MPIEXEC") else ["mpi"]


def pytest_terminal_summary(terminalreporter):
    """Each MPI suite is one test here but hundreds of tests inside mpiexec: show what they counted."""
    lines = [value for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", [])
             for name, value in getattr(report, "user_properties", []) if name == "mpi_summary"]
    if lines:
        terminalreporter.section("tests run inside mpiexec")
        for line in lines:
            terminalreporter.write_line(line)
