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


# `make test` runs two pytest workers (pytest-xdist, `--dist loadfile --no-loadscope-reorder`): alone the suite
# waits on subprocesses, sleeps and timeouts much of the time and used about one of two cores. Each test file
# runs whole on one worker (test_nodes' network namespaces and the notebooks' cluster are one per machine), and
# the files are handed out in collection order: the two longest first, one to each worker, the others as the
# workers come free. (Not xdist's `loadgroup` marks: with pytest 9 they are silently ignored, xdist 3.8.)
LONGEST_FIRST = ("test_under_mpi", "test_notebooks")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.module.__name__.rpartition(".")[2] if getattr(item, "module", None) else ""
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
    items.sort(key=rank)  # (a stable sort: the order inside each file and among the rest is kept)
