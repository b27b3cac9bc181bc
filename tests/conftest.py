"""Top-level test configuration.

tests/mpi/ holds tests that run *inside* ``mpiexec -n K python -m pytest tests/mpi``; test_under_mpi.py
launches them for several K. A plain ``pytest`` run must not collect them itself.
"""

import os

import pytest

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


# `make test` runs two pytest workers (pytest-xdist, --dist loadgroup): the whole suite waits on subprocesses,
# sleeps and timeouts much of the time and used about one of two cores alone. The long tests go to two groups
# that run side by side -- the ones that start ipyparallel clusters (the notebooks among them) and the MPI jobs
# -- and each group runs in order on one worker; the short tests fill in around them.
XDIST_GROUPS = {
    "clusters": ("test_notebooks", "test_cluster", "test_cluster_chaos", "test_doctor"),
    "mpi_jobs": ("test_under_mpi", "test_nodes"),
}


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):
        return
    group_of = {module: group for group, modules in XDIST_GROUPS.items() for module in modules}
    for item in items:
        group = group_of.get(item.module.__name__.rpartition(".")[2]) if item.module else None
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
