#!/usr/bin/env bash
# Host-MPI reference results for notebooks 01-03 on a many-core machine (a GPU node's host CPUs, say): every
# hand-written all-reduce against MPI_Allreduce with the machine's own MPI and with the MPICH wheel from PyPI
# (scripts/reference_host_mpi.sh), then the cost-model fit (scripts/fit_model.py), all into OUT_DIR.
#
#   bash scripts/host_cpu_reference.sh [OUT_DIR]       # default build/cpu-reference
#
# RANKS="2 4 8 16" (the sweeps; one core per rank is what makes them worth reading), FIT_RANKS="4 8",
# SKIP_REFERENCE=1 (only the fit), MPICH_WHEELS=DIR (mpich and mpi4py wheels for a machine without internet;
# otherwise pip downloads them), VENV=build/mpich-venv (where the MPICH wheel is installed).
set -u
REPOSITORY=$(cd "$(dirname "$0")/.." && pwd)
OUT_DIR=$(realpath -m "${1:-$REPOSITORY/build/cpu-reference}")
cd "$REPOSITORY"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=$REPOSITORY
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
host="${gpu:+host CPUs of a 1x ${gpu} machine: }${cpu}, $(nproc) cores; $(python3 -V)"
ranks=${RANKS:-2 4 8 16}
library() { python3 -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0].strip())"; }

# 1. the machine's own MPI
[ -n "${SKIP_REFERENCE:-}" ] || (MPIEXEC="bash scripts/mpi_run.sh" bash scripts/reference_host_mpi.sh \
    "$OUT_DIR/allreduce_system-mpi.csv" "$host; $(library)" $ranks > "$OUT_DIR/log_system_mpi.txt" 2>&1
 echo "system MPI rc=$?"; grep -E "correctness|Error" "$OUT_DIR/log_system_mpi.txt" | head -8)

# 2. the MPICH wheel, in a venv that also sees this Python's packages (numpy, torch, ...)
VENV=$(realpath -m "${VENV:-build/mpich-venv}")
site=$(python3 -c "import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))")
python3 -m venv "$VENV" || exit 1
if [ -n "${MPICH_WHEELS:-}" ]; then
  "$VENV/bin/python" -m pip install -q --no-index --find-links "$MPICH_WHEELS" mpich mpi4py || exit 1
else
  "$VENV/bin/python" -m pip install -q mpich mpi4py || exit 1
fi
echo "$site" > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/system_site.pth"
export PATH=$VENV/bin:$PATH
mpich="$host; $(library)"
[ -n "${SKIP_REFERENCE:-}" ] || (bash scripts/reference_host_mpi.sh "$OUT_DIR/allreduce_mpich.csv" "$mpich" $ranks \
    > "$OUT_DIR/log_mpich.txt" 2>&1; echo "mpich rc=$?"; grep -E "correctness|Error" "$OUT_DIR/log_mpich.txt" | head -8)

# 3. the cost model fitted on this machine (MPICH wheel)
for p in ${FIT_RANKS:-4 8}; do
  mpiexec -n "$p" python3 scripts/fit_model.py "$OUT_DIR/fit_mpich_p$p.csv" "$mpich"
done
