"""Fitting α, β, γ on the machine at hand, and holding the model against real timings.

Two micro-benchmarks give the three numbers, and a third what tplab's Python adds. Each does what an
algorithm does, not what a textbook ping-pong does (the first version did that, and was ~30% optimistic
from 32 KiB up on a 16-core Xeon: hot buffers and barrier-aligned steps are faster than real ones):

    measure_exchange    p-1 ring steps back to back, each ``sendrecv``-ing a different block of a vector
                        to the right neighbour while receiving from the left; per-step t(n) = α + n·β
    measure_reduction   ``np.add(received, mine, out=fresh)`` on n bytes into fresh memory, as the
                        algorithms write their result; t(n) = c + n·γ (γ includes the first touch)
    measure_entry       a tplab allreduce on a communicator of one rank: no step at all, so what is left
                        is the cost of entering a collective (argument handling); its intercept is entry

``fit_machine`` fits the lines in *relative* terms: it minimises Σ log²((α + nβ)/t), about the error in
percent squared at each size, so the 8-byte points (a few µs) count as much as the 4-MiB ones (ms). A
plain least-squares fit would let the big sizes set both parameters and could leave α negative.

Measured through tplab's Python Communicator, α includes Python's per-message work (a few µs on top of
MPI's own latency): that is intended, it is what tplab's algorithms pay per step too. The reduction's
intercept c (the cost of calling into numpy, under a microsecond) is not part of the lecture model;
``fit_reduction`` reports it for who wants to see it, and ``fit_machine`` leaves it out.

What tplab's Python adds, and why the model has two optional terms for it (Machine.entry, Machine.step):
measured on a 2-core machine, tplab's ring allreduce of 8 bytes on 2 ranks took ~12 µs where two steps
of α ≈ 2.7 µs predict 5.4. About 4.5 µs are paid once per call before any message: the same call on one
rank (no step at all) takes them. ``measure_entry`` measures that, so ``fit_on`` fits it. The rest, 0-2 µs per step, is
the algorithm's own bookkeeping around each sendrecv (slicing blocks, calling numpy); it differs between
algorithms and no micro-benchmark isolates it, so ``fit_on`` leaves ``step`` at 0 and ``fit_step``
calibrates one number on the algorithms' own timings of tiny messages, if you want the model to match
them (a calibration: it makes the model fit small messages, it does not explain them).

    machine, exchange, reduction = fit_on(comm)                  # collective; same result on every rank
    rows = tplab.lab.bench.sweep("allreduce", ["ring", "rabenseifner"], sizes)
    pandas.DataFrame(compare(rows, machine))                     # + predicted_us, error
    calibrated = fit_step(rows, machine)                         # optional: + Python's work per step

On GPUs, pass a communicator that moves GPU memory (``tplab.comm.nccl_world()``): the vectors are CuPy
arrays, the reduction a CuPy kernel, and each timed stretch ends by waiting for the GPU (host clock), so
α, β, γ are those of NCCL point-to-point steps and GPU additions as tplab's algorithms take them.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np

from tplab.cost.formulas import Machine, critical_path
from tplab.cost.predict import predict

DEFAULT_SIZES = [8 << (2 * i) for i in range(10)]  # 8 B, 32 B, ..., 2 MiB: 4x apart, every regime


def _array_module_and_wait(gpu: bool):
    """(numpy or cupy, a function that waits until this rank's GPU work is done; None on the host, where
    the timed loops stay exactly as they were)."""
    if not gpu:
        return np, None
    import cupy

    return cupy, lambda: cupy.cuda.get_current_stream().synchronize()


def _median_seconds(run, iters, warmup, barrier=None, wait=None) -> float:
    """This rank's median seconds of ``run()`` over ``iters`` calls after ``warmup`` untimed ones; each call
    starts after ``barrier()`` and ends when ``wait()`` returns (the GPU's work done), where given. What
    ``run`` returns is freed after the clock stops (``measure_reduction``'s fresh result)."""
    times = []
    for i in range(warmup + iters):
        if barrier:
            barrier()
        t0 = time.perf_counter()
        result = run()
        if wait:
            wait()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        del result
    return float(np.median(times))


def measure_exchange(comm, sizes=DEFAULT_SIZES, iters=30, warmup=3) -> list[dict]:
    """One algorithm step, timed the way algorithms take them: back to back. Every rank holds a vector
    of p blocks of ``size`` bytes and runs p-1 ring steps in a row, each ``sendrecv``-ing a different
    block to its right neighbour while receiving from its left (a lone rank exchanges with itself: no
    wire, but all the per-message work). The time of the chain divided by its steps is one step.

    Why a chain and not one barrier-started exchange of one hot buffer: in a real allreduce the steps
    follow each other without a barrier (a late rank delays its neighbours, and that spreads), and each
    step sends a block that was not just sent (it comes from memory or a farther cache). A hot ping-pong
    misses both and, on a 16-core Xeon, made the model ~30% optimistic from 32 KiB up.

    Per size: each rank's median over ``iters`` chains, then the slowest rank's. Collective; the same
    rows on every rank."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    steps = max(p - 1, 1)
    xp, wait = _array_module_and_wait(comm.moves_gpu_memory)
    rows = []
    for size in sizes:
        vector, incoming = xp.ones(size * max(p, 2), dtype=np.uint8), xp.empty(size, dtype=np.uint8)

        def chain():
            for step in range(steps):
                k = (r - step - 1) % max(p, 2)
                comm.sendrecv(vector[k * size:(k + 1) * size], right, incoming, left)

        seconds = _median_seconds(chain, iters, warmup, comm.barrier, wait) / steps
        rows.append({"size": int(size), "time_s": max(comm.allgather_object(seconds))})
    return rows


def measure_reduction(sizes=DEFAULT_SIZES, iters=30, dtype="float32", warmup=3, gpu=False) -> list[dict]:
    """The reduction an algorithm does after each receive, the way it does it: out of place,
    ``np.add(received, mine, out=result)``, where ``result`` is fresh memory (the algorithms write
    their answer into a new array, so its pages are touched for the first time here: at megabytes
    the page faults cost about as much as the additions). ``size`` bytes per operand, whole elements
    of ``dtype`` (at least one); the median over ``iters``. Local, not collective. ``gpu``: CuPy arrays
    on the current GPU, timed until the kernel is done."""
    dt = np.dtype(dtype)
    xp, wait = _array_module_and_wait(gpu)
    rows = []
    for size in sizes:
        count = max(int(size) // dt.itemsize, 1)
        a, b = xp.ones(count, dtype=dt), xp.ones(count, dtype=dt)
        seconds = _median_seconds(lambda: xp.add(a, b, out=xp.empty(count, dtype=dt)), iters, warmup, wait=wait)
        rows.append({"size": count * dt.itemsize, "time_s": seconds})
    return rows


def measure_entry(comm, sizes=DEFAULT_SIZES, iters=30, dtype="float32", warmup=3) -> list[dict]:
    """What a collective costs before its first message: every rank runs tplab's ring allreduce on a
    communicator of its own (one rank: no step), all at once; per size the slowest rank's median.
    Collective (it splits ``comm``); the same rows on every rank."""
    from tplab.collectives import allreduce

    alone = comm.split(color=comm.rank)
    dt = np.dtype(dtype)
    xp, wait = _array_module_and_wait(comm.moves_gpu_memory)
    rows = []
    for size in sizes:
        x = xp.ones(max(int(size) // dt.itemsize, 1), dtype=dt)

        def call():
            allreduce(x, alone, algorithm="ring", check=False)  # (its result is freed inside the clock, as a caller's)

        seconds = _median_seconds(call, iters, warmup, comm.barrier, wait)
        rows.append({"size": x.nbytes, "time_s": max(comm.allgather_object(seconds))})
    alone.free()
    return rows


# ---- least squares, in relative terms --------------------------------------------------------------------
def fit_line(rows, iterations=100) -> tuple[float, float]:
    """(intercept, slope) > 0 of t = intercept + size·slope, minimising Σ log²(predicted / measured):
    for small misses that is the relative error squared, so every size counts alike.

    Fitting the logarithms of intercept and slope (a = log intercept, b = log slope) keeps both
    positive whatever the noise (a plain fit of noisy timings happily returns a negative latency).
    The model is no longer linear in (a, b), so Levenberg-Marquardt takes small Gauss-Newton steps:
    linearise the residuals, solve the damped normal equations, keep the step if it helped."""
    n = np.array([r["size"] for r in rows], dtype=float)
    t = np.array([r["time_s"] for r in rows], dtype=float)
    n, t = n[t > 0], t[t > 0]
    if len(t) == 0:
        raise ValueError("no positive times to fit")

    def residuals(a, b):
        return np.log(np.exp(a) + n * np.exp(b)) - np.log(t)

    # start: half the fastest time is latency, the largest size's time is all bandwidth
    a, b = math.log(t.min() / 2), math.log(t[np.argmax(n)] / max(n.max(), 1.0))
    cost, damping = float(np.sum(residuals(a, b) ** 2)), 1e-3
    for _ in range(iterations):
        f = np.exp(a) + n * np.exp(b)
        J = np.column_stack([np.exp(a) / f, n * np.exp(b) / f])  # d residual / d(a, b)
        r = residuals(a, b)
        step = np.linalg.solve(J.T @ J + damping * np.eye(2), -J.T @ r)
        a_new, b_new = np.clip([a + step[0], b + step[1]], -80.0, 5.0)  # e^-80 s: zero, but positive
        new_cost = float(np.sum(residuals(a_new, b_new) ** 2))
        if new_cost < cost:
            converged = cost - new_cost < 1e-15 * max(cost, 1e-30)
            a, b, cost, damping = a_new, b_new, new_cost, damping / 3
            if converged:
                break
        else:
            damping *= 10
            if damping > 1e12:
                break
    return float(math.exp(a)), float(math.exp(b))


def fit_reduction(reduction_rows) -> tuple[float, float]:
    """(gamma, intercept): seconds per byte reduced, and the fixed cost of one call into numpy."""
    intercept, gamma = fit_line(reduction_rows)
    return gamma, intercept


def misfit(rows, alpha, beta) -> float:
    """Σ log²(predicted / measured) of the line α + n·β over the rows."""
    return float(sum(math.log((alpha + r["size"] * beta) / r["time_s"]) ** 2 for r in rows if r["time_s"] > 0))


def fit_two_lines(rows, min_points=3, better_by=2.0):
    """Where the exchange times bend (an MPI library switching from eager sends to a rendezvous), two
    lines fit far better than one: try every split with at least ``min_points`` sizes on each side and
    keep the best, if it beats one line by the factor ``better_by`` in misfit. Returns (switch_bytes,
    (α, β) below, (α, β) above), or None."""
    rows = sorted(rows, key=lambda r: r["size"])
    one = misfit(rows, *fit_line(rows))
    best = None
    for k in range(min_points, len(rows) - min_points + 1):
        below, above = fit_line(rows[:k]), fit_line(rows[k:])
        total = misfit(rows[:k], *below) + misfit(rows[k:], *above)
        if best is None or total < best[0]:
            best = (total, math.sqrt(rows[k - 1]["size"] * rows[k]["size"]), below, above)
    if best is None or best[0] * better_by > one:
        return None
    return best[1], best[2], best[3]


def fit_machine(exchange_rows, reduction_rows, name: str = "", entry_rows=None, protocols=True) -> Machine:
    """The Machine whose α + n·β best matches the exchange times and n·γ the reduction times; with
    ``entry_rows`` (measure_entry) also the entry cost (its intercept), else it stays 0 (the lecture model).
    ``protocols``: fit two lines where the exchange times bend (fit_two_lines), else one."""
    alpha, beta = fit_line(exchange_rows)
    extra = {}
    two = fit_two_lines(exchange_rows) if protocols else None
    if two is not None:
        switch, (alpha, beta), (alpha_large, beta_large) = two
        extra = {"switch_bytes": switch, "alpha_large": alpha_large, "beta_large": beta_large}
    gamma, _ = fit_reduction(reduction_rows)
    # Only the intercept of the entry line: its slope is the one-rank call's copy of the input, which
    # the algorithms on p > 1 ranks do not make (they read the input in place and write a fresh
    # result, whose first touch measure_reduction already charges to γ).
    entry = fit_line(entry_rows)[0] if entry_rows else 0.0
    return Machine(alpha=alpha, beta=beta, gamma=gamma, name=name, entry=entry,
                   **extra)


def fit_on(comm, sizes=None, iters=30, dtype="float32", name: str = "", entry=True, protocols=True):
    """Measure and fit on the ranks of ``comm`` (collective). Returns (Machine, exchange rows,
    reduction rows), identical on every rank: the reduction is timed on every rank at once (as in an
    algorithm, where all ranks reduce together) and the slowest rank's time kept. ``entry=False`` skips
    measure_entry and leaves the Machine's entry cost at 0: the pure alpha-beta-gamma model."""
    sizes = DEFAULT_SIZES if sizes is None else list(sizes)
    exchange = measure_exchange(comm, sizes, iters=iters)
    comm.barrier()
    mine = measure_reduction(sizes, iters=iters, dtype=dtype, gpu=comm.moves_gpu_memory)
    everyone = comm.allgather_object([r["time_s"] for r in mine])
    reduction = [{"size": r["size"], "time_s": max(ts)} for r, ts in zip(mine, zip(*everyone))]
    entry_rows = measure_entry(comm, sizes, iters=iters, dtype=dtype) if entry else None
    machine = fit_machine(exchange, reduction, name=name or f"fitted on {comm.size} ranks", entry_rows=entry_rows,
                          protocols=protocols)
    return machine, exchange, reduction


def fit_step(rows, machine: Machine, max_size: int = 1024) -> Machine:
    """``machine`` with ``step`` set to the Python work per step that timing rows (tplab.lab.bench) of messages
    up to ``max_size`` bytes leave unexplained: the median over those rows of
    (measured - predicted) / steps on the critical path, all algorithms pooled; at least 0."""
    residuals = []
    for row in rows.to_dict("records") if hasattr(rows, "to_dict") else rows:
        if int(row["size"]) > max_size:
            continue
        try:
            itemsize = np.dtype(row["type"]).itemsize if row.get("type") else 1
            args = (row["collective"], _resolve(row), int(row["ranks"]), float(row["size"]))
            steps = critical_path(*args, itemsize=itemsize).messages
            predicted = predict(*args, replace(machine, step=0.0), itemsize=itemsize)
        except ValueError:  # no formula (builtin)
            continue
        if steps:
            residuals.append((float(row["time_us"]) * 1e-6 - predicted) / steps)
    if not residuals:
        raise ValueError(f"no rows of at most {max_size} bytes with a cost formula to calibrate on")
    return replace(machine, step=max(float(np.median(residuals)), 0.0))


# ---- the model against the stopwatch ----------------------------------------------------------------------
def _resolve(row) -> str:
    """The algorithm a row ran: "auto" is looked up the way tplab chose it (if it can be)."""
    algorithm = row["algorithm"]
    if algorithm == "auto":
        try:
            from tplab.collectives import auto

            count = int(row.get("count", 0)) or int(row["size"])
            algorithm = auto.choose(row["collective"], int(row["size"]), count, int(row["ranks"]))
        except Exception:  # noqa: BLE001 - no model for it then, not an error
            return "auto"
    return algorithm


def compare(rows, machine):
    """Timing rows (tplab.lab.bench: collective, algorithm, ranks, size, time_us; type if known) with two
    more columns: ``predicted_us`` and ``error`` = (predicted - measured) / measured. Rows the model has
    no formula for (builtin, say) get NaN. A pandas DataFrame in gives a DataFrame out."""
    frame = None
    if hasattr(rows, "to_dict") and hasattr(rows, "columns"):  # a DataFrame, without importing pandas
        frame, rows = rows, rows.to_dict("records")
    out = []
    for row in rows:
        itemsize = np.dtype(row["type"]).itemsize if row.get("type") else 1
        try:
            t = predict(row["collective"], _resolve(row), int(row["ranks"]), float(row["size"]), machine,
                        itemsize=itemsize)
        except ValueError:
            t = math.nan
        measured = float(row["time_us"]) * 1e-6
        error = (t - measured) / measured if measured > 0 else math.nan
        out.append({**row, "predicted_us": t * 1e6, "error": error})
    if frame is not None:
        import pandas as pd

        return pd.DataFrame(out, columns=list(frame.columns) + ["predicted_us", "error"])
    return out


# ---- fitting on the collectives' own timings -------------------------------------------------------------
def fit_on_timings(rows, name: str = "", algorithms=None) -> Machine:
    """α, β, γ and the entry cost fitted to measured collective times (tplab.lab.bench rows) instead of to
    micro-benchmarks: each row's predicted time, entry + n·entry_per_byte + messages·α + wire bytes·β
    + reduced bytes·γ, is linear in the five parameters, so relative least squares is a linear solve
    (rows weighted by 1/measured time). Parameters that come out negative are dropped (set to 0) and the
    rest refitted. This calibrates the model on what the algorithms really do on this machine (caches,
    protocols, Python), so it predicts well where the micro-benchmarks do not; it explains less."""
    features, times = [], []
    for row in rows.to_dict("records") if hasattr(rows, "to_dict") else rows:
        algorithm = _resolve(row)
        if algorithms is not None and algorithm not in algorithms:
            continue
        itemsize = np.dtype(row["type"]).itemsize if row.get("type") else 1
        n = float(row["size"])
        try:
            path = critical_path(row["collective"], algorithm, int(row["ranks"]), n, itemsize=itemsize)
        except ValueError:  # builtin, or a formula the one-level model lacks
            continue
        features.append([1.0, n, path.messages, path.wire_bytes, path.reduced_bytes])
        times.append(float(row["time_us"]) * 1e-6)
    if len(times) < 5:
        raise ValueError("need at least five timed rows with a cost formula to fit five parameters")
    X, t = np.array(features), np.array(times)
    A, b = X / t[:, None], np.ones_like(t)  # relative error: (X·θ - t) / t
    active = list(range(X.shape[1]))
    theta = np.zeros(X.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(A[:, active], b, rcond=None)
        if (solution >= 0).all():
            theta[active] = solution
            break
        active.pop(int(np.argmin(solution)))  # the most negative parameter leaves; refit the rest
    entry, entry_per_byte, alpha, beta, gamma = (float(v) for v in theta)
    return Machine(alpha=alpha, beta=beta, gamma=gamma, entry=entry, entry_per_byte=entry_per_byte,
                   name=name or "fitted on collective timings")
