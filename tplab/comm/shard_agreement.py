"""The agreement of the shard exchanges (tplab.overlap.shard_exchange, tplab.gpu_collectives.copy_engine_exchange):
before a shard moves, every rank learns every rank's shard shape and dtype and any problem a rank found
with its own, so that bad input is the same error everywhere instead of peers waiting for a shard."""

from __future__ import annotations

from tplab.comm.base import CollectiveArgumentError


def agree_on_shards(allgather_object, what: str, shape, dtype, problem: str = "") -> None:
    """The shard exchanges' agreement (tplab.overlap.shard_exchange): every rank's shard has one shape and
    dtype and no rank found a problem with its own, or every rank raises the same CollectiveArgumentError
    (before anything moves: a rank that raised alone would leave its peers waiting for its shard)."""
    everyone = allgather_object((tuple(shape), str(dtype), problem))
    problems = [f"rank {q}: {p}" for q, (_, _, p) in enumerate(everyone) if p]
    if not problems and len({(s, d) for s, d, _ in everyone}) > 1:
        problems = ["the ranks' shards differ (" + ", ".join(f"rank {q}: {s} {d}" for q, (s, d, _) in enumerate(everyone))
                    + ")"]
    if problems:
        raise CollectiveArgumentError(f"{what}: " + "; ".join(problems))
