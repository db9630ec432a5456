"""Preemption: SIGTERM during `fit` asks for a backup and a clean exit, on every worker at the same step."""

from __future__ import annotations

import signal
import sys
import threading

from tfdist.callbacks import _workers
from tfdist.strategies import topology


class Preemption:
    """The SIGTERM flag of one `fit`: set by a signal handler, agreed between the workers at fixed steps.

    `start()` installs the handler (only when `fit` runs in the main thread,
    where Python delivers signals) and `stop()` puts the previous one back.
    Under several workers `check` all-gathers the flag every `check_steps`
    steps and at epoch ends, a collective that every worker runs at the same
    steps, so all of them learn of any worker's SIGTERM at the same step.
    The handler's flag and the agreed one are kept apart: a signal that
    arrives while the all-gather runs (the launcher signals every worker at
    once, and workers spend part of each step in it) is exchanged at the next
    check instead of being overwritten by that all-gather's answer.
    """

    def __init__(self, strategy, *, enabled: bool, check_steps: int):
        self._strategy = strategy
        self._num_workers = topology.of(strategy).num_workers
        self._enabled = enabled
        self._check_steps = check_steps
        self._previous_handler = None
        self._signalled = False  # this process got SIGTERM (written by the handler only)
        self._agreed = False  # some worker got it, as the last all-gather said

    @property
    def requested(self) -> bool:
        """Whether training stops for a SIGTERM: agreed by every worker, or this process' own flag alone."""
        return self._agreed if self._num_workers > 1 else self._signalled

    def start(self) -> None:
        if not self._enabled or threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            self._signalled = True

        self._previous_handler = signal.signal(signal.SIGTERM, handler)

    def stop(self) -> None:
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def check(self, step: int, *, epoch_end: bool = False) -> bool:
        """Whether any worker got SIGTERM (exchanged at this step when due, else the last exchange's answer)."""
        if not self._enabled:
            return False
        due = epoch_end or step % self._check_steps == 0
        if self._num_workers > 1 and due and not self._agreed:
            signalled = self._signalled  # read once: the handler may set it during the all-gather
            self._agreed = bool(_workers.all_gather_rows(self._strategy, [float(signalled)]).max())
        return self.requested

    def exit(self, saved: str) -> None:
        """Puts the previous handler back, says what was `saved`, and exits the process with status 0."""
        self.stop()
        print(f"tfdist BackupAndRestore: SIGTERM received; saved {saved}; exiting with status 0.", file=sys.stderr,
              flush=True)
        raise SystemExit(0)
