#!/usr/bin/env bash
# Reference results for notebook 01: hand-written allreduce vs MPI_Allreduce on a many-core host
# (one core per rank, so the crossovers show without the noise of an oversubscribed laptop).
#   bash scripts/reference_host_mpi.sh OUT_CSV "machine description" [ranks...]
# Needs mpi4py, an mpiexec (MPIEXEC="..." to choose) and tplab importable.
set -euo pipefail
out=${1:?csv path}; machine=${2:?machine description}; shift 2
ranks=${*:-2 4 8 16}
export OMP_NUM_THREADS=1
MPIEXEC=${MPIEXEC:-mpiexec}  # e.g. MPIEXEC="bash scripts/mpi_run.sh" (Open MPI as root, in a container)
rm -f "$out"
for p in $ranks; do
  # correctness first: every algorithm against MPI_Allreduce on this machine, on every rank
  $MPIEXEC -n "$p" python3 -c "
import tplab.lab.verify as v
from mpi4py import MPI
assert MPI.COMM_WORLD.size == $p, 'mpi4py is not using the MPI of this mpiexec (every rank sees size 1)'
rows = v.allreduce_table()
bad = [r for r in rows if not r['ok']]
if MPI.COMM_WORLD.rank == 0:
    print(f'p=$p: {len(rows) - len(bad)} of {len(rows)} correctness cases ok')
    assert not bad, bad[:3]
"
  $MPIEXEC -n "$p" python3 -m tplab bench allreduce -b 8 -e 32M -f 2 -n 20 -w 3 \
      --csv "$out" --machine "$machine"
done
