"""Top-level test configuration.

tests/mpi/ holds tests that run *inside* ``mpiexec -n K python -m pytest tests/mpi``; test_under_mpi.py
launches them for several K. A plain ``pytest`` run must not collect them itself.
"""

import os

collect_ignore = [] if os.environ.get("TPLAB_UNDER_MPIEXEC") else ["mpi"]
