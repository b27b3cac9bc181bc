#!/usr/bin/env bash
# Start MPI ranks with this environment on every rank, whichever mpiexec is installed (used by the GPU scripts):
#
#   bash scripts/mpi_run.sh [NAME=VALUE ...] -n P command ...      # NAME=VALUE: set on every rank too
#
# MPICH's hydra forwards the whole environment by itself; Open MPI forwards only the variables named with
# -x, needs --allow-run-as-root when run as root (containers) and --oversubscribe where it counts fewer slots
# than ranks, and binds each rank to one core by default (--bind-to none here: a rank's NCCL and CUDA host
# threads share that one core; on 4x H100 a bound p = 2 run of tests/gpu timed out in test_gpu_overlap.py and
# an unbound one passed -- the cause was not proven). Another launcher: set MPIEXEC (e.g. MPIEXEC="srun --mpi=pmix"), used as it is.
set -u
given=""   # the names set by NAME=VALUE arguments: forwarded too
while [[ "${1:-}" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do export "$1"; given="$given ${1%%=*}"; shift; done
FORWARDED="$given NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS PYTHONPATH PYTHONUNBUFFERED
OMP_NUM_THREADS TPLAB_UNDER_MPIEXEC TPLAB_DATA_DIR CUDA_DEVICE_MAX_CONNECTIONS NCCL_MAX_CTAS NCCL_MIN_CTAS
NCCL_MAX_NCHANNELS TORCH_NCCL_HIGH_PRIORITY"
if [ -n "${MPIEXEC:-}" ]; then
  exec $MPIEXEC "$@"
fi
launcher=(mpiexec)
if mpiexec --version 2>&1 | grep -qi "open mpi\|openrte"; then
  launcher+=(--oversubscribe --bind-to none)
  [ "$(id -u)" = 0 ] && launcher+=(--allow-run-as-root)
  for name in $FORWARDED; do
    [ -n "${!name+set}" ] && launcher+=(-x "$name")
  done
fi
exec "${launcher[@]}" "$@"
