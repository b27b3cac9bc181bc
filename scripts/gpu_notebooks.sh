#!/usr/bin/env bash
# Notebooks 01-05 executed for real on a GPU node, in GPU mode, in one call on a lent machine (no internet).
#
#   here, once:    bash scripts/fetch_notebook_wheels.sh          # -> .carry/wheels (ipyparallel, papermill, ...)
#   the call:      bash scripts/gpu_notebooks.sh                  # carry: .carry/wheels; 4 GPUs; timeout 600 s
#
# What it does:
#   1. a venv that sees the image's packages (--system-site-packages: torch, CuPy, mpi4py, numpy stay the
#      image's), the missing ones installed from .carry/wheels with pip --no-index, this checkout on its path;
#   2. (PREFLIGHT=1) tests/gpu/test_gpu_notebook_paths.py under mpiexec: the notebooks' engine functions on
#      the GPUs, small, so that a broken GPU path is named before the notebooks run;
#   3. one ipyparallel cluster of RANKS MPI engines (Open MPI's mpiexec gets --oversubscribe and, as root,
#      --allow-run-as-root from tplab.cluster), then each notebook with papermill, device="gpu": each engine
#      binds the GPU of its node-local rank, the collectives run over NCCL on CuPy arrays, GPU-sized sweeps;
#   4. after each notebook, everything in $WORK/notebooks (executed notebooks, the CSVs named after the card,
#      figures, logs) is packed into $OUT/gpu_notebooks.tar.gz, the one file the call returns: a call cut
#      short still returns what finished. A second call on the same (warm) machine adds to the same folder.
#
# Environment: NOTEBOOKS="01 02 03 04 05" (two-digit prefixes), RANKS=4, DEVICE=gpu ("cpu" for a dry run on
# CPU ranks), BUDGET=560 (seconds from the start: no notebook starts after BUDGET-60, and the run is ended at
# BUDGET), CELL_TIMEOUT=300, PREFLIGHT=1, PYTHON=python3 (the image's), VENV=/tmp/tplab-notebooks-venv,
# WORK=/tmp/tplab-gpu-notebooks, OUT (the device call sets it; else build/gpu_notebooks).
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export IPYTHONDIR=${IPYTHONDIR:-/tmp/tplab-ipython}   # (the cluster's files, away from ~/.ipython)
START=$(date +%s)
OUT=${OUT:-$PWD/build/gpu_notebooks}   # only the tarball goes here (the device returns few files)
WORK=${WORK:-/tmp/tplab-gpu-notebooks}
R=$WORK/notebooks
mkdir -p "$R" "$OUT"
PYTHON=${PYTHON:-python3}
VENV=${VENV:-/tmp/tplab-notebooks-venv}
BUDGET=${BUDGET:-560}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# the tarball: without the reference figures (drawn from data/, and inside the notebooks anyway); without any
# figure if it would pass 15 MB (the device returns files up to 16 MiB; the notebooks hold every figure)
export PACK="cd '$WORK' && tar -czf '$OUT/gpu_notebooks.tar.gz' --exclude='notebooks/figures/*reference_*' notebooks \
  && { [ \$(stat -c%s '$OUT/gpu_notebooks.tar.gz') -lt 15000000 ] \
       || tar -czf '$OUT/gpu_notebooks.tar.gz' --exclude=notebooks/figures notebooks; }"
pack() { bash -c "$PACK"; }
say() { echo "[$(( $(date +%s) - START )) s] $*"; }

# ---- 1. the venv -------------------------------------------------------------------------------------------
NEEDED="ipyparallel papermill nbclient nbformat ipykernel jupyter_client"
if ! "$VENV/bin/python" -c "import ipyparallel, papermill, nbclient, nbformat, ipykernel, jupyter_client" 2>/dev/null; then
  say "venv $VENV from $($PYTHON -V 2>&1) with the image's packages, plus $(ls .carry/wheels/*.whl 2>/dev/null | wc -l) carried wheels"
  # --without-pip: no ensurepip needed; the image's pip (seen through the system site) installs into the venv
  "$PYTHON" -m venv --system-site-packages --without-pip "$VENV" || exit 1
  if ! "$VENV/bin/python" -c "import numpy, mpi4py, pip" 2>/dev/null; then  # $PYTHON is itself a venv's: name its site
    "$PYTHON" -c "
import importlib.util, os
for name in ['pip', 'numpy', 'mpi4py', 'torch', 'cupy', 'pandas', 'matplotlib']:
    spec = importlib.util.find_spec(name)
    if spec and spec.origin:
        print(os.path.dirname(os.path.dirname(spec.origin)))" | sort -u \
      > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/image_site.pth"
  fi
  "$VENV/bin/python" -m pip install --no-index --find-links .carry/wheels $NEEDED > "$R/log_pip.txt" 2>&1 \
    || { say "pip could not resolve from .carry/wheels (see log_pip.txt): installing every carried wheel as it is"
         "$VENV/bin/python" -m pip install --no-index --no-deps .carry/wheels/*.whl >> "$R/log_pip.txt" 2>&1; }
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
  MPI="mpiexec -n $RANKS"
  mpiexec --version 2>&1 | grep -qi "open mpi\|openrte" && MPI="mpiexec --allow-run-as-root --oversubscribe -n $RANKS \
    -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x PYTHONUNBUFFERED"
  timeout --kill-after=10 150 $MPI "$PY" -m pytest tests/gpu/test_gpu_notebook_paths.py -q -s -p no:cacheprovider \
    > "$R/log_preflight.txt" 2>&1
  say "preflight: exit $? ($(grep -E "passed|failed|skipped|error" "$R/log_preflight.txt" | tail -1))"
fi
pack

# ---- 3. the notebooks on one cluster of MPI engines ---------------------------------------------------------
export R RANKS DEVICE=${DEVICE:-gpu} NOTEBOOKS=${NOTEBOOKS:-01 02 03 04 05} CELL_TIMEOUT=${CELL_TIMEOUT:-300}
export LAST_START=$(( START + BUDGET - 60 ))
[ "$(left)" -gt 60 ] || { say "no time left for the notebooks"; exit 1; }
say "notebooks ${NOTEBOOKS} on $RANKS engines, device=$DEVICE ($(left) s left)"
timeout --kill-after=15 "$(left)" "$PY" - <<'EOF'
import os, subprocess, time
from pathlib import Path

from tplab.cluster import Cluster, engine_rank, stop_cluster
from tplab.lab.demo import execute_notebooks

out, ranks, device = Path(os.environ["R"]), int(os.environ["RANKS"]), os.environ["DEVICE"]
wanted = os.environ["NOTEBOOKS"].split()
notebooks = [nb for nb in sorted(Path("notebooks").glob("*.ipynb")) if nb.name[:2] in wanted]
cluster_id = "tplab-gpu-notebooks"
stop_cluster(cluster_id)  # one left by an earlier, interrupted call on this machine
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
        subprocess.run(["bash", "-c", os.environ["PACK"]])  # what finished so far, in the returned tarball
finally:
    cluster.stop()
EOF
say "notebooks: exit $?"
pack
cat "$R/summary.txt" 2>/dev/null
ls "$R"/*.csv 2>/dev/null | sed 's|.*/||'
ls -la "$OUT/gpu_notebooks.tar.gz"
