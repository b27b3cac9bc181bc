"""Top-level test configuration.

tests/mpi/ holds tests that run *inside* ``mpiexec -n K python -m pytest tests/mpi``; test_under_mpi.py
launches them for several K. A plain ``pytest`` run must not collect them itself.
"""

import os

collect_ignore = [] if os.environ.get("TPLAB_UNDER_MPIEXEC") else ["mpi"]

# Offline test machines may keep Tiny Shakespeare beside the repository: point tplab's data loader (and the
# notebook kernels, which inherit this environment) at it, so notebook 08 trains on the real text there.
_LOCAL_DATA = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data")
if "TPLAB_DATA_DIR" not in os.environ and os.path.exists(os.path.join(_LOCAL_DATA, "tinyshakespeare.txt")):
    os.environ["TPLAB_DATA_DIR"] = os.path.abspath(_LOCAL_DATA)


def pytest_terminal_summary(terminalreporter):
    """Each MPI suite is one test here but hundreds of tests inside mpiexec: show what they counted."""
    lines = [value for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", [])
             for name, value in getattr(report, "user_properties", []) if name == "mpi_summary"]
    if lines:
        terminalreporter.section("tests run inside mpiexec")
        for line in lines:
            terminalreporter.write_line(line)
