"""Notebook 08's exercises: count a block pattern's synchronisations, and run a run of parallel blocks on
real ranks with the one all-reduce it needs.

    print(format_report(check_sync_count(my_count)))              # fn(pattern) -> all-reduces per forward pass
    report = cluster.run(check_parallel_run, my_parallel_run)[0]  # fn(x, blocks, comm) -> y
    print(format_report(report))

The second runs on every rank: each rank applies its own blocks to its own copy of the residual stream
(x_r <- x_r + block(x_r), block after block), and the ranks add up their increments once at the end,
y = x + Σ_r (x_r - x), with one ring all-reduce: 2(p-1)/p of x's bytes per rank. Values against the same
computation done for every rank on one process (1e-12), bitwise identical on every rank.
"""

from __future__ import annotations

import numpy as np

from tplab.comm import world
from tplab.lab.exercises.allreduce import ring_allreduce_wire
from tplab.lab.exercises.runner import Case, run_cases, run_local

EXTRA_PATTERNS = {"one parallel block": ["parallel"], "tp, 2 parallel, tp": ["tp", "parallel", "parallel", "tp"],
                  "parallel, spd, parallel": ["parallel", "spd", "parallel"],
                  "12 layers, 6 comm (claimed)": ["spd", "parallel", "parallel"] * 4,
                  "12 layers, tp and spd": ["tp", "spd"] * 6}


def _slips(pattern):
    from tplab.fewer_syncs.model import syncs_per_forward

    runs = sum(1 for i, b in enumerate(pattern) if b == "parallel" and (i == 0 or pattern[i - 1] != "parallel"))
    n = {b: pattern.count(b) for b in ("tp", "spd", "parallel")}
    right = syncs_per_forward(pattern)
    return [(2 * n["tp"] + n["spd"] + n["parallel"], ("one all-reduce per parallel *block*: a run of parallel blocks "
                                                      "needs only one, at its end")),
            (2 * n["tp"] + 2 * n["spd"] + runs, "SPD drops the all-reduce after the attention: 1 per SPD block"),
            (right + runs, ("2 per run of parallel blocks counts the f that opens it, which all-reduces in the "
                           "backward pass only: 1 per run in the forward pass")),
            (2 * right, "forward and backward together: count the forward pass only"),
            (2 * len(pattern), "2 per block is plain TP: SPD and parallel blocks drop syncs")]


def _diagnose_count(result, case, _):
    (pattern,) = case.args
    try:
        got = int(result)
    except (TypeError, ValueError):
        return f"returned {result!r}, not a number of all-reduces"
    if got == case.expected:
        return None
    where = f"{','.join(pattern)}: {got}, expected {case.expected}"
    hint = next((h for wrong, h in _slips(pattern) if wrong == got and wrong != case.expected), "")
    return where + (f" -- {hint}" if hint else "")


def check_sync_count(fn, *, progress=True):
    """``fn(pattern)``: the all-reduces of activations one forward pass of a pattern of 'tp', 'spd' and
    'parallel' blocks needs: 2 per TP block, 1 per SPD block, 1 per run of consecutive parallel blocks."""
    from tplab.fewer_syncs.model import (  # (here: the package brings torch)
        PATTERNS,
        syncs_per_forward,
    )

    cases = [Case(name, (list(pattern),), syncs_per_forward(pattern)) for name, pattern in
             {**PATTERNS, **EXTRA_PATTERNS}.items()]
    return run_local(fn, cases, _diagnose_count, title="syncs: ", progress=progress)


# ---- a run of parallel blocks on real ranks ----------------------------------------------------------------------
SHAPES = [("3 tokens, 4 wide, 2 blocks", 3, 4, 2), ("1 token, 1 block", 1, 3, 1), ("5 tokens, 6 wide, 3 blocks", 5, 6, 3)]


def _block(h, rank, j, seed):
    weight = np.random.default_rng([seed, rank, j]).standard_normal((h, h)) * 0.5
    return lambda z: np.tanh(z @ weight)  # rank r's share of block j: its increment of the stream


def _stream(x, blocks):
    for block in blocks:
        x = x + block(x)
    return x


def _diagnose_run(got, case, p):
    y = got
    expected, slips, wire = case.expected
    sent_bytes, sent_messages = case.args[2]["sent"]
    if y is None:
        return "returned None (return y, the same on every rank)"
    y = np.asarray(y)
    if y.shape != expected.shape:
        return f"returned shape {y.shape}, expected {expected.shape}"
    if not np.allclose(y, expected, rtol=1e-12, atol=1e-12):
        hint = next((h for wrong, h in slips if np.allclose(y, wrong, rtol=1e-12, atol=1e-12)), None)
        return hint or f"wrong values (largest difference {float(np.abs(y - expected).max()):.3g})"
    if sent_bytes != wire["bytes"] or (wire["messages"] is not None and sent_messages != wire["messages"]):
        return (f"right values, but sent {sent_bytes} B in {sent_messages} messages where one ring all-reduce of x's "
                f"size sends {wire['bytes']} B" + (f" in {wire['messages']}" if wire["messages"] is not None else "") +
                ": a run synchronises once, at its end (tplab.allreduce(..., algorithm='ring'))")
    return None


def check_parallel_run(fn, comm=None, *, timeout: float = 5.0, progress=True, stop_at_first_failure=False):
    """``fn(x, blocks, comm)``: x (tokens, h) float64, the same on every rank; ``blocks`` this rank's blocks,
    functions z -> increment. Each rank runs its own stream x_r through them (z <- z + block(z)); return
    y = x + Σ_r (x_r - x), summed with one ring all-reduce. Call it on every rank."""
    base = comm or world()
    p, r = base.size, base.rank
    cases = []
    for i, (name, tokens, h, depth) in enumerate(SHAPES):
        x = np.random.default_rng([300 + i]).standard_normal((tokens, h))
        every = [[_block(h, q, j, 300 + i) for j in range(depth)] for q in range(p)]
        streams = [_stream(x, blocks) for blocks in every]
        expected = x + sum(s - x for s in streams)
        synced = x  # a sum after every block: the ranks share one stream (TP-like, another model)
        for j in range(depth):
            synced = synced + sum(every[q][j](synced) for q in range(p))
        slips = []
        if p > 1:
            slips = [(sum(streams), "x counted p times: add up the increments x_r - x, then add x once"),
                     (streams[r], "your result is your own stream x_r: nothing was summed over the ranks"),
                     (synced, ("you summed after every block: that is another model, with one all-reduce per block. "
                              "A parallel run keeps each rank's stream to itself until its end"))]
        cases.append(Case(name, (x, every[r], {}), (expected, slips, ring_allreduce_wire(x.size, 8, p, r)),
                          {"blocks": depth}))

    def run(x, blocks, box, c):  # the result alone (its bits are compared across ranks); the counts on the side
        y = fn(x, blocks, c)
        box["sent"] = (c.bytes_sent, c.messages_sent)
        return y

    return run_cases(run, cases, _diagnose_run, comm=base, timeout=timeout, bitwise=True,
                     title="parallel run: ", progress=progress, stop_at_first_failure=stop_at_first_failure)
