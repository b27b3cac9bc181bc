"""Notebook 06's exercises: a chunked tensor-parallel MLP whose all-reduces overlap the next chunk's compute,
and the two-stage pipeline model of how long it takes.

    report = cluster.run(check_overlapped_mlp, my_mlp)[0]   # fn(x, w1, b1, w2, b2, chunks, comm) -> Y
    print(format_report(check_pipeline_time(my_time)))      # fn(compute, a, b, k) -> seconds

The MLP runs on every rank: Y = gelu(X W1ᵀ + b1) W2ᵀ + b2 in float64, W1 split by rows (rank r: block r of
the hidden features, with its slice of b1) and W2 by columns, b2 whole. The checker holds Y against the
unsplit MLP (1e-12), counts the nonblocking all-reduces started (``tplab.overlap.iallreduce``: one per chunk),
looks at their order (chunk i's all-reduce must still be in flight when chunk i+1's is started: that is the
overlap), and counts the bytes against k ring all-reduces of the chunks' partial sums.
"""

from __future__ import annotations

import math

from tplab.comm import world
from tplab.lab.exercises.allreduce import ring_allreduce_wire
from tplab.lab.exercises.runner import Case, run_cases, run_local

# (name, tokens, hidden, hidden features of the MLP per rank, chunks)
SHAPES = [("8 tokens, 4 chunks", 8, 4, 3, 4), ("6 tokens, 2 chunks", 6, 3, 2, 2), ("4 tokens, 1 chunk", 4, 5, 2, 1),
          ("9 tokens, 3 chunks", 9, 2, 4, 3)]


def _recording_engine(comm, events):
    """The progress engine tplab.overlap would make for ``comm``, noting when each handle is started and
    first waited for (a list of ("start" | "wait", index)), installed so that iallreduce(x, comm) uses it."""
    from tplab.overlap import progress_thread
    from tplab.overlap.handles import Handle

    class Recorded(Handle):
        def __init__(self, what, index):
            super().__init__(what)
            self.index, self.waited = index, False

        def wait(self, timeout=None):
            if not self.waited:
                self.waited = True
                events.append(("wait", self.index))
            return super().wait(timeout)

    class Recording(progress_thread.ProgressEngine):
        def submit(self, what, work):
            if not self.thread.is_alive():
                raise RuntimeError("this progress engine was shut down")
            handle = Recorded(what, self.started)
            events.append(("start", self.started))
            self.started += 1
            self._queue.put((handle, work, None))
            return handle

    engine = Recording(comm, yield_cpu=False)
    with progress_thread._lock:
        progress_thread._engines[comm] = engine
    return engine


def _not_overlapped(events) -> int | None:
    """The first chunk i whose all-reduce was waited for before chunk i+1's was started, or None."""
    order = {event: n for n, event in enumerate(events)}
    started = [i for kind, i in events if kind == "start"]
    for i in started[:-1]:
        if order.get(("wait", i), math.inf) < order[("start", i + 1)]:
            return i
    return None


def _diagnose_mlp(got, case, p):
    import torch

    y, events, sent_bytes, sent_messages = got
    expected, partial, bias, chunks, wire = case.expected
    close = lambda a, b: tuple(a.shape) == tuple(b.shape) and bool(torch.allclose(a, b, rtol=1e-12, atol=1e-12))
    if y is None:
        return "returned None (return Y, all tokens, the same on every rank)"
    if tuple(y.shape) != tuple(expected.shape):
        return f"returned shape {tuple(y.shape)}, expected {tuple(expected.shape)} (tokens, hidden)"
    if not close(y, expected):
        if p > 1 and close(y, partial + bias):
            return ("your result is this rank's partial product: nothing was reduced. All-reduce each chunk's "
                    "partial sums, then add b2")
        if p > 1 and close(y, expected + (p - 1) * bias):
            return "b2 was added p times: add it once, after the all-reduce, not to every rank's partial sums"
        return f"wrong values (largest difference {float((y - expected).abs().max()):.3g})"
    starts = sum(kind == "start" for kind, _ in events)
    if starts == 0:
        return ("right values, but no nonblocking all-reduce was started: a blocking all-reduce leaves nothing to "
                "overlap. Start each chunk's with tplab.overlap.iallreduce and wait for it later")
    if starts != chunks:
        return f"right values, but {starts} nonblocking all-reduce(s) for {chunks} chunks: one per chunk"
    late = _not_overlapped(events)
    if late is not None:
        return (f"right values, but chunk {late}'s all-reduce was waited for before chunk {late + 1}'s was started: "
                "nothing overlapped. Start chunk i's all-reduce, compute chunk i+1, and only then wait for chunk i")
    if sent_bytes != wire["bytes"] or (wire["messages"] is not None and sent_messages != wire["messages"]):
        return (f"right values and order, but sent {sent_bytes} B in {sent_messages} messages where {chunks} ring "
                f"all-reduces of the chunks send {wire['bytes']} B" +
                (f" in {wire['messages']}" if wire["messages"] is not None else "") +
                ": algorithm='ring', chunks cut as tplab.overlap.pipeline.chunk_bounds, all-reduce the (rows, hidden) "
                "partial sums only")
    return None


def _mlp_tensors(tokens, hidden, ffn, seed):
    import torch

    g = torch.Generator().manual_seed(seed)  # the same on every rank
    return [torch.randn(*shape, generator=g, dtype=torch.float64)
            for shape in [(tokens, hidden), (ffn, hidden), (ffn,), (hidden, ffn), (hidden,)]]


def check_overlapped_mlp(fn, comm=None, *, timeout: float = 5.0, progress=True, stop_at_first_failure=False):
    """``fn(x, w1, b1, w2, b2, chunks, comm)``: x (tokens, h) the same on every rank; w1 (f/p, h) and b1 (f/p,)
    this rank's rows of the first layer, w2 (h, f/p) the matching columns of the second, b2 (h,) whole.
    Must return Y (tokens, h) on every rank, the tokens cut into ``chunks`` (``chunk_bounds``), each chunk's
    partial sums all-reduced with ``tplab.overlap.iallreduce(..., algorithm="ring")`` while the next chunk
    computes. Call it on every rank."""
    import torch

    from tplab.overlap.pipeline import chunk_bounds

    base = comm or world()
    p, r = base.size, base.rank
    gelu = torch.nn.functional.gelu
    cases = []
    for i, (name, tokens, hidden, ffn, chunks) in enumerate(SHAPES):
        x, w1, b1, w2, b2 = _mlp_tensors(tokens, hidden, ffn * p, seed=200 + i)
        mine = slice(r * ffn, (r + 1) * ffn)
        expected = gelu(x @ w1.T + b1) @ w2.T + b2
        partial = gelu(x @ w1[mine].T + b1[mine]) @ w2[:, mine].T
        counts = [(end - start) * hidden for start, end in chunk_bounds(tokens, chunks)]
        wires = [ring_allreduce_wire(n, 8, p, r) for n in counts]
        wire = {"bytes": sum(w["bytes"] for w in wires),
                "messages": None if any(w["messages"] is None for w in wires) else sum(w["messages"] for w in wires)}
        cases.append(Case(name, (x, w1[mine].clone(), b1[mine].clone(), w2[:, mine].clone(), b2, chunks),
                          (expected, partial, b2, chunks, wire), {"chunks": chunks}))

    def run(x, w1, b1, w2, b2, chunks, c):
        events = []
        engine = _recording_engine(c, events)
        try:
            y = fn(x, w1, b1, w2, b2, chunks, c)
        finally:
            engine.close(timeout + 1)  # after its queued collectives (a broken one gives up at its deadline)
        return y, events, c.bytes_sent, c.messages_sent

    return run_cases(run, cases, _diagnose_mlp, comm=base, timeout=timeout, title="overlapped MLP: ",
                     progress=progress, stop_at_first_failure=stop_at_first_failure)


# ---- the pipeline model -----------------------------------------------------------------------------------------
def pipeline_time(compute, a, b, k):
    """The reference: T(k) = c + (k-1)·max(c, m) + m with c = compute/k and m = a + b/k."""
    c, m = compute / k, a + b / k
    return c + (k - 1) * max(c, m) + m


def _pipeline_slips(compute, a, b, k):
    c, m = compute / k, a + b / k
    return [(compute + k * a + b, ("that is compute + communication added up: the time without overlap. Chunk i's "
                                  "all-reduce runs while chunk i+1 computes")),
            (c + (k - 1) * max(c, (a + b) / k) + (a + b) / k,
             "every chunk's all-reduce pays the fixed part a (latency) whole: m = a + b/k, not (a + b)/k"),
            (max(compute, k * m), ("perfect overlap assumed: the first chunk's compute and the last chunk's "
                                  "communication are never hidden (c + (k-1)·max(c, m) + m)")),
            (k * max(c, m), "k·max(c, m) forgets the pipeline's fill and drain: c + (k-1)·max(c, m) + m"),
            (c + k * max(c, m) + m, ("(k-1) steps in the middle, not k: the first chunk's compute and the last "
                                    "chunk's all-reduce are the ends"))]


def _diagnose_pipeline(result, case, _):
    compute, a, b, k = case.args
    try:
        value = float(result)
    except (TypeError, ValueError):
        return f"returned {result!r}, not a time"
    expected = case.expected
    if math.isclose(value, expected, rel_tol=1e-9, abs_tol=1e-12):
        return None
    where = f"compute {compute:g}, a {a:g}, b {b:g}, k = {k}: {value:.4g}, expected {expected:.4g}"
    for wrong, hint in _pipeline_slips(compute, a, b, k):
        if math.isclose(value, wrong, rel_tol=1e-9, abs_tol=1e-12):
            return f"{where} -- {hint}"
    return where


def check_pipeline_time(fn, *, progress=True):
    """``fn(compute, a, b, k)``: the time of a layer whose compute (all of it, unchunked) is cut into k chunks,
    each chunk's all-reduce taking a + b/k, with chunk i's all-reduce overlapping chunk i+1's compute."""
    cases = [Case(f"compute {compute:g}, a {a:g}, b {b:g}, k = {k}", (compute, a, b, k), pipeline_time(compute, a, b, k))
             for compute, a, b in [(10.0, 0.1, 4.0), (2.0, 0.05, 8.0), (6.0, 0.0, 6.0), (1.0, 0.5, 0.5)]
             for k in (1, 2, 4, 8)]
    return run_local(fn, cases, _diagnose_pipeline, title="pipeline model: ", progress=progress)
