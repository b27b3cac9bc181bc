"""A Llama-shaped model split over p GPUs: does it match the unsplit one, and how fast is it?

Run once per GPU count, one MPI rank per GPU (rows are appended to one CSV):

    for p in 1 2 4; do mpiexec -n $p python scripts/gpu_models.py --out DIR; done   # DIR/models_gpu_<card>.csv

Each run, for bf16 and fp32 (TF32 off, so fp32 is fp32):
  1. builds the model on every GPU from the same seed (hidden 4096, 32 heads, 8 KV heads, MLP 14336,
     vocabulary 32000: Llama-3-8B's layer shapes, ``--layers`` of them), shards it over the p ranks;
  2. checks the sharded logits against the unsplit model's on rank 0's GPU (max relative difference),
     and that greedy generation gives the same tokens;
  3. times the forward pass (batch ``--batch``, sequence ``--seq``; CUDA events, warm-up, median over
     ``--iters`` runs of the slowest rank) with tensor parallelism and with sequence parallelism, and
     greedy generation (prompt ``--prompt``, ``--new-tokens`` tokens, KV cache) in tokens/s;
  4. with tplab's GPU transport, does all of it twice: tplab's own collectives (algorithm "auto") and
     NCCL's (algorithm "builtin"), in the same run on the same cards.

The transport: ``tplab.comm.nccl.nccl_world()`` when it imports and passes a first all-reduce, else
torch.distributed's NCCL collectives through the tiny adapter below (column ``transport`` says which).
The ``machine`` column names the card (torch.cuda.get_device_name).

``--smoke`` runs the same script on CPU ranks with a tiny model (tplab's MPI transport, and the
torch.distributed adapter over gloo), to check it before spending GPU time:

    mpiexec -n 2 python scripts/gpu_models.py --smoke --out build/smoke
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from tplab.comm.torch_dist import TorchDistributedComm  # noqa: E402
from tplab.models import GPT, GPTConfig, generate, parallelize  # noqa: E402
from tplab.models.speed import time_generation, time_model_forward, timing_mode  # noqa: E402

WORLD = MPI.COMM_WORLD


def bind_gpu() -> torch.device:
    local_rank = WORLD.Split_type(MPI.COMM_TYPE_SHARED).rank
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def communicators(device) -> list[tuple[str, object, str]]:
    """[(transport, comm, algorithm), ...] to measure: tplab's own and NCCL's through it, or the fallback."""
    if device.type == "cpu":  # --smoke: tplab over MPI, and the torch.distributed adapter over gloo
        from tplab.comm import world

        return [("tplab-mpi", world(), "auto"), ("tplab-mpi", world(), "builtin"),
                ("torch.distributed-gloo", TorchDistributedComm(device), "builtin")]
    comm, why = None, ""
    try:
        from tplab.comm.nccl import nccl_world

        comm = nccl_world()
        import tplab

        x = torch.full((1024,), float(WORLD.rank + 1), device=device)
        expected = torch.full_like(x, WORLD.size * (WORLD.size + 1) / 2)
        ok = torch.allclose(tplab.allreduce(x, comm, algorithm="ring"), expected)
    except Exception as e:  # noqa: BLE001 - whatever keeps tplab's transport out, fall back (and say why)
        ok, why = False, f"{type(e).__name__}: {e}"
    if WORLD.allreduce(int(ok), op=MPI.MIN):
        return [("tplab-nccl", comm, "auto"), ("tplab-nccl", comm, "builtin")]
    if WORLD.rank == 0:
        print(f"tplab.comm.nccl not usable ({why or 'failed on another rank'}): torch.distributed NCCL instead")
    return [("torch.distributed-nccl", TorchDistributedComm(device), "builtin")]


def llama_config(layers: int, dtype, smoke=False) -> GPTConfig:
    if smoke:
        return GPTConfig(vocab_size=256, block_size=512, n_layer=layers, n_head=8, n_kv_head=2, n_embd=64,
                         ffn_size=128, mlp="swiglu", norm="rmsnorm", norm_dtype=torch.float32, position="rope",
                         bias=False, dtype=dtype)
    return GPTConfig(vocab_size=32000, block_size=8192, n_layer=layers, n_head=32, n_kv_head=8, n_embd=4096,
                     ffn_size=14336, mlp="swiglu", norm="rmsnorm", norm_dtype=torch.float32, position="rope",
                     rope_theta=500000.0, bias=False, dtype=dtype)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "build" / "gpu"),
                    help="where models_gpu_<card>.csv goes (default: build/gpu in the repository)")
    ap.add_argument("--csv", default=None, help="the CSV file itself, instead of OUT/models_gpu_<card>.csv")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gen-batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--smoke", action="store_true", help="CPU ranks, a tiny model: check the script itself")
    args = ap.parse_args()
    if args.smoke:
        args.seq, args.prompt, args.new_tokens, args.iters = 32, 8, 4, 3
        args.dtypes = "float32,float64" if args.dtypes == "bfloat16,float32" else args.dtypes

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cpu") if args.smoke else bind_gpu()
    p, rank = WORLD.size, WORLD.rank
    card = "cpu (smoke test)" if args.smoke else torch.cuda.get_device_name(device)
    path = Path(args.csv or Path(args.out) /
                f"models_gpu_{card.lower().replace('nvidia', '').strip().split()[0]}.csv")
    transports = communicators(device)
    rows = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        config = llama_config(args.layers, dtype, args.smoke)
        torch.manual_seed(0)  # the same weights on every GPU (CUDA's generator, the same on every card)
        with torch.device(device):
            model = GPT(config).eval()
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=g).to(device)
        prompt = torch.randint(0, config.vocab_size, (args.gen_batch, args.prompt), generator=g).to(device)
        with torch.inference_mode():
            reference = model(tokens).double() if rank == 0 else None
            reference_tokens = generate(model, prompt, 16) if rank == 0 else None
        unsplit_ms = time_model_forward(model, tokens, _Alone(), iters=args.iters)["forward_ms"] if rank == 0 else None
        for transport, comm, algorithm in transports:
            with torch.device(device):
                sharded = parallelize(model, comm, algorithm=algorithm).eval()
            with timing_mode():
                same_tokens = generate(sharded, prompt, 16)
            for sequence_parallel in (False, True):
                if sequence_parallel and args.seq % p:
                    continue
                sharded.sequence_parallel = sequence_parallel
                with timing_mode():
                    logits = sharded(tokens).double()
                if rank == 0:
                    err = float((logits - reference).abs().max() / reference.abs().max())
                    token_match = float((same_tokens == reference_tokens).float().mean())
                del logits
                row = {"machine": card, "gpus": p, "transport": transport, "algorithm": algorithm,
                       "dtype": dtype_name, "layers": args.layers, "hidden": config.n_embd, "heads": config.n_head,
                       "kv_heads": config.kv_heads, "batch": args.batch, "seq": args.seq,
                       "sequence_parallel": sequence_parallel,
                       **time_model_forward(sharded, tokens, comm, iters=args.iters)}
                if not sequence_parallel:
                    row.update(time_generation(sharded, prompt, args.new_tokens, comm))
                    row["gen_batch"] = args.gen_batch
                if rank == 0:
                    row.update(unsplit_forward_ms=unsplit_ms, max_rel_err=err, greedy_token_match=token_match,
                               torch=torch.__version__, nccl=_nccl_version(),
                               date=time.strftime("%Y-%m-%d"))
                    rows.append(row)
                    print({k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            del sharded
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()
    if rank == 0:
        write_rows(path, rows)
        print(f"appended {len(rows)} rows to {path}")


def _nccl_version() -> str:
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - a CPU build
        return ""


class _Alone:
    """A communicator of one rank, for timing the unsplit model on rank 0 alone."""

    rank, size = 0, 1

    def barrier(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def allgather_object(self, obj):
        return [obj]


def write_rows(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for row in rows for k in row))
    new = not path.exists()
    if not new:  # keep the file's columns; add any new ones at the end
        with open(path) as f:
            existing = next(csv.reader(f), [])
        fields = existing + [k for k in fields if k not in existing]
        if fields != existing:
            old = list(csv.DictReader(open(path)))
            rows, new = old + rows, True
    with open(path, "w" if new else "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if new:
            writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    main()
