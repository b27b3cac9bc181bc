"""A lightweight tracer: when did each rank compute, communicate, or wait?

    tracer = Tracer(comm)                       # collective: the ranks agree on time zero
    with tracer:                                # active: nonblocking collectives record themselves
        with tracer.span("chunk 0 GEMM"):       # kind="compute" by default
            ...
        h = iallreduce(x, comm)                 # the progress thread records a "comm" interval
        h.wait()                                # a "wait" interval: the caller stood still
    df = tracer.gather()                        # on rank 0: one row per interval, every rank
    plot_timeline(df); write_chrome_trace(df, "trace.json")   # Gantt chart; chrome://tracing, Perfetto

Clocks. On the CPU each rank reads ``time.perf_counter()``; the ranks' clocks have different origins, so
``Tracer`` (and ``restart()``) ends a barrier and takes that moment as time zero on every rank: afterwards
the ranks agree to within the barrier's exit skew (microseconds on one machine, more when ranks outnumber
cores). On a GPU the host clock says when work was *queued*, not when it ran: give ``span`` a CUDA
stream (``stream=``) and it records CUDA events on it instead, turned into times after a synchronise,
relative to an event recorded right after the barrier (``Tracer(comm, gpu=True)`` does that for every
span: the caller's current stream, and the side stream of nonblocking collectives on CUDA tensors).

Lanes: each interval belongs to a lane (``lane=``): "main" for the calling thread, "progress thread" for
the thread that runs nonblocking collectives, or a CUDA stream's name. In a Chrome trace, pid = rank and
tid = lane.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager, nullcontext

_active = None  # the tracer that nonblocking collectives and Handle.wait record into (one per process)
_NOTHING = nullcontext()


def current():
    return _active


def span(name, kind="compute", lane="main"):
    """A span on the active tracer, or nothing when none is active (cheap: one global lookup)."""
    return _NOTHING if _active is None else _active.span(name, kind=kind, lane=lane)


class Tracer:
    def __init__(self, comm=None, *, gpu: bool = False):
        self.comm, self.gpu = comm, gpu
        self.rows: list[dict] = []
        self._events: list = []  # (name, kind, lane, start event, end event) until resolved
        self._lock = threading.Lock()  # the progress thread records too
        self.restart()

    # ---- time zero -------------------------------------------------------------------------------------------
    def restart(self) -> None:
        """Forget what was recorded; time zero is now, the same moment on every rank (collective)."""
        self.rows.clear()
        self._events.clear()
        if self.gpu:
            import torch

            torch.cuda.synchronize()
        if self.comm is not None:
            self.comm.barrier()
            self.comm.barrier()  # the second one leaves the ranks closer together than the first
        self.t0 = time.perf_counter()
        if self.gpu:
            import torch

            self._zero_event = torch.cuda.Event(enable_timing=True)
            self._zero_event.record()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    # ---- recording -------------------------------------------------------------------------------------------
    def record(self, name, kind, start, end, lane="main", **fields) -> None:
        """An interval given in ``time.perf_counter()`` readings."""
        with self._lock:
            self.rows.append({"lane": lane, "kind": kind, "name": name, "start": start - self.t0,
                              "end": end - self.t0, **fields})

    @contextmanager
    def span(self, name, kind="compute", lane="main", stream=None, **fields):
        if self.gpu and stream is None and kind != "wait":  # a GPU tracer times the current stream
            import torch

            stream = torch.cuda.current_stream()
            lane = "compute stream" if lane == "main" else lane
        if stream is not None:  # GPU: when the stream ran it, not when the host queued it
            import torch

            begin, finish = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record(stream)
            try:
                yield
            finally:
                finish.record(stream)
                self._events.append((name, kind, lane, begin, finish, fields))
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, kind, start, time.perf_counter(), lane=lane, **fields)

    def _resolve_gpu_events(self) -> None:
        if not self._events:
            return
        import torch

        torch.cuda.synchronize()
        for name, kind, lane, begin, finish, fields in self._events:
            start = self._zero_event.elapsed_time(begin) / 1e3  # ms -> s since time zero
            self.rows.append({"lane": lane, "kind": kind, "name": name, "start": start,
                              "end": start + begin.elapsed_time(finish) / 1e3, **fields})
        self._events.clear()

    # ---- the active tracer ---------------------------------------------------------------------------------
    def __enter__(self):
        global _active
        self._previous, _active = _active, self
        return self

    def __exit__(self, *exc):
        global _active
        _active = self._previous

    # ---- results -----------------------------------------------------------------------------------------------
    def frame(self, rank=None):
        """This rank's intervals as a DataFrame (rank, lane, kind, name, start, end, duration; seconds)."""
        import pandas as pd

        self._resolve_gpu_events()
        rank = rank if rank is not None else (self.comm.rank if self.comm is not None else 0)
        df = pd.DataFrame(self.rows, columns=None if self.rows else ["lane", "kind", "name", "start", "end"])
        df.insert(0, "rank", rank)
        df["duration"] = df["end"] - df["start"]
        return df.sort_values(["start", "lane"], kind="stable").reset_index(drop=True)

    def gather(self, root: int = 0):
        """Every rank's intervals in one DataFrame on ``root`` (None on the other ranks). Collective."""
        import pandas as pd

        mine = self.frame()
        if self.comm is None:
            return mine
        frames = self.comm.allgather_object(mine)
        if self.comm.rank != root:
            return None
        return pd.concat(frames, ignore_index=True)


# ---- Chrome trace (chrome://tracing, https://ui.perfetto.dev) ----------------------------------------------------
def chrome_trace(df) -> dict:
    """The intervals as a Chrome trace: complete events ("ph": "X", microseconds), pid = rank, tid = lane
    (numbered; names given by "thread_name" metadata events)."""
    events, lanes = [], {}
    for rank in sorted(df["rank"].unique()):
        events.append({"name": "process_name", "ph": "M", "pid": int(rank), "tid": 0, "args": {"name": f"rank {rank}"}})
    for row in df.itertuples(index=False):
        key = (int(row.rank), str(row.lane))
        if key not in lanes:
            lanes[key] = sum(1 for k in lanes if k[0] == key[0])
            events.append({"name": "thread_name", "ph": "M", "pid": key[0], "tid": lanes[key],
                           "args": {"name": key[1]}})
        events.append({"name": str(row.name), "cat": str(row.kind), "ph": "X", "pid": key[0], "tid": lanes[key],
                       "ts": round(float(row.start) * 1e6, 3), "dur": round(float(row.end - row.start) * 1e6, 3),
                       "args": {"kind": str(row.kind)}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(df, path) -> str:
    """Write ``chrome_trace(df)`` as JSON to ``path``; open it in chrome://tracing or ui.perfetto.dev."""
    with open(path, "w") as f:
        json.dump(chrome_trace(df), f)
    return str(path)
