"""A per-rank interval recorder: when did this rank start and finish each piece of work?

Small on purpose (a general tracer is another issue's): a list of rows, one per interval, that becomes a
pandas DataFrame. Times are seconds since ``restart()`` on this rank, which the runners call right after
a barrier, so the ranks' clocks agree to within the barrier's skew (microseconds on one machine).

    timeline = Timeline(rank=comm.rank)
    timeline.restart()
    with timeline.span("forward", item=7, tokens=130):
        model(tokens)
    df = timeline.gather(comm)          # every rank's rows, on every rank: rank, what, start, end, ...
"""

from __future__ import annotations

import time
from contextlib import contextmanager


class Timeline:
    def __init__(self, rank: int = 0, **fields):
        self.rank = rank
        self.fields = fields  # added to every row (say, group=2)
        self.rows: list[dict] = []
        self.t0 = time.perf_counter()

    def restart(self) -> None:
        """Time zero is now; earlier rows are dropped."""
        self.rows.clear()
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    @contextmanager
    def span(self, what: str, **fields):
        """Record the time spent inside the block. It yields ``fields``, so the block can add to them."""
        start = self.now()
        try:
            yield fields
        finally:
            self.add(what, start, self.now(), **fields)

    def add(self, what: str, start: float, end: float, **fields) -> None:
        self.rows.append({"rank": self.rank, **self.fields, "what": what, "start": start, "end": end, **fields})

    def to_dataframe(self):
        import pandas as pd

        df = pd.DataFrame(self.rows)
        if len(df):
            df["duration"] = df["end"] - df["start"]
        return df

    def gather(self, comm):
        """Every rank's rows as one DataFrame, sorted by rank and start, on every rank (collective)."""
        import pandas as pd

        rows = [row for rank_rows in comm.allgather_object(self.rows) for row in rank_rows]
        df = pd.DataFrame(rows)
        if len(df):
            df["duration"] = df["end"] - df["start"]
            df = df.sort_values(["rank", "start"], kind="stable").reset_index(drop=True)
        return df
