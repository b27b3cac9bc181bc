"""The agreement and the rules of the shard exchanges (tplab.comm.shard_exchange and
tplab.gpu_collectives.copy_engine_exchange). Before a shard moves, every rank learns which call every rank
is making (its name and number), every rank's shard shape and dtype, and any problem a rank found with its
own arguments: bad input is the same error everywhere, instead of peers waiting for a shard that never comes."""

from __future__ import annotations

from tplab.comm.base import CollectiveArgumentError


def agree_on_shards(allgather_object, what: str, call: int, shape, dtype, problem: str = "") -> None:
    """Every rank makes call number ``call`` of the same kind (``what``) with a shard of one shape and dtype,
    and none found a problem, or every rank raises the same CollectiveArgumentError."""
    everyone = allgather_object((what, call, tuple(shape), str(dtype), problem))
    problems = [f"rank {q}: {p}" for q, (*_, p) in enumerate(everyone) if p]
    if not problems and len({(w, c) for w, c, *_ in everyone}) > 1:
        problems = ["the ranks are at different calls (" +
                    ", ".join(f"rank {q}: {w} #{c}" for q, (w, c, *_) in enumerate(everyone)) + ")"]
    if not problems and len({(s, d) for _, _, s, d, _ in everyone}) > 1:
        problems = ["the ranks' shards differ (" +
                    ", ".join(f"rank {q}: {s} {d}" for q, (_, _, s, d, _) in enumerate(everyone)) + ")"]
    if problems:
        raise CollectiveArgumentError(f"{what}: " + "; ".join(problems))


def digests_agree(mpi_comm, what: str, call: int, shape, dtype, problem: str = "") -> bool:
    """The agreement's fast path, for an mpi4py communicator: every rank's (call, shape, dtype) as a 64-bit
    digest and a problem flag in one buffer allgather -- a few microseconds where ``agree_on_shards`` pickles
    (tens of them; a copy-engine exchange agrees four times a layer, and its host must stay ahead of the
    GPU). True when the digests agree and no rank has a problem; otherwise every rank has seen the same
    digests, so every rank runs ``agree_on_shards``, which says what differs and raises."""
    import hashlib

    import numpy as np

    digest = hashlib.blake2b(f"{what}|{call}|{tuple(shape)}|{dtype}".encode(), digest_size=8).digest()
    mine = np.array([int.from_bytes(digest, "little", signed=True), 1 if problem else 0], dtype=np.int64)
    everyone = np.empty((mpi_comm.Get_size(), 2), dtype=np.int64)
    mpi_comm.Allgather(mine, everyone)
    return bool((everyone[:, 0] == everyone[0, 0]).all() and not everyone[:, 1].any())


def out_problem(shard, out, size: int) -> str:
    """What is wrong with start_gather's ``out`` (every rank's shard lands in out[q]), or "": it must be one
    contiguous (p, *shard.shape) tensor of the shard's dtype, on its device."""
    if out is None:
        return ""
    want = (size, *shard.shape)
    if tuple(out.shape) != want or out.dtype != shard.dtype or out.device != shard.device or not out.is_contiguous():
        return (f"out must be a contiguous {want} {shard.dtype} tensor on {shard.device}, not "
                f"{tuple(out.shape)} {out.dtype} on {out.device}{'' if out.is_contiguous() else ' (strided)'}")
    return ""


def check_send(q, exchange, sent, written) -> None:
    """A scatter sends each peer's partial exactly once, after writing it (the same rule everywhere)."""
    if q == exchange.rank or not 0 <= q < exchange.size:
        raise ValueError(f"send({q}): a peer's rank, not this rank ({exchange.rank}) or one outside 0..{exchange.size - 1}")
    if q in sent:
        raise RuntimeError(f"send({q}) twice in one scatter: the second would be taken for the next call's")
    if written is not None and q not in written:
        raise RuntimeError(f"send({q}) before out_for({q}): write rank {q}'s partial first")


def check_all_sent(exchange, sent) -> None:
    missing = sorted(set(range(exchange.size)) - {exchange.rank} - set(sent))
    if missing:
        raise RuntimeError(f"finish(): nothing sent to rank(s) {missing} (each peer needs its partial: "
                           "out_for(q), then send(q))")
