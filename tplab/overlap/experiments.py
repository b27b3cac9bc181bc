"""The experiments of notebook 06, as functions every rank runs (``cluster.run(f, ...)``): a small TP
transformer block, its overlapped versions checked against it, traced, and swept over chunk counts.

    block, x = make_block(hidden=256, heads=8, seq=128, batch=2)   # the same weights and input everywhere
    check_block(chunk_counts)        # max |overlapped - plain| per k (float64), the same on every rank
    check_block(chunk_counts, splits=("batch",), layers=3)   # micro-batches through a stack of 3 blocks
    trace_block(chunks)              # the traced intervals of one forward pass (rank 0; None elsewhere)
    sweep_block(chunk_counts)        # metrics.overlap_sweep of the block (+ the pipeline model's columns)
    check_async_tp(layers=2)         # async TP on sequence shards vs the plain blocks, max |difference| (float64)
"""

from __future__ import annotations

import torch

from tplab.comm import world
from tplab.layers import mappings
from tplab.overlap.factory import overlapped
from tplab.overlap.metrics import overlap_sweep, pipeline_model
from tplab.overlap.trace import Tracer


def make_block(hidden=256, heads=8, seq=128, batch=2, dtype=torch.float32, seed=0, comm=None):
    """A tensor-parallel GPT block (tplab.models' ParallelBlock: LayerNorm, attention, MLP 4h) over
    ``comm`` (default: MPI's world) and an input (batch, seq, hidden), the same on every rank."""
    from tplab.models import GPT, GPTConfig
    from tplab.models.parallel import ParallelBlock

    comm = comm or world()
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=comm.size, n_layer=1, n_head=heads, n_embd=hidden, block_size=seq, dtype=dtype)
    block = ParallelBlock(GPT(config).blocks[0], comm)
    x = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
    return block, x


def check_block(chunk_counts=(1, 2, 4, 8), splits=("sequence", "batch"), layers=1, tail=1, **shape) -> list[dict]:
    """Overlapped block (cut along the sequence, or into micro-batches) vs the plain one in float64:
    largest difference of the output and of dL/dx. ``layers > 1``: a stack of that many blocks, pipelined
    in micro-batches across the layers (MicroBatchPipeline; the sequence split is for one block only);
    ``tail``: pieces of the last MLP step."""
    from torch import nn

    blocks = [make_block(dtype=torch.float64, seed=seed, **shape)[0] for seed in range(layers)]
    x = make_block(dtype=torch.float64, **shape)[1]
    plain = blocks[0] if layers == 1 else nn.Sequential(*blocks)
    rows = []
    for split, k in [(split, k) for split in splits for k in chunk_counts if split == "batch" or layers == 1]:
        outs = []
        for layer in (plain, overlapped(blocks[0] if layers == 1 else blocks, k, split=split, tail=tail)):
            xi = x.clone().requires_grad_()
            y = layer(xi)
            y.square().sum().backward()
            outs.append((y.detach(), xi.grad))
        (y, dx), (y2, dx2) = outs
        rows.append({"layers": layers, "split": split, "chunks": k, "tail": tail,
                     "max |y - y_plain|": (y - y2).abs().max().item(),
                     "max |dx - dx_plain|": (dx - dx2).abs().max().item(), "bitwise equal": torch.equal(y, y2)})
    return rows


def trace_block(chunks=4, warmup=2, **shape):
    """One traced forward pass of the block pipelined over ``chunks`` (after ``warmup`` untraced ones),
    without the collectives' argument checks (as when timing)."""
    block, x = make_block(**shape)
    layer = overlapped(block, chunks)
    tracer = Tracer(world())
    with mappings.argument_checks_off(), torch.no_grad():
        for _ in range(warmup):
            layer(x)
        tracer.restart()
        with tracer:
            layer(x)
    return tracer.gather()


def sweep_block(chunk_counts=(1, 2, 4, 8), iters=10, warmup=2, **shape):
    """Exposed communication and hidden fraction of the block over ``chunk_counts`` (metrics.py), with the
    pipeline model's prediction (metrics.pipeline_model)."""
    block, x = make_block(**shape)
    return pipeline_model(overlap_sweep(block, x, world(), chunk_counts, iters=iters, warmup=warmup))


def check_async_tp(layers=2, **shape) -> dict:
    """A stack of ``layers`` blocks run by async tensor parallelism (tplab.overlap.async_tp, shards moved as
    MPI messages) on this rank's rows of the sequence, against the plain tensor-parallel blocks' same rows
    (float64): the largest difference, the same on every rank (``shape``: make_block's; the sequence must
    split evenly over the ranks)."""
    from torch import nn

    from tplab.overlap.async_tp import AsyncTPBlock, my_rows
    from tplab.comm.shard_exchange import MessageExchange

    comm = world()
    blocks = [make_block(dtype=torch.float64, seed=seed, **shape)[0] for seed in range(layers)]
    x = make_block(dtype=torch.float64, **shape)[1]                          # (b, s, h), the same everywhere
    exchange = MessageExchange(comm)
    with torch.no_grad():
        want = my_rows(nn.Sequential(*blocks)(x), comm.rank, comm.size)      # (s/p, b, h): my rows
        got = nn.Sequential(*[AsyncTPBlock(b, exchange) for b in blocks])(my_rows(x, comm.rank, comm.size))
    worst = max(comm.allgather_object((got - want).abs().max().item()))
    return {"layers": layers, "ranks": comm.size, "rows per rank": tuple(got.shape), "max |y - y_plain|": worst}
