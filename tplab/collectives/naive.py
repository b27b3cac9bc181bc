"""The naive allreduce: everyone sends to the root, the root reduces, the root sends the result back.

    time   ~ 2(p-1) a + 2(p-1) n b + (p-1) n g

The root's link carries 2(p-1) n bytes while every other link is idle: the bottleneck every better
algorithm removes. It is still the right picture to start from.
"""

from __future__ import annotations

from tplab.collectives.scratch import scratch
from tplab.collectives.snapshots import snapshot

ROOT = 0


def naive_allreduce(buf, comm, op):
    snapshot("start", buf, at_round=0)
    if comm.rank == ROOT:
        theirs = scratch("naive", buf.size, buf.dtype, like=buf)
        for source in range(1, comm.size):  # reduce in rank order: ((x0 op x1) op x2) ...
            comm.recv(theirs, source)
            op.combine(buf, theirs, out=buf)
            snapshot(f"root has ranks 0..{source}", buf, at_round=source)
        for dest in range(1, comm.size):
            comm.send(buf, dest)
    else:
        comm.send(buf, ROOT)
        comm.recv(buf, ROOT)
        snapshot("result from root", buf, at_round=comm.size)
    return buf
