"""The student project's block patterns on real GPU ranks: how much of a forward pass (and a training step) is
spent in the all-reduces each pattern keeps, and how much each pattern saves against full TP.

    NCCL_NVLS_ENABLE=0 mpiexec -n 4 python scripts/gpu_fewer_syncs_comm.py [OUT_DIR]

One MPI rank per GPU, tplab's collectives over ``tplab.comm.nccl_world()`` (NCCL point-to-point; with
``--algorithm builtin`` NCCL's own all-reduce). For each size (the project's 128-dimension model, and a
wider one where communication weighs more) and each pattern: forward and step times, the time inside the
collectives (tplab.fewer_syncs.comm_time: the stopwatch waits for the GPU at every reading), each the
slowest rank's median. Writes OUT_DIR/fewer_syncs_comm_gpu_<card>.csv with a ``machine`` column.
"""

from __future__ import annotations

import argparse
import os

import pandas as pd
import torch

from tplab.comm.nccl import nccl_world
from tplab.fewer_syncs.comm_time import comm_time_df, time_saved

BUILD_GPU = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "build", "gpu")  # git-ignored

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("out_dir", nargs="?", default=BUILD_GPU,
                    help="where the CSVs go (default: build/gpu in the repository)")
parser.add_argument("--sizes", default="128x4,1024x16", help="n_embd x n_head, comma-separated")
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--block-size", type=int, default=256)
parser.add_argument("--iters", type=int, default=20)
parser.add_argument("--algorithm", default="auto", help="tplab's all-reduce (builtin: NCCL's own)")
args = parser.parse_args()

comm = nccl_world()
device = torch.device("cuda", torch.cuda.current_device())
card = torch.cuda.get_device_name(device)
machine = f"{comm.size}x {card}, torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
frames = []
for size in args.sizes.split(","):
    n_embd, n_head = (int(v) for v in size.split("x"))
    for algorithm in dict.fromkeys([args.algorithm, "builtin"]):
        timed = comm_time_df(comm=comm, device=device, batch_size=args.batch_size, block_size=args.block_size,
                             n_embd=n_embd, n_head=n_head, iters=args.iters, warmup=3, algorithm=algorithm)
        frames.append(time_saved(timed).assign(machine=machine))
if comm.rank == 0:
    table = pd.concat(frames, ignore_index=True)
    os.makedirs(args.out_dir, exist_ok=True)
    path = os.path.join(args.out_dir, f"fewer_syncs_comm_gpu_{comm.size}x-{card.split()[-1].lower()}.csv")
    table.to_csv(path, index=False)
    print(table[["config", "n_embd", "algorithm", "syncs_forward", "forward_ms", "forward_comm_ms", "step_ms",
                 "step_comm_ms", "saved_fraction"]].round(3).to_string())
    print("wrote", path)
