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


_watchdog_fd = None   # the terminal's stderr, saved by pytest before it captured fd 2 (watchdog_to_terminal)


def watchdog_to_terminal(config) -> None:
    """Send the watchdog's dump to the terminal's stderr, not into pytest's capture of it: a rank that the
    watchdog ends (os._exit) never prints what was captured, and the hang would leave no trace but an exit
    code. (pytest keeps the original descriptor in its fd capture; where it has none, sys.__stderr__.)"""
    global _watchdog_fd
    capture = config.pluginmanager.getplugin("capturemanager")
    err = getattr(getattr(capture, "_global_capturing", None), "err", None)
    saved = getattr(err, "targetfd_save", None)
    _watchdog_fd = saved if isinstance(saved, int) else None


def arm_watchdog(seconds: float = WATCHDOG_SECONDS) -> None:
    """Dump every thread's stack and exit if the test is still running in ``seconds``."""
    faulthandler.dump_traceback_later(seconds, exit=True,
                                      file=_watchdog_fd if _watchdog_fd is not None else sys.__stderr__)


def rearm_watchdog(seconds: float = WATCHDOG_SECONDS) -> None:
    """Restart the per-test deadlock timer (call it per hypothesis example in long tests)."""
    faulthandler.cancel_dump_traceback_later()
    arm_watchdog(seconds)


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
