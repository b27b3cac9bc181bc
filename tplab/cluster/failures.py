"""How ``Cluster.run`` explains what went wrong on the ranks.

After one rank fails the others get a short grace period: they may fail too, or be blocked for ever in a
collective that the failed rank will never join. Then one exception names the ranks: ``RankError`` (ranks
raised), ``EngineDied`` (engine processes died), ``ClusterTimeout`` (ranks did not finish).
"""

from __future__ import annotations

import re
import sys
import time

# After one rank fails, how long to wait for the others before reporting: they may fail too, or be
# blocked for ever in a collective that the failed rank will never join.
ERROR_GRACE_SECONDS = 2.0
RECOVER = ("cluster.restart(), or rerun the setup cell, kills and relaunches the engines (their variables are "
           "lost: re-run your setup)")
GONE_CHECK_SECONDS = 0.5  # how often a waiting call checks that the cluster's controller still runs


class ClusterError(RuntimeError):
    """Something went wrong with the cluster (base class of the errors below)."""


class RankError(ClusterError):
    """Ranks raised. ``failures``: {rank: RemoteError}; ``unfinished``: ranks that were still running."""

    def __init__(self, message, failures=None, unfinished=()):
        super().__init__(message)
        self.failures, self.unfinished = dict(failures or {}), list(unfinished)


class ClusterTimeout(ClusterError):
    """Ranks did not finish in time. ``finished`` / ``unfinished``: lists of ranks."""

    def __init__(self, message, finished=(), unfinished=()):
        super().__init__(message)
        self.finished, self.unfinished = list(finished), list(unfinished)


class ClusterGone(ClusterError):
    """The cluster's controller is gone: its owner stopped it, or it was killed. Only a new one helps."""


class EngineDied(ClusterError):
    """Engine processes died. ``ranks``: the dead ranks, the first to die first."""

    def __init__(self, message, ranks=()):
        super().__init__(message)
        self.ranks = list(ranks)


# ---- collecting results, and explaining failures ---------------------------------------------------------
def gather_results(pending, timeout, what, label="rank", lost=lambda: [], gone=lambda: None):
    """Wait for {rank: AsyncResult}; return the results in rank order, or raise a ClusterError naming the
    ranks that raised, died or did not finish. ``label`` is the word for a key ("engine" before ranks
    are known); ``lost()`` lists the ranks whose engines left the controller; ``gone()`` says why the
    whole cluster is gone (ClusterGone at once: no result can come), or None."""
    deadline, first_failure, next_gone_check = time.monotonic() + timeout, None, 0.0
    while not all(ar.ready() for ar in pending.values()):
        now = time.monotonic()
        if now >= next_gone_check:
            next_gone_check, why = now + GONE_CHECK_SECONDS, gone()
            if why:
                raise ClusterGone(f"{what}: {why}")
        # A dead engine comes back as an EngineError within moments (each engine has a watchdog
        # "nanny" that tells the controller); one that left without that report counts as dead too.
        if lost() or any(ar.ready() and not ar.successful() for ar in pending.values()):
            first_failure = first_failure or now
            if now - first_failure > ERROR_GRACE_SECONDS:
                break
        if now > deadline:
            break
        time.sleep(0.02)
    results, errors, unfinished = {}, {}, []
    for key, ar in sorted(pending.items()):
        if not ar.ready():
            unfinished.append(key)
            continue
        try:
            results[key] = ar.get(0)
        except Exception as e:  # noqa: BLE001 - a remote error: described below
            errors[key] = e
    died = sorted((k for k, e in errors.items() if getattr(e, "ename", None) == "EngineError"),
                  key=lambda k: _completed(pending[k]))  # the first reported is the first that died
    died += [k for k in sorted(lost()) if k in unfinished]
    if died and gone():  # the whole cluster was stopped (its engines first): say that, not which died
        raise ClusterGone(f"{what}: {gone()}")
    if died:
        raise EngineDied(
            f"{what}: the engine process of {label} {died[0]} died"
            + (f", then {name_ranks(died[1:], label)} (mpiexec ends every rank of an MPI job when one dies)"
               if len(died) > 1 else "")
            + ". Typical causes: a crash in native code, the out-of-memory killer, os._exit, a signal. "
            f"Recover: {RECOVER}.", ranks=died)
    if errors:
        by_text = {}  # ranks that failed the same way are reported together
        for key, error in errors.items():
            by_text.setdefault(describe_error(error), []).append(key)
        message = f"{what} raised on {name_ranks(list(errors), label)}:\n\n" + "\n\n".join(
            f"--- {name_ranks(keys, label)}: {text}" for text, keys in by_text.items())
        if unfinished:
            message += (
                f"\n\n{name_ranks(unfinished, label).capitalize()} had not finished {ERROR_GRACE_SECONDS:g} s "
                f"later: most likely blocked in a collective (barrier, allreduce, send/recv) waiting for "
                f"{name_ranks(list(errors), label)}, which will never join. A rank blocked inside MPI cannot be "
                f"interrupted: {RECOVER}.")
        raise RankError(message, errors, unfinished)
    if unfinished:
        finished = sorted(results)
        raise ClusterTimeout(
            f"{what} did not finish within {timeout:g} s: {name_ranks(unfinished, label)} did not finish"
            + (f", {name_ranks(finished, label)} did" if finished else "")
            + ".\nLikely cause: a rank blocked in a collective because another rank failed, died or never "
            "called it (a deadlock), or work that needs more time than the timeout."
            f"\nA rank blocked inside MPI cannot be interrupted: {RECOVER}.",
            finished, unfinished)
    return [results[k] for k in sorted(results)]


def _completed(ar) -> float:
    when = ar.metadata.get("completed")
    return when.timestamp() if when else float("inf")


def name_ranks(keys, label) -> str:
    return f"{label} {keys[0]}" if len(keys) == 1 else f"{label}s {', '.join(map(str, keys))}"


def describe_error(error, lines=12) -> str:
    """'ValueError: boom' and the last lines of the remote traceback, without the terminal colours."""
    head = f"{getattr(error, 'ename', type(error).__name__)}: {getattr(error, 'evalue', error)}"
    tb = re.sub(r"\x1b\[[0-9;]*m", "", getattr(error, "traceback", None) or "")
    # IPython separates the frames with blank lines: drop the frames of ipyparallel and of _on_engine
    frames = [f for f in tb.split("\n\n") if f.strip() and not _is_plumbing(f.strip().splitlines()[0])]
    # (a function defined in a notebook has no source file on the engine: IPython says so; skip that)
    tail = [line for line in "\n".join(frames).splitlines()
            if line.strip() and "Could not get source" not in line][-lines:]
    return head + "".join("\n    " + line for line in tail)


def _is_plumbing(first_line) -> bool:
    return (first_line.startswith("---") or "/ipyparallel/" in first_line
            or first_line.startswith("File <string>") or "in _on_engine(" in first_line)


def echo_output(pending):
    """Show what the ranks printed, each line tagged with its rank (ipyparallel captured it)."""
    for rank, ar in sorted(pending.items()):
        for stream in ("stdout", "stderr"):
            for line in (ar.metadata.get(stream) or "").splitlines():
                print(f"[rank {rank}] {line}", file=getattr(sys, stream))
