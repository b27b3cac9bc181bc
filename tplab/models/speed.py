"""How fast a tensor-parallel model runs: forward time and greedy-generation tokens/s, vs the TP degree.

Measured the way tplab measures everything (nccl-tests' conventions): warm-up first, then many
timed runs, each started together on all ranks; per run the *slowest* rank's time (a TP forward pass is
done when its last rank is), and the median over runs. On GPUs each rank times with CUDA events on its
stream; on CPUs with a monotonic clock. The tensors stay on whatever device the model is on, and the
collectives go through whatever communicator the model was sharded over (MPI for CPU tensors, a GPU
communicator for CUDA tensors). tplab's argument checks are off while timing (they are not TP's cost).

    time_model_forward(sharded, tokens, comm)            -> {"forward_ms": ..., ...}
    time_generation(sharded, prompt, 32, comm)           -> {"tokens_per_s": ..., ...}
    forward_time_vs_tp(config, comm, batch=4, seq=64)    -> one row per TP degree (CPU ranks or GPUs)
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np
import torch

from tplab.comm import communicator
from tplab.layers import mappings
from tplab.models.gpt import GPT, GPTConfig, generate
from tplab.models.parallel import check_splittable, parallelize
from tplab.toolkit.timing import median_of_slowest, time_calls


@contextmanager
def timing_mode(threads: int | None = None):
    """No argument checks in the collectives, no autograd; optionally ``threads`` torch threads."""
    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with mappings.argument_checks_off(), torch.inference_mode():
            yield
    finally:
        torch.set_num_threads(old_threads)


def _device_of(model) -> torch.device:
    return next(model.parameters()).device


def time_model_forward(model, tokens, comm, iters: int = 10, warmup: int = 2) -> dict:
    """Forward-pass time of ``model`` on ``tokens`` (collective: every rank of ``comm`` calls it)."""
    device = _device_of(model)
    tokens = tokens.to(device)
    with timing_mode():
        times = time_calls(lambda: model(tokens), iters=iters, warmup=warmup, barrier=comm.barrier,
                           cuda=device.type == "cuda")
    median, best = median_of_slowest(times, comm)
    return {"forward_ms": median * 1e3, "forward_min_ms": best * 1e3, "iters": iters}


def time_generation(model, prompt, new_tokens: int, comm, repeats: int = 3, warmup: int = 1) -> dict:
    """Greedy generation with the KV cache: new tokens per second over the batch, prompt included in
    the time (as a user waits for it)."""
    device = _device_of(model)
    prompt = prompt.to(device)
    with timing_mode():
        times = time_calls(lambda: generate(model, prompt, new_tokens), iters=repeats, warmup=warmup,
                           barrier=comm.barrier, cuda=device.type == "cuda")
    median, _ = median_of_slowest(times, comm)
    return {"generate_s": median, "tokens_per_s": prompt.shape[0] * new_tokens / median, "new_tokens": new_tokens}


def tp_degrees(config: GPTConfig, ranks: int) -> list[int]:
    """The TP degrees up to ``ranks`` that divide it and that the model's shapes can be split over."""
    degrees = []
    for t in range(1, ranks + 1):
        try:
            check_splittable(config, t)
        except ValueError:
            continue
        if ranks % t == 0:
            degrees.append(t)
    return degrees


def wait_sleeping_for_rank_0(comm, poll_s: float = 0.002) -> None:
    """Ranks with nothing to do wait here *sleeping* until rank 0 calls it too (an MPI barrier or
    collective would spin, taking a core from the ranks at work when ranks share cores)."""
    if comm.size == 1:
        return
    token = np.zeros(1, dtype=np.int8)
    if comm.rank == 0:
        for r in range(1, comm.size):
            comm.send(token, r, tag=77)
        return
    request = comm.irecv(token, 0, tag=77)
    while not request.test():
        time.sleep(poll_s)
    request.wait()


def forward_time_vs_tp(config: GPTConfig, comm=None, batch: int = 4, seq: int = 64, degrees=None, iters: int = 10,
                       warmup: int = 2, new_tokens: int = 0, sequence_parallel: bool = False, seed: int = 0,
                       device=None, threads: int | None = 1) -> list[dict]:
    """Forward time (and generation tokens/s if ``new_tokens``) of ``config``'s model split over t ranks,
    for each TP degree t: ranks 0..t-1 run it, the others wait sleeping. One row per degree, the same
    on every rank. ``threads`` torch threads per rank while timing (1: one core per rank). ``comm``:
    default the world, or on ``device="cuda"`` NCCL on each rank's bound GPU (tplab.comm.communicator),
    so ``cluster.run(forward_time_vs_tp, config)`` works from a notebook either way."""
    device = torch.device(device or "cpu")
    comm = comm or communicator(device.type)
    waiter = comm.host if comm.moves_gpu_memory else comm  # (the token waited for below is a host array)
    degrees = degrees or tp_degrees(config, comm.size)
    rows = []
    for t in degrees:
        member = comm.rank < t
        group = comm.split(color=0 if member else 1, key=comm.rank)
        row = None
        if member:
            torch.manual_seed(seed)  # the same model on every rank of the group
            model = GPT(config)
            sharded = parallelize(model, group, sequence_parallel=sequence_parallel).to(device)
            del model
            tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
            with timing_mode(threads):
                row = {"tp": t, "batch": batch, "seq": seq, "sequence_parallel": sequence_parallel,
                       "dtype": str(config.dtype).replace("torch.", ""), "device": device.type,
                       **time_model_forward(sharded, tokens, group, iters=iters, warmup=warmup)}
                if new_tokens:
                    row.update(time_generation(sharded, tokens[:, : max(seq // 4, 1)], new_tokens, group,
                                               repeats=max(2, iters // 3)))
        wait_sleeping_for_rank_0(waiter)
        rows.append(comm.allgather_object(row)[0])
    return rows


def forward_flops(config: GPTConfig, batch: int, seq: int) -> float:
    """FLOPs of one forward pass (2 per multiply-add): the projections, the MLP, attention's two
    products (causal: half of s^2) and the LM head."""
    h, f, d = config.n_embd, config.ffn, config.head_dim
    tokens = batch * seq
    projections = 2 * tokens * h * (config.n_head * d + 2 * config.kv_heads * d + config.n_head * d)
    mlp = 2 * tokens * h * f * (3 if config.mlp == "swiglu" else 2)
    attention = 2 * 2 * batch * config.n_head * d * seq * seq / 2
    return config.n_layer * (projections + mlp + attention) + 2 * tokens * h * config.vocab_size


def summary(rows) -> str:
    """One line per degree: ms, speed-up over the smallest degree, tokens/s."""
    base = rows[0]["forward_ms"]
    lines = []
    for r in rows:
        line = f"TP={r['tp']}: forward {r['forward_ms']:.2f} ms ({base / r['forward_ms']:.2f}x)"
        if "tokens_per_s" in r:
            line += f", generation {r['tokens_per_s']:.0f} tokens/s"
        lines.append(line)
    return "\n".join(lines)


__all__ = ["forward_flops", "forward_time_vs_tp", "summary", "time_generation", "time_model_forward", "timing_mode",
           "tp_degrees", "wait_sleeping_for_rank_0"]
