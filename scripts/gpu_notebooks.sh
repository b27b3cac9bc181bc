#!/usr/bin/env bash
# Notebooks 01-05 executed for real on a GPU node, in GPU mode: each engine binds one GPU, the collectives run
# over NCCL on CuPy arrays, the sweeps and models take GPU sizes. Results (executed notebooks, the CSVs named
# after the card, figures, logs) land in OUT_DIR, and OUT_DIR.tar.gz packs them (one file to copy off the node).
#
#   bash scripts/gpu_notebooks.sh [OUT_DIR]          # default build/gpu/notebooks; 4 GPUs by default
#   bash scripts/fetch_notebook_wheels.sh            # first, on a machine with internet, if the node has none
#
# What it does:
#   1. a venv that sees the node's Python packages (--system-site-packages: torch, CuPy, mpi4py, numpy stay
#      the node's), the missing ones (ipyparallel, papermill, ...) installed from WHEELS with pip --no-index
#      when that folder exists, else from the package index; this checkout on its path;
#   2. (PREFLIGHT=1) tests/gpu/test_gpu_notebook_paths.py under mpiexec: the notebooks' engine functions on
#      the GPUs, small, so that a broken GPU path is named before the notebooks run;
#   3. one ipyparallel cluster of RANKS MPI engines (Open MPI's mpiexec gets --oversubscribe and, as root,
#      --allow-run-as-root from tplab.cluster), then each notebook with papermill, device="gpu".
#
# Environment: NOTEBOOKS="01 02 03 04 05" (two-digit prefixes), RANKS=4, DEVICE=gpu ("cpu" for a dry run on
# CPU ranks), BUDGET (seconds from the start; unset: no limit; set: no notebook starts after BUDGET-60 and the
# run is ended at BUDGET), CELL_TIMEOUT=300, PREFLIGHT=1, PYTHON=python3 (the node's Python with torch and
# CuPy), WHEELS=build/notebook-wheels, VENV=build/gpu-notebooks-venv.
set -u
REPOSITORY=$(cd "$(dirname "$0")/.." && pwd)
R=$(realpath -m "${1:-$REPOSITORY/build/gpu/notebooks}")
cd "$REPOSITORY"
# NVLink multicast (NVLS) off: some nodes' fabric does not support it, and NCCL then fails at start-up
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export IPYTHONDIR=${IPYTHONDIR:-$REPOSITORY/build/ipython}   # (the cluster's files, away from ~/.ipython)
START=$(date +%s)
mkdir -p "$R"
PYTHON=${PYTHON:-python3}
VENV=$(realpath -m "${VENV:-build/gpu-notebooks-venv}")
WHEELS=$(realpath -m "${WHEELS:-build/notebook-wheels}")
BUDGET=${BUDGET:-}
left() { if [ -n "$BUDGET" ]; then echo $(( BUDGET - ($(date +%s) - START) )); else echo 0; fi; }  # 0: no limit
# the reference figures are drawn from data/ (and are inside the executed notebooks anyway)
pack() { tar -czf "$R.tar.gz" -C "$(dirname "$R")" --exclude='figures/*reference_*' "$(basename "$R")"; }
say() { echo "[$(( $(date +%s) - START )) s] $*"; }

# ---- 1. the venv -------------------------------------------------------------------------------------------
NEEDED="ipyparallel papermill nbclient nbformat ipykernel jupyter_client"
if ! "$VENV/bin/python" -c "import ipyparallel, papermill, nbclient, nbformat, ipykernel, jupyter_client" 2>/dev/null; then
  say "venv $VENV from $($PYTHON -V 2>&1) with the node's packages, plus $(ls "$WHEELS"/*.whl 2>/dev/null | wc -l) wheels from $WHEELS"
  # --without-pip: no ensurepip needed; the node's pip (seen through the system site) installs into the venv
  "$PYTHON" -m venv --system-site-packages --without-pip "$VENV" || exit 1
  if ! "$VENV/bin/python" -c "import numpy, mpi4py, pip" 2>/dev/null; then  # $PYTHON is itself a venv's: name its site
    "$PYTHON" -c "
import importlib.util, os
for name in ['pip', 'numpy', 'mpi4py', 'torch', 'cupy', 'pandas', 'matplotlib']:
    spec = importlib.util.find_spec(name)
    if spec and spec.origin:
        print(os.path.dirname(os.path.dirname(spec.origin)))" | sort -u \
      > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/node_site.pth"
  fi
  if [ -d "$WHEELS" ]; then  # a node without internet: the wheels fetched beforehand
    "$VENV/bin/python" -m pip install --no-index --find-links "$WHEELS" $NEEDED > "$R/log_pip.txt" 2>&1 \
      || { say "pip could not resolve from $WHEELS (see log_pip.txt): installing every wheel there as it is"
           "$VENV/bin/python" -m pip install --no-index --no-deps "$WHEELS"/*.whl >> "$R/log_pip.txt" 2>&1; }
  else
    "$VENV/bin/python" -m pip install $NEEDED > "$R/log_pip.txt" 2>&1 || say "pip failed: see log_pip.txt"
  fi
fi
# this checkout on the venv's path (engines and kernels run the venv's Python): torch, CuPy, numpy untouched
echo "$PWD" > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tplab-checkout.pth"
PY="$VENV/bin/python"
"$PY" - > "$R/versions.txt" 2>&1 <<'EOF'
import importlib, sys
print(sys.version.split()[0], sys.executable)
for name in ["tplab", "numpy", "pandas", "matplotlib", "torch", "cupy", "mpi4py", "ipyparallel", "papermill",
             "nbclient", "ipykernel", "jupyter_client", "zmq", "tornado", "psutil", "transformers"]:
    try:
        module = importlib.import_module(name)
        print(f"{name:15} {getattr(module, '__version__', '?'):12} {module.__file__}")
    except Exception as e:  # noqa: BLE001
        print(f"{name:15} MISSING: {type(e).__name__}: {e}")
import mpi4py
mpi4py.rc.initialize = False  # (the library's name needs no MPI_Init: no singleton start here)
from mpi4py import MPI
print(MPI.Get_library_version().splitlines()[0])
EOF
cat "$R/versions.txt"
grep -q "MISSING" "$R/versions.txt" && grep "MISSING" "$R/versions.txt" | grep -qv "transformers\|cupy\|torch" \
  && { say "a package the notebooks need is missing: see versions.txt"; pack; exit 1; }
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader; nvidia-smi topo -m; } \
  > "$R/gpus.txt" 2>&1
lscpu | sed -n 's/^Model name: *//p; s/^CPU(s): *//p' >> "$R/gpus.txt" 2>/dev/null
head -4 "$R/gpus.txt"

# ---- 2. preflight: the notebooks' engine functions on the GPUs, small -----------------------------------
RANKS=${RANKS:-4}
if [ "${PREFLIGHT:-1}" = 1 ] && [ "${DEVICE:-gpu}" = gpu ]; then
  say "preflight: tests/gpu/test_gpu_notebook_paths.py on $RANKS ranks"
  timeout --kill-after=10 150 bash scripts/mpi_run.sh -n "$RANKS" "$PY" -m pytest tests/gpu/test_gpu_notebook_paths.py \
    -q -s -p no:cacheprovider > "$R/log_preflight.txt" 2>&1
  say "preflight: exit $? ($(grep -E "passed|failed|skipped|error" "$R/log_preflight.txt" | tail -1))"
fi

# ---- 3. the notebooks on one cluster of MPI engines ---------------------------------------------------------
export R RANKS DEVICE=${DEVICE:-gpu} NOTEBOOKS=${NOTEBOOKS:-01 02 03 04 05} CELL_TIMEOUT=${CELL_TIMEOUT:-300}
export LAST_START=$( [ -n "$BUDGET" ] && echo $(( START + BUDGET - 60 )) || echo 1e12 )
[ -z "$BUDGET" ] || [ "$(left)" -gt 60 ] || { say "no time left for the notebooks"; exit 1; }
say "notebooks ${NOTEBOOKS} on $RANKS engines, device=$DEVICE"
timeout --kill-after=15 "$(left)" "$PY" - <<'EOF'
import os, time
from pathlib import Path

from tplab.cluster import Cluster, engine_rank, stop_cluster
from tplab.lab.demo import execute_notebooks

out, ranks, device = Path(os.environ["R"]), int(os.environ["RANKS"]), os.environ["DEVICE"]
wanted = os.environ["NOTEBOOKS"].split()
notebooks = [nb for nb in sorted(Path("notebooks").glob("*.ipynb")) if nb.name[:2] in wanted]
cluster_id = "tplab-gpu-notebooks"
stop_cluster(cluster_id)  # one left by an earlier, interrupted run on this machine
cluster = Cluster.start(ranks, cluster_id=cluster_id, timeout=180)
try:
    print(cluster.run_df(engine_rank).to_string(), flush=True)
    parameters = {"n_ranks": ranks, "cluster_id": cluster_id, "output_dir": str(out), "device": device}
    for nb in notebooks:
        if time.time() > float(os.environ["LAST_START"]):
            print(f"{nb.name}: not started, too little time left", flush=True)
            continue
        [result] = execute_notebooks([nb], out, parameters=parameters, timeout=int(os.environ["CELL_TIMEOUT"]),
                                     html=False)
        with open(out / "summary.txt", "a") as f:
            f.write(f"{result['name']}: {'OK' if result['ok'] else 'FAILED ' + str(result['error'])} "
                    f"in {result['seconds']:.0f} s\n")
finally:
    cluster.stop()
EOF
say "notebooks: exit $?"
pack
cat "$R/summary.txt" 2>/dev/null
ls "$R"/*.csv 2>/dev/null | sed 's|.*/||'
ls -la "$R.tar.gz"
