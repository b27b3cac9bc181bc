"""All-to-all through peer memory: each rank writes each destination's block straight into that peer's buffer.

    out = peer_alltoall(comm.peers, x)        # x: p equal blocks, block j for rank j (CuPy, this rank's GPU)

The kernel (kernels/alltoall.cu) starts with the ranks' argument agreement, like the all-reduces:
mismatched sizes or types raise on every rank. scripts/gpu_alltoall.py times it next to NCCL's all-to-all and
tplab's hand-written ones over NCCL point-to-point.
"""

from __future__ import annotations

import numpy as np

from tplab.gpu_collectives.peer_kernels import PACK, kernel
from tplab.gpu_collectives.peer_memory import THREADS


def peer_alltoall(peers, x, out=None, *, check: bool = True):
    """On ``peers`` (a PeerMemory): ``x`` (a contiguous CuPy array of p equal blocks, block j for rank j)
    -> ``out`` of the same shape, block q the one rank q meant for this rank. One kernel: each rank pushes
    its blocks into the peers' buffers over NVLink, one barrier, copies its own buffer out, one barrier.
    Collective, queued on the current stream."""
    import cupy

    p, problem = peers.size, ""
    block = x.nbytes // p if x.size % p == 0 else 0
    packs = -(-block // PACK)
    if not x.flags.c_contiguous:
        problem = "peer all-to-all needs a contiguous array"
    elif x.size % p:
        problem = f"{x.size} elements do not split into {p} equal blocks"
    elif p * packs * PACK > peers.nbytes:
        problem = f"{p} blocks of {block} bytes do not fit the {peers.nbytes}-byte peer buffers"
    elif out is not None and (out.size != x.size or out.dtype != x.dtype or not out.flags.c_contiguous):
        problem = f"out must be {x.size} contiguous {x.dtype}, not {out.size} {out.dtype}"
    if problem:
        peers.refuse(problem, "peer all-to-all")
    peers.raise_pending()
    sig = peers.signature_of(x, "alltoall", collective="peer alltoall")
    out = cupy.empty_like(x) if out is None else out
    if x.size == 0 or p == 1:
        if p > 1:
            peers.launch_agreement(sig)
        out[...] = x
        return out
    direct = block % PACK == 0 and x.data.ptr % PACK == 0 and out.data.ptr % PACK == 0
    if direct:
        source, target = x, out
    else:                                              # blocks padded to whole packs
        source = cupy.zeros((p, packs * PACK), dtype=cupy.uint8)
        source[:, :block] = x.reshape(-1).view(cupy.uint8).reshape(p, block)
        target = cupy.empty((p, packs * PACK), dtype=cupy.uint8)
    blocks = max(1, min(peers.max_blocks, -(-packs // THREADS)))
    kernel("alltoall")((blocks,), (THREADS,), (source, target, peers.data_pointers, peers.flag_pointers,
                                                peers.epochs, np.int32(peers.rank), np.int32(p),
                                                np.int64(packs), peers.control, np.uint64(sig)))
    if not direct:
        out.reshape(-1).view(cupy.uint8).reshape(p, block)[...] = target[:, :block]
    if check:
        cupy.cuda.get_current_stream().synchronize()
        peers.raise_pending()
    return out
