#!/usr/bin/env bash
# The GPU reference runs behind the notebooks' reference sections, on one GPU node (one MPI rank per GPU).
# Every CSV and log lands in OUT_DIR, and OUT_DIR.tar.gz packs it (one file to copy off the node).
#
#   bash scripts/gpu_reference_run.sh [OUT_DIR]                              # default build/gpu/reference
#   STAGES="train overlap collectives" bash scripts/gpu_reference_run.sh     # chosen stages
#   NP=8 STAGES="peer collectives models sequence graphs" bash scripts/gpu_reference_run.sh   # an 8-GPU node: TP=8
#
# Stages (each under its own time limit, so one failure does not cost the others):
#   train        scripts/train_fewer_syncs.py, the four block patterns at once, one GPU each (notebook 08); a node
#                without internet needs TPLAB_DATA_DIR set to a folder holding tinyshakespeare.txt
#   overlap      scripts/gpu_overlap.py at p = 4, CUDA_DEVICE_MAX_CONNECTIONS default and 1 (notebook 06): NCCL
#                (torch.distributed), tplab's copy-engine all-reduce and its peer-memory two-shot
#   contention   scripts/gpu_contention.py at p = 4: the block's compute and its all-reduces alone and together
#                on one GPU, per path (NCCL default and at NCCL_MAX_CTAS=8, tplab peer 8/16/32 blocks, copy
#                engines), cuBLAS SM carveout 0 and 16 (notebook 06: what overlap costs)
#   microbatch   scripts/gpu_overlap.py at p = 4, the block in micro-batches (k = 1, 2, 4), its last MLP in
#                1 or 4 pieces, carveout 0 and 16, NCCL / copy engines / peer 16 and 32 blocks (notebook 06);
#                MB_ENV sets NAME=VALUE pairs on every rank, MB_TAG names the file
#                (e.g. MB_ENV="CUDA_DEVICE_MAX_CONNECTIONS=1" MB_TAG=cdmc1)
#   graphs       tests/gpu/test_gpu_overlap.py at p = 4, then scripts/gpu_overlap.py --graphs at p = 4: every
#                variant replayed from a CUDA graph (the host out of the way), one block and a stack of 4 in
#                micro-batches (GRAPH_LAYERS), tails 1 and 2, NCCL / copy engines / peer 32 blocks, 2 repeats
#                (GRAPH_REPEATS) (notebook 06: hiding 75% of the communication)
#   collectives  scripts/gpu_collectives.py at p = 4 and 2, examples/gpu_ipc_allreduce.py at p = 4 (notebooks 01, 03)
#   peer         tests/gpu at p = 4, 3, 2 (scripts/gpu_tests.sh), then scripts/gpu_peer_allreduce.py at p = 4
#                and 2: the flag-synchronised peer-memory and copy-engine all-reduces against NCCL (notebooks 01, 03)
#   sequence4    scripts/gpu_sequence_parallel.py at p = 4 only, strong scaling (p = 1 is timed inside)
#   models       scripts/gpu_models.py at p = 1, 2, 4 (notebook 04)
#   sequence     scripts/gpu_sequence_parallel.py at p = 1, 2, 4 (notebook 05)
#   syncs        scripts/gpu_fewer_syncs_comm.py at p = 4: comm time per forward of the four block patterns (notebook 08)
#   alltoall     tests/gpu/test_gpu_alltoall.py, then scripts/gpu_alltoall.py at p = 4: tplab's all-to-all
#                (pairwise, Bruck) and all-to-all-v over NCCL point-to-point next to NCCL's all_to_all_single
#                (mixture-of-experts dispatch/combine: decode and prefill sizes; notebook 09)
set -u
REPOSITORY=$(cd "$(dirname "$0")/.." && pwd)
R=$(realpath -m "${1:-$REPOSITORY/build/gpu/reference}")
cd "$REPOSITORY"
# NVLink multicast (NVLS) off: some nodes' fabric does not support it, and NCCL then fails at start-up
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$REPOSITORY OMP_NUM_THREADS=4
mkdir -p "$R"
NP=${NP:-4}                                   # ranks (one per GPU) of the fixed-size stages; NP=8 on an 8-GPU node
SCALING="1 2 4$( [ "$NP" -gt 4 ] && echo " $NP" )"     # the scaling stages' rank counts
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$R/gpus.txt"
nvidia-smi topo -m >> "$R/gpus.txt" 2>&1
stage() {  # stage NAME SECONDS COMMAND...: run it, log it, say how it ended
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" > "$R/log_$name.txt" 2>&1
  echo "$name: exit $? after $(( $(date +%s) - t0 )) s"; tail -3 "$R/log_$name.txt"
}
for s in ${STAGES:-train overlap collectives models sequence syncs}; do
  case $s in
  train)
    for i in 0 1 2 3; do
      cfg=$(python3 -c "from tplab.fewer_syncs import PATTERNS; print(list(PATTERNS)[$i])")
      mkdir -p "$R/train_$i"
      CUDA_VISIBLE_DEVICES=$i timeout 300 python3 scripts/train_fewer_syncs.py --device cuda --steps 2000 \
        --configs "$cfg" --out "$R/train_$i" > "$R/log_train_$i.txt" 2>&1 &
    done
    wait; echo "train: done"; tail -n 2 "$R"/log_train_*.txt ;;
  overlap)
    paths="torch.distributed,tplab copy engine,tplab peer"
    stage overlap 240 bash scripts/mpi_run.sh -n $NP python3 scripts/gpu_overlap.py "$R/overlap" --layers block,block_mb,mlp --paths "$paths"
    stage overlap_cdmc1 150 bash scripts/mpi_run.sh CUDA_DEVICE_MAX_CONNECTIONS=1 -n $NP python3 scripts/gpu_overlap.py "$R/overlap_cdmc1" \
      --layers block,block_mb --paths "$paths" ;;
  contention)
    stage contention 150 bash scripts/mpi_run.sh -n $NP python3 scripts/gpu_contention.py "$R/contention"
    stage contention_nccl8 90 bash scripts/mpi_run.sh NCCL_MAX_CTAS=8 TORCH_NCCL_HIGH_PRIORITY=1 -n $NP python3 scripts/gpu_contention.py \
      "$R/contention" --paths torch.distributed --tag nccl-max-ctas-8 ;;
  microbatch)
    stage microbatch${MB_TAG:+_$MB_TAG} 300 bash scripts/mpi_run.sh ${MB_ENV:-} -n $NP python3 scripts/gpu_overlap.py "$R/microbatch" \
      --layers block_mb --chunks 1,2,4 --tails 1,4 --sm-carveouts 0,16 \
      --paths "${MB_PATHS:-torch.distributed,tplab copy engine,tplab peer}" \
      --peer-blocks 16,32 --tag "micro-batches${MB_TAG:+_$MB_TAG}" ;;
  graphs)
    stage tests_overlap 150 bash scripts/mpi_run.sh TPLAB_UNDER_MPIEXEC=1 -n $NP python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_overlap.py
    stage graphs 330 bash scripts/mpi_run.sh -n $NP python3 scripts/gpu_overlap.py "$R/graphs" --graphs --layers ${GRAPH_LAYERS:-block_mb,stack_mb} \
      --chunks 1,2,4 --tails 1,2 --paths "torch.distributed,tplab copy engine,tplab peer" --peer-blocks 32 \
      --repeats ${GRAPH_REPEATS:-2} --tag graphs ;;
  peer)
    RANK_COUNTS="$(seq -s ' ' $NP -1 2)" bash scripts/gpu_tests.sh "$R/tests"
    stage peer$NP 200 bash scripts/mpi_run.sh -n $NP python3 scripts/gpu_peer_allreduce.py "$R/peer"
    stage peer2 150 bash scripts/mpi_run.sh -n 2 python3 scripts/gpu_peer_allreduce.py "$R/peer" ;;
  sequence4)
    stage sequence_p$NP 300 bash scripts/mpi_run.sh -n $NP python3 scripts/gpu_sequence_parallel.py "$R/sequence" --modes strong \
      --schemes allgather_kv,ulysses,ring ;;
  collectives)
    stage collectives$NP 150 bash scripts/mpi_run.sh -n $NP python3 scripts/gpu_collectives.py --out "$R/coll$NP" --time-limit 110 --budget 0.2
    stage collectives2 100 bash scripts/mpi_run.sh -n 2 python3 scripts/gpu_collectives.py --out "$R/coll2" --time-limit 70 --budget 0.2 --skip-check
    stage ipc$NP 120 bash scripts/mpi_run.sh -n $NP python3 examples/gpu_ipc_allreduce.py "$R/ipc" ;;
  models)
    for p in $SCALING; do stage models_p$p 150 bash scripts/mpi_run.sh -n $p python3 scripts/gpu_models.py --csv "$R/models_gpu.csv"; done ;;
  sequence)
    for p in $SCALING; do stage sequence_p$p 240 bash scripts/mpi_run.sh -n $p python3 scripts/gpu_sequence_parallel.py "$R/sequence"; done ;;
  syncs)
    stage syncs 200 bash scripts/mpi_run.sh -n $NP python3 scripts/gpu_fewer_syncs_comm.py "$R/syncs" ;;
  alltoall)
    stage tests_alltoall 150 bash scripts/mpi_run.sh TPLAB_UNDER_MPIEXEC=1 -n $NP python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_alltoall.py
    stage alltoall 300 bash scripts/mpi_run.sh -n $NP python3 scripts/gpu_alltoall.py "$R/alltoall" ;;
  *)
    echo "unknown stage $s" >&2 ;;
  esac
done
tar -czf "$R.tar.gz" -C "$(dirname "$R")" "$(basename "$R")" && ls -la "$R.tar.gz"
