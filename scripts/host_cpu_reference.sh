#!/usr/bin/env bash
# One call on a lent GPU machine's host CPUs: host-MPI reference sweeps (Open MPI of the image and the
# MPICH wheel) and the cost-model fit, all into $OUT. Carries .whl (mpich + mpi4py wheels for cp312).
# RANKS="2 4" / FIT_RANKS="4 8" choose rank counts; SKIP_REFERENCE=1 runs only the fit.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
host="host CPUs of a 1x ${gpu} machine: ${cpu}, $(nproc) cores; $(python3 -V)"
ranks=${RANKS:-2 4 8 16}
[ -n "${SKIP_REFERENCE:-}" ] || (MPIEXEC="mpiexec --allow-run-as-root" bash scripts/reference_host_mpi.sh "$OUT/allreduce_openmpi.csv" \
    "$host; Open MPI $(mpiexec --version | head -1 | awk '{print $NF}')" $ranks > "$OUT/log_openmpi.txt" 2>&1
 echo "openmpi rc=$?"; grep -E "correctness|Error" "$OUT/log_openmpi.txt" | head -8)
# the MPICH wheel in a venv that also sees the image's packages (numpy)
site=$(python3 -c "import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))")
python3 -m venv /tmp/v && /tmp/v/bin/python -m pip install -q --no-index --no-deps --no-compile .whl/*.whl || exit 1
echo "$site" > /tmp/v/lib/python3.12/site-packages/image_site.pth
export PATH=/tmp/v/bin:$PATH
[ -n "${SKIP_REFERENCE:-}" ] || (bash scripts/reference_host_mpi.sh "$OUT/allreduce_mpich.csv" "$host; MPICH 5.0.2 wheel" $ranks \
    > "$OUT/log_mpich.txt" 2>&1; echo "mpich rc=$?"; grep -E "correctness|Error" "$OUT/log_mpich.txt" | head -8)
for p in ${FIT_RANKS:-4 8}; do
  mpiexec -n "$p" python3 scripts/fit_model.py "$OUT/fit_mpich_p$p.csv" "$host; MPICH 5.0.2 wheel"
done
