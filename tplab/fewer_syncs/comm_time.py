"""How long a step of each block pattern spends communicating, on real ranks.

    rows = comm_time_per_step()                             # on every rank (cluster.run(...))
    rows = comm_time_per_step(network=dict(latency=50e-6, bandwidth=1e9))    # an emulated slow network
    comm_time_df(...)                                       # the same as a pandas DataFrame

For each pattern, a FewerSyncsGPT on RealRanks over this job's ranks runs ``iters`` forward passes
(inference) and ``iters`` training steps (forward + backward) on the same random batch. A stopwatch
around every collective (RealRanks(timing=True)) gives the time spent inside them: the activations'
all-reduces forward and backward, and the small all-reduce of replicated weights' gradients. Each
figure is one rank's median over the iterations, then the slowest rank's (the job waits for it).
Time inside a collective includes waiting for ranks that arrive late: that is what a sync costs.

With ``network``, the ranks talk through tplab.comm.EmulatedNetwork (``ranks_per_node`` consecutive
ranks per emulated machine, 1 by default: every message crosses the network and pays latency +
bytes / bandwidth), as if each rank sat on its own machine behind a slow link.
"""

from __future__ import annotations

import statistics

import torch

from tplab.fewer_syncs.model import PATTERNS, FewerSyncsGPT, dense_gpt, syncs_per_forward
from tplab.fewer_syncs.ranks import RealRanks, clock
from tplab.layers import mappings


def default_heads(p: int) -> int:
    """The student project's 4 heads where p divides 4; else p heads (one per rank)."""
    return 4 if 4 % p == 0 else p


def _communicator(comm, network):
    from tplab.comm import EmulatedNetwork, world

    comm = comm or world()
    if not network:
        return comm, "this machine (MPI)"
    net = dict(network)
    q = net.pop("ranks_per_node", 1)
    emulated = EmulatedNetwork(comm, q, **net)
    return emulated, (f"emulated: {comm.size // q} nodes x {q} ranks, {emulated.network.latency * 1e6:g} us, "
                      f"{emulated.network.bandwidth / 1e9:g} GB/s between nodes")


def comm_time_per_step(patterns=None, *, batch_size=4, block_size=64, n_embd=None, n_head=None, vocab_size=65,
                       iters=10, warmup=2, network=None, algorithm="auto", comm=None, steps=True,
                       device=None) -> list[dict]:
    """One row per pattern, the same on every rank (collective: call it on every rank). ``steps=False``
    times forward passes only (the step columns are then NaN). ``device`` ("cuda" with a GPU
    communicator such as tplab.comm.nccl_world()): where the model and tokens live; the stopwatch then
    waits for the GPU at every reading."""
    comm, where = _communicator(comm, network)
    p = comm.size
    n_head = n_head or default_heads(p)
    n_embd = n_embd or 32 * n_head
    patterns = patterns or PATTERNS
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab_size, (batch_size, block_size), generator=g).to(device or "cpu")
    rows = []
    with mappings.argument_checks_off():
        for name, pattern in patterns.items():
            ranks = RealRanks(comm, algorithm=algorithm, timing=True, device=device)
            dense = dense_gpt(len(pattern), vocab_size, block_size, n_head, n_embd)
            model = FewerSyncsGPT(dense, pattern, ranks).to(device or "cpu")
            samples = {"forward": [], "forward_comm": [], "step": [], "step_comm": []}
            for i in range(warmup + iters):
                ranks.reset_clock()
                comm.barrier()
                started = clock(device)
                with torch.no_grad():
                    model(tokens)  # inference: the forward pass alone
                forward = clock(device) - started
                forward_comm = ranks.comm_seconds["forward"]
                step = step_comm = float("nan")
                if steps:
                    ranks.reset_clock()
                    comm.barrier()
                    started = clock(device)
                    model(tokens, tokens)[1].backward()  # a training step's forward + backward
                    step, step_comm = clock(device) - started, sum(ranks.comm_seconds.values())
                    model.zero_grad(set_to_none=True)
                if i >= warmup:
                    for key, value in [("forward", forward), ("forward_comm", forward_comm), ("step", step),
                                       ("step_comm", step_comm)]:
                        samples[key].append(value)
            medians = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
            slowest = {k: max(r[k] for r in comm.allgather_object(medians)) for k in medians}
            rows.append({"config": name, "pattern": ",".join(pattern), "p": p, "syncs_forward": syncs_per_forward(pattern),
                         "forward_ms": slowest["forward"], "forward_comm_ms": slowest["forward_comm"],
                         "step_ms": slowest["step"], "step_comm_ms": slowest["step_comm"],
                         "message_bytes": batch_size * block_size * n_embd * 4, "batch_size": batch_size,
                         "block_size": block_size, "n_embd": n_embd, "n_head": n_head, "iters": iters,
                         "network": where, "algorithm": algorithm, "device": str(device or "cpu")})
    return rows


def comm_time_df(*args, **kwargs):
    import pandas as pd

    return pd.DataFrame(comm_time_per_step(*args, **kwargs))


def time_saved(timed, reference="baseline"):
    """``timed`` (a comm_time_df) with the forward time each pattern saves against ``reference``'s."""
    base = timed.set_index("config").loc[reference]
    return timed.assign(saved_per_forward_ms=base.forward_ms - timed.forward_ms,
                        saved_fraction=1 - timed.forward_ms / base.forward_ms,
                        saved_comm_ms=base.forward_comm_ms - timed.forward_comm_ms)
