#!/usr/bin/env bash
# tplab's GPU all-reduce next to the strongest others, on one GPU node (one rank per GPU), in one command:
# small messages from CUDA graphs and eager (tplab's peer kernels; NCCL's default and symmetric kernels;
# torch's symmetric-memory one-shot and two-shot), large messages' bus bandwidth, and the API's back-to-back
# calls; then the headline table OUT_DIR/gpu_frontier_<P>x-<card>.csv (scripts/frontier_table.py).
#
#   bash scripts/gpu_frontier.sh [OUT_DIR]          # default build/gpu/frontier; P=2 for two GPUs
#   LAYERS=1 bash scripts/gpu_frontier.sh [OUT_DIR] # also the layers' rows: async TP (p5) and sequence
#                                                   # parallelism (p4), a few minutes more
#
# Needs CuPy (pip install tplab[gpu]), torch with symmetric memory (the symm_mem rows are skipped with the
# reason otherwise), mpi4py and an mpiexec (scripts/mpi_run.sh).
set -u
REPOSITORY=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(realpath -m "${1:-$REPOSITORY/build/gpu/frontier}")
cd "$REPOSITORY"
mkdir -p "$OUT"
rm -f "$OUT/small.csv" "$OUT/large.csv"   # (tplab bench skips the points its CSV has: a rerun measures anew)
rm -f "$OUT"/sequence_parallel_gpu_*.csv "$OUT"/async_tp_gpu_*.csv   # (the layers' rows: this run's or none)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # (see gpu_tests.sh)
export PYTHONPATH=$REPOSITORY${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
P=${P:-4}
PYTHON=${PYTHON:-python3}
CARD=$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name())" 2>/dev/null || echo gpu)
bench() { timeout 600 bash scripts/mpi_run.sh -n "$P" "$PYTHON" -m tplab bench allreduce --device gpu --machine "$CARD" "$@" || echo "FAILED: $*"; }

small="-b 1K -e 4M -f 2 -n 50 --csv $OUT/small.csv"   # (every power of two: no gap left unmeasured)
bench --peer-memory 64M $small --graph -a peer_one_shot_ll,peer_one_shot_lamport,peer_one_shot,peer_two_shot_lamport,peer_two_shot,auto,peer_registered,nccl,symm_mem_one_shot,symm_mem_two_shot
bench --peer-memory 64M $small -a peer_one_shot_ll,peer_one_shot_lamport,peer_one_shot,peer_two_shot_lamport,peer_two_shot,auto,peer_registered,nccl,symm_mem_one_shot,symm_mem_two_shot
# NCCL's symmetric kernels in a process of their own: torch fixes the symmetric-memory backend once
bench $small --graph -a nccl_symmetric
bench $small -a nccl_symmetric
bench --peer-memory 256M -b 256M -e 256M -n 20 -a peer_ring,peer_two_shot,nccl --csv "$OUT/large.csv"
timeout 600 bash scripts/mpi_run.sh -n "$P" "$PYTHON" scripts/gpu_api_allreduce.py "$OUT" --max-bytes 4M || echo "FAILED: api"
if [ "${LAYERS:-0}" = 1 ]; then   # the reference layer in bf16: async TP's layer of a stack of 4, then the course
  # project's sequence-parallel layer (strong scaling at p = P), each next to its anchors
  timeout 600 bash scripts/mpi_run.sh -n "$P" "$PYTHON" scripts/gpu_async_tp.py "$OUT" --graphs --iters 15 \
    --variants compute,async_no_transfers_whole_attention,async_tp_whole_attention,nccl_comm,plain_nccl,exchange_alone,compute_graph,async_tp_graph_whole_attention \
    || echo "FAILED: async TP"
  # (SEQUENCE_RUNS runs, default 3, appended to one CSV: the table takes each path's median over the runs --
  # ring attention's steps wait on the host's launches there, and one run's time varies with the host's;
  # --graphs: each path also replayed from CUDA graphs, which take the host's launches out)
  for _ in $(seq "${SEQUENCE_RUNS:-3}"); do
    timeout 600 bash scripts/mpi_run.sh -n "$P" "$PYTHON" scripts/gpu_sequence_parallel.py "$OUT" --modes strong \
      --dtypes bfloat16 --schemes allgather_kv,ring,streamed_kv \
      --paths direct_peer,direct_copy_engine,direct_ring,direct_nccl,torch_nccl,fused_kv,compute_only,compute_floor \
      --side-stream --graphs --no-components --iters 20 --warmup 5 || echo "FAILED: sequence parallel"
  done
fi
"$PYTHON" scripts/frontier_table.py "$OUT"
