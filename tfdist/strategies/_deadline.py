"""A deadline on distributed steps: one watchdog thread aborts the collectives of a step that overruns.

TensorFlow bounds a collective with `CommunicationOptions(timeout_seconds=...)` by
starting, for every collective it executes, a detached thread that sleeps for the
whole timeout (`BaseCollectiveExecutor::ExecuteAsync` schedules its timeout through
`Env::SchedClosureAfter`, which on POSIX is a new thread per call). A training step
runs several collectives, so a long run accumulates steps x collectives threads
within any timeout window (measured: 6 per Keras step, 9,000 threads after 1,500
steps) until thread creation fails and the process aborts.

tfdist therefore runs collectives without TensorFlow's timeout and enforces the
deadline itself: every call of a traced function that contains collectives (Keras'
train/test/predict steps, custom-loop `tf.function`s, tfdist callbacks' gathers) is
timed, and a single watchdog thread per process calls
`abort_collective_ops(DEADLINE_EXCEEDED)` when one runs longer than the deadline,
so the waiting step fails with `tf.errors.DeadlineExceededError` as with
TensorFlow's own timeout. Collectives cannot be used in the process after that.
"""

from __future__ import annotations

import itertools
import threading
import time

from tensorflow.python.eager import context
from tensorflow.python.framework import errors

_MAX_POLL = 1.0


class StepDeadline:
    """Times the calls of functions with collectives; aborts the collectives of one that overruns.

    Args:
        timeout: seconds a call may run.
        what: who this process is, for the error message (e.g. its worker address).
        on_expire: called with the error message from the watchdog thread just before the
            collectives are aborted (the flight recorder's report), or None.

    Example:

    >>> deadline = StepDeadline(timeout=30.0, what="worker 0")
    >>> with deadline.running():
    ...     pass
    >>> deadline.close()
    """

    def __init__(self, *, timeout: float, what: str, on_expire=None):
        self.timeout = float(timeout)
        self.what = what
        self._on_expire = on_expire
        self._lock = threading.Lock()
        self._calls: dict[int, float] = {}
        self._tokens = itertools.count()
        self._closed = threading.Event()
        self.aborted: str | None = None
        self._thread = threading.Thread(target=self._watch, name="tfdist-step-deadline", daemon=True)
        self._thread.start()

    def running(self):
        """Context manager around one function call that may wait in collectives."""
        return _Running(self)

    def _enter(self) -> int:
        token = next(self._tokens)
        with self._lock:
            self._calls[token] = time.monotonic()
        return token

    def _exit(self, token: int) -> None:
        with self._lock:
            self._calls.pop(token, None)

    def _watch(self) -> None:
        poll = min(_MAX_POLL, self.timeout / 10)
        while not self._closed.wait(poll):
            with self._lock:
                oldest = min(self._calls.values(), default=None)
            if oldest is None or time.monotonic() - oldest <= self.timeout:
                continue
            self.aborted = (
                f"tfdist: {self.what}: a distributed step ran for more than timeout={self.timeout:g}s, so its "
                "collectives were aborted: a peer is stuck (alive but not reaching the same collective) or far "
                "slower. Check the other workers' logs, or raise `timeout` if steps really take this long."
            )
            if self._on_expire is not None:
                self._on_expire(self.aborted)
            context.context().abort_collective_ops(errors.DEADLINE_EXCEEDED, self.aborted)
            return

    def close(self) -> None:
        """Stops the watchdog thread."""
        self._closed.set()
        self._thread.join()


class _Running:
    __slots__ = ("_deadline", "_token")

    def __init__(self, deadline: StepDeadline):
        self._deadline = deadline

    def __enter__(self):
        self._token = self._deadline._enter()

    def __exit__(self, *exc):
        self._deadline._exit(self._token)
        return False
