"""The exercise runner: a reader's function on every rank, case by case, and a report that says what is wrong.

For each case every rank calls ``fn(*case.args, comm)`` on an ``ExerciseComm``: a fresh duplicate of the
communicator (stray messages of a broken case stay there) whose blocking calls
- give up after ``timeout`` seconds: a deadlock becomes "send to rank 3 did not complete within 5 s",
- stop at once when another rank has failed: every rank tells every other rank, on a side channel, that it
  finished or that it failed, and a rank waiting for a message watches that channel while it waits.
Then every rank learns every rank's verdict (so all ranks return the same report): the value against the
reference, the bytes and messages it sent against the formula (``case.wire``), an exception with the
line of the reader's code it came from. Only the ExerciseComm's own methods are protected: raw mpi4py calls
in the reader's code are not.

``run_local`` does the same for functions without communication (a formula, a table): one process, no ranks.
"""

from __future__ import annotations

import copy
import hashlib
import linecache
import os
import pickle
import sysconfig
import textwrap
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from tplab.comm import CommTimeoutError, world
from tplab.comm.base import Communicator

FINISHED, FAILED = 0, 1
_ALARM_TAG_BASE = 20000   # tags of the side channel (a communicator of its own: they cannot mix with the reader's)
_OBJECT_TAG = 32000       # allgather_object on an ExerciseComm


class PeerFailed(RuntimeError):
    """Another rank failed while this one waited for a message: stop the case here."""

    def __init__(self, peer: int):
        self.peer = peer
        super().__init__(f"stopped waiting: rank {peer} failed")


@dataclass
class Case:
    """One case of an exercise, as seen by this rank."""

    name: str
    args: tuple                   # this rank's arguments (the communicator is appended)
    expected: object = None       # this rank's right answer
    columns: dict = field(default_factory=dict)  # shown in the report (count, dtype, ...)
    wire: dict | None = None      # {"bytes": b, "messages": m or None} this rank must send; None: not checked


# ---- where in the reader's code ------------------------------------------------------------------------------
_HERE = os.path.dirname(os.path.abspath(__file__))
_TPLAB = os.path.dirname(os.path.dirname(_HERE))
_LIBRARIES = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def _is_readers(filename: str) -> bool:
    path = os.path.abspath(filename)
    if filename.startswith("<frozen") or path.startswith(_LIBRARIES):
        return False
    return not path.startswith(_TPLAB + os.sep) or path.startswith(os.path.join(_HERE, "solutions"))


def where(tb) -> str:
    """'in my_ring, line 7 of the function (3141.py:12): comm.send(x, right)' for the innermost frame of a
    traceback that is the reader's code (not tplab's, numpy's, the standard library's)."""
    frames = list(traceback.walk_tb(tb))
    if not frames:
        return ""
    frame, lineno = ([f for f in frames if _is_readers(f[0].f_code.co_filename)] or frames)[-1]
    code = frame.f_code
    source = linecache.getline(code.co_filename, lineno).strip()
    text = (f"in {code.co_name}, line {lineno - code.co_firstlineno + 1} of the function "
            f"({os.path.basename(code.co_filename)}:{lineno})")
    return text + (f": {source}" if source else "")


def describe_exception(e: BaseException) -> str:
    if isinstance(e, CommTimeoutError):
        head = f"deadlock or missing message: {e}"
    elif isinstance(e, NotImplementedError):
        head = f"not written yet (NotImplementedError{': ' + str(e) if str(e) else ''})"
    else:
        head = f"raised {type(e).__name__}: {e}"
    return f"{head}, {where(e.__traceback__)}"


# ---- the side channel: every rank tells every other whether it finished or failed -------------------------------
class _Alarm:
    def __init__(self, channel: Communicator, tag: int):
        self.channel, self.tag = channel, tag
        self.inbox = np.full(channel.size, -1, dtype=np.int64)
        peers = [q for q in range(channel.size) if q != channel.rank]
        self.pending = {q: channel._irecv(self.inbox[q:q + 1], q, tag) for q in peers}
        self.failed: list[int] = []
        self.outbox = self.sent = None

    def poll(self) -> None:
        """Raise PeerFailed if a peer said it failed."""
        for q, handle in list(self.pending.items()):
            if self.channel._test(handle):
                del self.pending[q]
                if self.inbox[q] != FINISHED:
                    self.failed.append(q)
        if self.failed:
            raise PeerFailed(self.failed[0])

    def announce(self, status: int) -> None:
        if self.sent is None:
            self.outbox = np.full(self.channel.size, status, dtype=np.int64)
            self.sent = [self.channel._isend(self.outbox[q:q + 1], q, self.tag)
                         for q in range(self.channel.size) if q != self.channel.rank]

    def close(self) -> None:
        for handle in list(self.pending.values()) + (self.sent or []):
            self.channel._wait(handle, "the checker's side channel")


class _NoAlarm:
    def poll(self) -> None:
        pass


# ---- the communicator the reader's function gets -----------------------------------------------------------------
# Operations a failed case left behind, kept with their buffers: a late message may still land in one, and
# must not land in freed memory. (They are not cancelled: with MPICH, cancelling a send that had begun its
# rendezvous crashed a later case. Their duplicate communicator is never used again, so nothing matches them.)
_ABANDONED: list = []


class ExerciseComm(Communicator):
    """Point-to-point with a deadline on every blocking call, that stops when another rank failed."""

    poll_pause = 1e-3

    def __init__(self, inner: Communicator, alarm: _Alarm, timeout: float):
        super().__init__()
        self.inner, self.alarm, self.timeout = inner, alarm, timeout
        self.rank, self.size = inner.rank, inner.size
        self.operations: list = []  # (handle, buffer) of everything posted
        self.twins: list = []       # duplicates made for progress threads (with_timeout)

    def _isend(self, buf, dest, tag):
        handle = self.inner._isend(buf, dest, tag)
        self.operations.append((handle, buf))
        return handle

    def _irecv(self, buf, source, tag):
        handle = self.inner._irecv(buf, source, tag)
        self.operations.append((handle, buf))
        return handle

    def _test(self, handle) -> bool:
        return self.inner._test(handle)

    def _send(self, buf, dest, tag):
        self._wait(self._isend(buf, dest, tag), f"send to rank {dest} ({buf.nbytes} B, tag {tag})")

    def _recv(self, buf, source, tag):
        self._wait(self._irecv(buf, source, tag), f"recv from rank {source} ({buf.nbytes} B, tag {tag})")

    def _wait(self, handle, what):
        deadline, pause = time.monotonic() + self.timeout, 0.0
        while not self.inner._test(handle):
            self.alarm.poll()
            if time.monotonic() > deadline:
                raise CommTimeoutError(f"{what} did not complete within {self.timeout:g} s "
                                       "(no rank posted the matching operation)")
            time.sleep(pause)
            pause = min(2 * pause + 1e-6, self.poll_pause)

    def allgather_object(self, obj) -> list:
        """Pickled objects, exchanged point to point with deadlines (uncounted: metadata, not data)."""
        mine = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        peers = [q for q in range(self.size) if q != self.rank]
        sizes = np.zeros(self.size, dtype=np.int64)
        sizes[self.rank] = mine.size
        self._exchange([(sizes[self.rank:self.rank + 1], q) for q in peers],
                       [(sizes[q:q + 1], q) for q in peers], _OBJECT_TAG)
        bufs = {q: np.empty(int(sizes[q]), dtype=np.uint8) for q in peers}
        self._exchange([(mine, q) for q in peers], [(bufs[q], q) for q in peers], _OBJECT_TAG + 1)
        return [obj if q == self.rank else pickle.loads(bufs[q].tobytes()) for q in range(self.size)]

    def _exchange(self, sends, recvs, tag):
        handles = [(self._irecv(b, q, tag), f"recv from rank {q}") for b, q in recvs]
        handles += [(self._isend(b, q, tag), f"send to rank {q}") for b, q in sends]
        for handle, what in handles:
            self._wait(handle, what + " (an argument check of a collective)")

    def barrier(self) -> None:
        self.allgather_object(None)

    def with_timeout(self, timeout, poll_pause=None) -> ExerciseComm:
        """A duplicate for a progress thread (tplab.overlap's nonblocking collectives, notebook 06): its own
        message space and the same deadline, but no side channel (two threads must not poll one request);
        a peer that failed shows there as a deadline passed. Collective."""
        twin = ExerciseComm(self.inner.with_timeout(self.timeout, poll_pause), _NoAlarm(), self.timeout)
        self.twins.append(twin)
        return twin

    def free(self) -> None:
        for twin in self.twins:
            twin.inner.free()

    def __repr__(self) -> str:
        return f"<ExerciseComm rank {self.rank} of {self.size}, deadline {self.timeout:g} s per call>"


# ---- running the cases ---------------------------------------------------------------------------------------------
def _copy(args):
    return [copy.deepcopy(a) if hasattr(a, "shape") else None for a in args]


def _unchanged(args, before) -> bool:
    return all(b is None or bool(np.array_equal(np.asarray(a), np.asarray(b))) for a, b in zip(args, before))


def _digest(result) -> str:
    try:
        return hashlib.sha256(np.ascontiguousarray(np.asarray(result)).tobytes()).hexdigest()
    except Exception:  # noqa: BLE001 - not an array: compare its repr
        return hashlib.sha256(repr(result).encode()).hexdigest()


def wire_problem(sent_bytes, sent_messages, wire, p) -> str | None:
    """What is wrong with what this rank sent, next to what the algorithm sends."""
    want_bytes, want_messages = wire["bytes"], wire.get("messages")
    if sent_bytes == want_bytes and (want_messages is None or sent_messages == want_messages):
        return None
    text = (f"right values, but sent {sent_bytes} B in {sent_messages} messages where the algorithm sends "
            f"{want_bytes} B" + (f" in {want_messages} messages" if want_messages is not None else ""))
    if want_bytes and sent_bytes >= 1.5 * want_bytes and p > 1:
        per = sent_bytes / max(sent_messages, 1)
        want_per = want_bytes / max(want_messages or sent_messages, 1)
        text += (f": {per:.0f} B per message instead of about {want_per:.0f} B. You sent the whole vector (n "
                 "bytes) per step instead of one block (n/p): send only the block that step is about")
    elif want_messages is not None and sent_messages != want_messages:
        text += f": {sent_messages - want_messages:+d} messages. " + wire.get("hint", "")
    return text.rstrip(". ")


_ORDER = {"raised": 0, "wrong": 1, "wire": 2, "deadlock": 3, "stopped": 4}


def summarise(verdicts, same_result: bool = True) -> str:
    """One line from every rank's (kind, problem): the most telling failure first, then who else failed.
    ``same_result``: every rank must end with the same result (a collective), so rank 0 alone right is news."""
    failing = {r: (kind, problem) for r, (kind, problem) in enumerate(verdicts) if problem}
    if not failing:
        return ""
    p = len(verdicts)
    if len(failing) == p and len({problem for _, problem in failing.values()}) == 1 and p > 1:
        return "every rank: " + failing[0][1]
    if same_result and p > 1 and 0 not in failing and all(kind == "wrong" for kind, _ in failing.values()) and len(failing) == p - 1:
        return (f"only rank 0 has the right result (every rank must end with it). rank "
                f"{min(failing)}: {failing[min(failing)][1]}")
    first, *others = sorted(failing, key=lambda r: (_ORDER[failing[r][0]], r))
    text = f"rank {first}: {failing[first][1]}"
    if len(others) == 1:
        text += f" (rank {others[0]} also failed: {failing[others[0]][1]})"
    elif others:
        listed = ", ".join(map(str, sorted(others)))
        stopped = {failing[r][0] for r in others} == {"stopped"}
        text += f" (ranks {listed} stopped when it did)" if stopped else f" (ranks {listed} also failed)"
    return text


def _progress(i, total, title, case, ok, problem, seconds):
    verdict = "ok" if ok else "WRONG: " + (problem if len(problem) < 160 else problem[:157] + "...")
    print(f"[{i}/{total}] {title}{case.name}: {verdict} ({seconds:.1f} s)", flush=True)


def run_cases(fn, cases, diagnose, *, comm=None, timeout=5.0, bitwise=False, title="", progress=True,
              stop_at_first_failure=False, same_result=True) -> list[dict]:
    """Run ``fn(*case.args, comm)`` on every rank for each case; ``diagnose(result, case, p)`` says what is
    wrong with this rank's result (None: right). Returns a list of dicts (case, ok, problem, seconds, and the
    case's columns), the same on every rank. Collective: call it on every rank."""
    base = comm or world()
    p = base.size
    channel = base.with_timeout(None)  # the side channel: a duplicate of its own
    report = []
    try:
        for i, case in enumerate(cases):
            started = time.monotonic()
            inner = base.with_timeout(timeout)  # a fresh duplicate: a broken case's stray messages stay there
            alarm = _Alarm(channel, _ALARM_TAG_BASE + i)
            c = ExerciseComm(inner, alarm, timeout)
            before = _copy(case.args)
            kind = problem = result = None
            try:
                result = fn(*case.args, c)
            except PeerFailed as e:
                kind, problem = "stopped", str(e)
            except CommTimeoutError as e:
                kind, problem = "deadlock", describe_exception(e)
            except Exception as e:  # noqa: BLE001 - the reader's bug, reported rather than raised
                kind, problem = "raised", describe_exception(e)
            alarm.announce(FAILED if problem else FINISHED)  # at once: the others stop waiting for this rank
            if problem is None:
                if not _unchanged(case.args, before):
                    kind, problem = "wrong", "modified its input (return a new array instead)"
                else:
                    problem = diagnose(result, case, p)
                    kind = "wrong" if problem else None
            if problem is None and case.wire is not None:
                problem = wire_problem(c.bytes_sent, c.messages_sent, case.wire, p)
                kind = "wire" if problem else None
            alarm.close()
            digest = None if problem else _digest(result)
            verdicts = base.allgather_object((kind, problem, digest))
            summary = summarise([(k, v) for k, v, _ in verdicts], same_result)
            ok = not summary
            if ok and bitwise and len({d for _, _, d in verdicts}) > 1:
                ok, summary = False, ("correct to rounding, but not bitwise identical on every rank (the ranks added "
                                      "in different orders: compute each sum once, or in the same order everywhere)")
            if ok:
                c.free()
                inner.free()
            else:  # operations may be left behind: its duplicate stays, and they stay with their buffers
                _ABANDONED.append((inner, c.operations))
            seconds = time.monotonic() - started
            report.append({"case": case.name, **case.columns, "ok": ok, "problem": summary, "seconds": seconds})
            if progress and base.rank == 0:
                _progress(i + 1, len(cases), title, case, ok, summary, seconds)
            if not ok and (stop_at_first_failure or _not_written(verdicts)):
                _skip_the_rest(report, cases[i + 1:], summary if _not_written(verdicts) else None)
                break
            if not ok and any(kind == "deadlock" for kind, *_ in verdicts):  # each would wait out its deadline
                _skip_the_rest(report, cases[i + 1:], f"not run: case {case.name!r} deadlocked (each deadlock "
                                                      f"waits {timeout:g} s; fix that one first)")
                break
    finally:
        channel.free()
    return report


def _not_written(verdicts) -> bool:
    """Every rank raised NotImplementedError: a skeleton, no use running the other cases."""
    return all(kind == "raised" and str(problem).startswith("not written yet") for kind, problem, *_ in verdicts)


def _skip_the_rest(report, rest, problem):
    if problem is not None:  # (a skeleton: the other cases fail the same way)
        report += [{"case": case.name, **case.columns, "ok": False, "problem": problem, "seconds": 0.0}
                   for case in rest]


def run_local(fn, cases, diagnose, *, title="", progress=True) -> list[dict]:
    """``run_cases`` for a function that communicates with nobody: ``fn(*case.args)`` in this process."""
    report = []
    for i, case in enumerate(cases):
        started = time.monotonic()
        try:
            problem = diagnose(fn(*case.args), case, None)
        except Exception as e:  # noqa: BLE001
            problem = describe_exception(e)
        seconds = time.monotonic() - started
        report.append({"case": case.name, **case.columns, "ok": problem is None, "problem": problem or "",
                       "seconds": seconds})
        if progress:
            _progress(i + 1, len(cases), title, case, problem is None, problem or "", seconds)
        if problem and problem.startswith("not written yet"):
            _skip_the_rest(report, cases[i + 1:], problem)
            break
    return report


def format_report(report, details: bool = True) -> str:
    """Plain text: how many cases passed, then (``details``) one line per case."""
    passed = sum(r["ok"] for r in report)
    lines = [f"{passed} of {len(report)} cases correct" + (" -- well done!" if report and passed == len(report) else "")]
    if not details:
        return lines[0]
    wrong = {r["problem"] for r in report if not r["ok"]}
    if len(report) > 1 and passed == 0 and len(wrong) == 1:  # one mistake everywhere (a skeleton, say): say it once
        lines.append(textwrap.fill(f"  every case: {wrong.pop()}", width=120, subsequent_indent="    "))
        return "\n".join(lines)
    width = max([len(r["case"]) for r in report] + [4])
    for r in report:
        mark = "ok   " if r["ok"] else "WRONG"
        problem = textwrap.fill(r["problem"], width=110, subsequent_indent=" " * (width + 10))
        lines.append(f"  {mark} {r['case']:<{width}}  {problem}".rstrip())
    return "\n".join(lines)


def passed(report) -> bool:
    return bool(report) and all(r["ok"] for r in report)
