"""What a schedule cost, from its intervals (Timeline rows: rank, what, start, end, and per item
tokens/slots). Work rows are everything but "pull" rows (a dynamic queue's waits for its next item).

    makespan        when the last rank finished its last item (all started at 0): what the user waits for
    busy / idle     per rank: time inside work items / makespan minus that
    imbalance       max busy / mean busy over ranks: 1.0 is perfect; 2.0 means the busiest rank worked
                    twice the average, so about half the cluster's time was wasted
    tokens/s        real tokens (each request once, however many TP ranks ran it) / makespan
    padding waste   share of computed positions that were padding: 1 - real tokens / slots
    queue wait      per rank: time spent asking the dynamic queue for work (the price of dynamism)
"""

from __future__ import annotations

import numpy as np
import pandas as pd


def work_rows(intervals):
    if not len(intervals) or "what" not in intervals:
        return intervals
    return intervals[intervals["what"] != "pull"]


def per_rank(intervals, ranks, makespan=None) -> pd.DataFrame:
    """One row per rank 0..ranks-1 (ranks that ran nothing included): items, busy_s, idle_s, queue_wait_s."""
    work = work_rows(intervals)
    if makespan is None:
        makespan = float(work["end"].max()) if len(work) else 0.0
    out = pd.DataFrame({"rank": np.arange(ranks)})
    if len(work):
        out["items"] = out["rank"].map(work.groupby("rank").size()).fillna(0).astype(int)
        out["busy_s"] = out["rank"].map(work.groupby("rank")["duration"].sum()).fillna(0.0)
    else:
        out["items"], out["busy_s"] = 0, 0.0
    out["idle_s"] = makespan - out["busy_s"]
    pulls = intervals[intervals["what"] == "pull"] if len(intervals) and "what" in intervals else intervals.iloc[:0]
    out["queue_wait_s"] = out["rank"].map(pulls.groupby("rank")["duration"].sum()).fillna(0.0) if len(pulls) else 0.0
    return out


def summarize(result_or_intervals, ranks=None) -> dict:
    """Metrics of a RunResult (or of an interval table, with ``ranks``)."""
    df = getattr(result_or_intervals, "intervals", result_or_intervals)
    ranks = ranks if ranks is not None else getattr(result_or_intervals, "ranks", None)
    if ranks is None:
        raise ValueError("give the number of ranks (ranks that ran nothing leave no rows)")
    work = work_rows(df)
    if not len(work):
        return {"makespan_s": 0.0, "busy_mean_s": 0.0, "idle_mean_s": 0.0, "idle_fraction": 0.0,
                "imbalance": 1.0, "tokens": 0, "tokens_per_s": 0.0, "padding_waste": 0.0, "queue_wait_mean_s": 0.0}
    makespan = float(work["end"].max())
    table = per_rank(df, ranks, makespan)
    once = work.drop_duplicates("item") if "item" in work else work  # a TP group's ranks all record the item
    tokens = int(once["tokens"].sum()) if "tokens" in once else 0
    slots = int(once["slots"].sum()) if "slots" in once else tokens
    mean_busy = float(table["busy_s"].mean())
    return {
        "makespan_s": makespan,
        "busy_mean_s": mean_busy,
        "idle_mean_s": float(table["idle_s"].mean()),
        "idle_fraction": float(table["idle_s"].sum() / (makespan * ranks)) if makespan > 0 else 0.0,
        "imbalance": float(table["busy_s"].max() / mean_busy) if mean_busy > 0 else 1.0,
        "tokens": tokens,
        "tokens_per_s": tokens / makespan if makespan > 0 else 0.0,
        "padding_waste": 1 - tokens / slots if slots else 0.0,
        "queue_wait_mean_s": float(table["queue_wait_s"].mean()),
    }
