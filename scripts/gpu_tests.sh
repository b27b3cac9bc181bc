#!/usr/bin/env bash
# The GPU test suite (tests/gpu) in one command, on one GPU node: one MPI rank per GPU, at p = 4, 3 and 2
# ranks (counts larger than the node's GPU count are skipped), NVLink multicast off. Prints one summary line
# per rank count, writes the whole output to OUT_DIR/gpu_tests_p<P>.log, exits non-zero if anything failed.
#
#   bash scripts/gpu_tests.sh [OUT_DIR]                     # default build/gpu/tests
#   RANK_COUNTS="8 4 2" bash scripts/gpu_tests.sh           # other counts; TIME_LIMIT=1200 seconds per count
#
# Needs CuPy (pip install tplab[gpu]), mpi4py and an mpiexec (scripts/mpi_run.sh adapts to Open MPI or MPICH).
# A rank that fails a test aborts its whole MPI job (tests/gpu/conftest.py), so a failed count may show
# fewer tests than the suite holds: the log names the test.
set -u
REPOSITORY=$(cd "$(dirname "$0")/.." && pwd)
OUT_DIR=$(realpath -m "${1:-$REPOSITORY/build/gpu/tests}")
cd "$REPOSITORY"
mkdir -p "$OUT_DIR"
# NVLink multicast (NVLS) off for NCCL, torch's symmetric memory and NVSHMEM: some nodes' fabric lacks it,
# and the libraries then fail at start-up instead of falling back
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$REPOSITORY${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TPLAB_UNDER_MPIEXEC=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
PYTHON=${PYTHON:-python3}

gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU" || true)
if [ "${gpus:-0}" -eq 0 ]; then
  gpus=$("$PYTHON" -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())" 2>/dev/null || echo 0)
fi
if [ "$gpus" -eq 0 ]; then
  echo "no GPU found (nvidia-smi, CuPy): the GPU tests need one; nothing run" >&2
  exit 2
fi
counts=""
for p in ${RANK_COUNTS:-4 3 2}; do
  if [ "$p" -le "$gpus" ]; then counts="$counts $p"; else echo "p = $p: skipped ($gpus GPUs here)"; fi
done
[ -n "$counts" ] || counts=" $gpus"   # fewer GPUs than every count asked for: run on all of them

count() { local n; n=$(echo "$last" | grep -oE "[0-9]+ $1" | cut -d' ' -f1); echo "${n:-0}"; }  # in $last
failed_counts=0
for p in $counts; do
  log=$OUT_DIR/gpu_tests_p$p.log
  t0=$(date +%s)
  timeout --kill-after=15 "${TIME_LIMIT:-1200}" bash scripts/mpi_run.sh -n "$p" "$PYTHON" -m pytest tests/gpu -q \
    -p no:cacheprovider > "$log" 2>&1
  rc=$?
  last=$(grep -E "(passed|failed|skipped|error).* in [0-9.]+s" "$log" | tail -1)  # pytest's summary (rank 0)
  summary="p = $p: $(count passed) passed, $(count failed) failed, $(count error) errors, $(count skipped) skipped"
  if [ -n "$last" ] && [ "$(count passed)" -eq 0 ] && [ "$(count failed)" -eq 0 ]; then  # all skipped: a failure too
    summary="$summary; no test ran (every module skips without CuPy and a GPU: pip install tplab[gpu])"
    [ "$rc" -ne 0 ] || rc=1
  fi
  if [ "$rc" -ne 0 ]; then
    failed_counts=$((failed_counts + 1))
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then summary="$summary; TIMED OUT after ${TIME_LIMIT:-1200} s"; fi
    [ -n "$last" ] || summary="$summary; no pytest summary (a rank aborted the job?)"
    echo "$summary -- FAILED (exit $rc, $(( $(date +%s) - t0 )) s; see $log)"
  else
    echo "$summary -- ok ($(( $(date +%s) - t0 )) s)"
  fi
done
if [ "$failed_counts" -ne 0 ]; then
  echo "GPU tests FAILED at $failed_counts of $(echo $counts | wc -w) rank counts; logs in $OUT_DIR"
  exit 1
fi
echo "GPU tests passed at p =$counts ($gpus GPUs); logs in $OUT_DIR"
