"""Handles of collectives in flight: ``wait()`` for the result, ``test()`` whether it is done."""

from __future__ import annotations

import threading

from tplab.overlap import trace


class Handle:
    """A collective in flight. ``wait()`` blocks until it is done and returns its result (or raises its
    error); ``test()`` says whether it is done, without blocking."""

    def __init__(self, what: str):
        self.what = what
        self._done = threading.Event()
        self._result = self._error = None

    def _finish(self, result=None, error=None):
        self._result, self._error = result, error
        self._done.set()

    def test(self) -> bool:
        return self._done.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None):
        if not self._done.is_set():
            with trace.span(f"wait {self.what}", kind="wait"):  # the time the caller stood still: exposed
                if not self._done.wait(timeout):
                    raise TimeoutError(f"{self.what} did not complete within {timeout:g} s")
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self):
        return f"<Handle {self.what}: {'done' if self.done else 'in flight'}>"


class Completed(Handle):
    """A handle that is done from the start (a no-op collective, or one rank: nothing to send)."""

    def __init__(self, result, what="nothing to do"):
        super().__init__(what)
        self._finish(result)


def waitall(handles) -> list:
    return [h.wait() for h in handles]
