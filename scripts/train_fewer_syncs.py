"""Train the student project's four block patterns on Tiny Shakespeare, one after another, on one device.

    python scripts/train_fewer_syncs.py --device cuda --steps 2000 --out DIR     # the reference run (GPU)
    python scripts/train_fewer_syncs.py --device cpu --steps 300 --batch-size 12 --block-size 64 --out data

Each configuration is a 4-layer, 4-head, 128-dimension character GPT (the project's size) with p = 4
simulated tensor-parallel ranks (SimulatedRanks: all shards on the one device, the all-reduces are sums),
trained with nanoGPT's shakespeare_char recipe (tplab.fewer_syncs.train). Writes, as it goes:

    DIR/fewer_syncs_<cpu|gpu>_<machine>_curves.csv   train/val loss every --eval-interval steps
    DIR/fewer_syncs_<cpu|gpu>_<machine>_table.csv    the final table: one row per configuration

with a ``machine`` column naming the device, and prints the table (final validation loss next to the
project's claim of ~1.45-1.50 for all four, time per training step, all-reduces per forward pass).
Text: --data-dir, else TPLAB_DATA_DIR, the cache, or a download (tplab.lab.data).
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import sys
import time

import torch

from tplab.lab.data import CharData, tiny_shakespeare
from tplab.fewer_syncs import PATTERNS, PROJECT_SYNC_COUNTS, SimulatedRanks, TrainConfig, train
from tplab.toolkit.machine import cpu_model


def machine_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(torch.device(device))
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, CUDA {torch.version.cuda}"
    cpu = cpu_model()
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}"


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:  # the csv module: GPU images need not have pandas
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.split(",")[0].lower()).strip("-")[:40]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      "build", "train_fewer_syncs"),
                        help="where the CSVs go (default: build/train_fewer_syncs in the repository)")
    parser.add_argument("--p", type=int, default=4, help="simulated tensor-parallel ranks")
    parser.add_argument("--configs", default=",".join(PATTERNS), help="comma-separated names from PATTERNS")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--eval-iters", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--machine", default=None, help="describe the machine (default: detected)")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    if torch.device(args.device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # as nanoGPT does
        torch.backends.cudnn.allow_tf32 = True
    machine = args.machine or machine_name(args.device)
    kind = "gpu" if torch.device(args.device).type == "cuda" else "cpu"
    stem = os.path.join(args.out, f"fewer_syncs_{kind}_{slug(machine)}")
    os.makedirs(args.out, exist_ok=True)
    data = CharData(tiny_shakespeare(data_dir=args.data_dir))
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, block_size=args.block_size,
                      warmup_steps=args.warmup, eval_interval=args.eval_interval, eval_iters=args.eval_iters,
                      seed=args.seed)
    print(f"{machine}\n{cfg}\n", flush=True)

    curves, table = [], []
    for name in args.configs.split(","):
        pattern = PATTERNS[name]
        started = time.perf_counter()
        rows = train(pattern, data, cfg, SimulatedRanks(args.p), device=args.device, name=name,
                     progress=lambda r: print(f"  {r['config']:14s} step {r['step']:5d}  train {r['train_loss']:.4f}"
                                              f"  val {r['val_loss']:.4f}  {r['ms_per_step']:.1f} ms/step", flush=True))
        seconds = time.perf_counter() - started
        for row in rows:
            row.update(machine=machine, learning_rate=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
                       seed=cfg.seed)
        curves += rows
        last = rows[-1]
        table.append({"config": name, "pattern": last["pattern"], "p": last["p"], "steps": cfg.steps,
                      "val_loss": last["val_loss"], "train_loss": last["train_loss"],
                      "best_val_loss": min(r["val_loss"] for r in rows), "project_val_loss": "1.45-1.50",
                      "syncs_forward": last["syncs_forward"], "syncs_backward": last["syncs_backward"],
                      "weight_grad_syncs": last["weight_grad_syncs"],
                      "project_sync_count": PROJECT_SYNC_COUNTS[name], "ms_per_step": last["ms_per_step"],
                      "total_seconds": seconds, "parameters": last["parameters"], "batch_size": cfg.batch_size,
                      "block_size": cfg.block_size, "device": last["device"], "machine": machine})
        write_csv(stem + "_curves.csv", curves)  # after every configuration: a partial run leaves data
        write_csv(stem + "_table.csv", table)
    print(f"\n{'config':14s} {'pattern':36s} {'syncs':>5s} {'proj.':>5s} {'val loss':>8s} {'project':>9s} "
          f"{'ms/step':>8s} {'seconds':>8s}")
    for r in table:
        print(f"{r['config']:14s} {r['pattern']:36s} {r['syncs_forward']:5d} {r['project_sync_count']:5d} "
              f"{r['val_loss']:8.4f} {r['project_val_loss']:>9s} {r['ms_per_step']:8.2f} {r['total_seconds']:8.1f}")
    print(f"\nwrote {stem}_curves.csv and {stem}_table.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
