"""Helpers for tests that run on every rank under mpiexec.

The rule that keeps MPI tests honest and hang-free: **decide pass/fail collectively**. A test computes
its local verdict, then ``agree()`` allgathers every rank's verdict and *every* rank raises if *any*
rank failed. All ranks then take the same path, which is also what lets hypothesis shrink a failing
example in lockstep on all ranks (it draws the same examples everywhere: ``derandomize=True``).

A rank that fails on its own (an exception before a collective) is caught by conftest.py instead:
it aborts the whole MPI job, and the watchdog there turns any hang into a failure within seconds.
"""

from __future__ import annotations

import faulthandler
import functools
import hashlib
import os
import sys
import traceback

from hypothesis import HealthCheck, settings
from mpi4py import MPI

COMM = MPI.COMM_WORLD
WATCHDOG_SECONDS = float(os.environ.get("TPLAB_TEST_WATCHDOG", "30"))

# Same examples on every rank, no wall-clock dependent behaviour that could differ between ranks.
settings.register_profile(
    "mpi",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=list(HealthCheck),
    max_examples=int(os.environ.get("TPLAB_HYPOTHESIS_EXAMPLES", "60")),
)
settings.load_profile("mpi")


def rearm_watchdog(seconds: float = WATCHDOG_SECONDS) -> None:
    """Restart the per-test deadlock timer (call it per hypothesis example in long tests)."""
    faulthandler.cancel_dump_traceback_later()
    faulthandler.dump_traceback_later(seconds, exit=True)


def agree(ok: bool, detail: str = "") -> None:
    """Raise AssertionError on every rank if the check failed on any rank."""
    everyone = COMM.allgather((bool(ok), detail))
    failed = [(rank, d) for rank, (passed, d) in enumerate(everyone) if not passed]
    if failed:
        raise AssertionError("; ".join(f"rank {rank}: {d}" for rank, d in failed))


def same_on_every_rank(value) -> bool:
    """True if ``value`` (bytes or anything with a stable repr) is identical on every rank."""
    data = value if isinstance(value, bytes) else repr(value).encode()
    digests = COMM.allgather(hashlib.sha256(data).hexdigest())
    return len(set(digests)) == 1


def abort_on_exception(test):
    """Decorator for hypothesis tests: an exception that is not a collective verdict (``agree``'s
    AssertionError) happened on this rank alone; the other ranks are stuck waiting for it, so shrinking
    cannot proceed in step. Print it with the example and abort the job at once."""

    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        try:
            return test(*args, **kwargs)
        except AssertionError:
            raise
        except BaseException:
            faulthandler.cancel_dump_traceback_later()
            sys.stderr.write(f"\n[rank {COMM.rank} of {COMM.size}] {test.__name__}{kwargs} raised:\n"
                             f"{traceback.format_exc()}[rank {COMM.rank}] aborting the MPI job\n")
            sys.stderr.flush()
            COMM.Abort(1)

    return wrapper
