"""`ProfileSteps`: TensorFlow's profiler on every worker for the same steps, merged into one timeline."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

from tfdist import _validate
from tfdist import timeline
from tfdist.callbacks import _files
from tfdist.callbacks import _workers
from tfdist.strategies import topology

__all__ = ["ProfileSteps"]


def _steps(steps) -> tuple[int, int]:
    """`steps` as (first, last): an int N is (N, N); a pair must be ordered."""
    pair = (steps, steps) if _validate.is_integer(steps) else steps
    if (
        not isinstance(pair, (tuple, list))
        or len(pair) != 2
        or not all(_validate.is_integer(s, minimum=1) for s in pair)
        or pair[0] > pair[1]
    ):
        raise _validate.invalid(
            "steps", steps, "a step number >= 1, or a pair (first, last) of step numbers with 1 <= first <= last"
        )
    return int(pair[0]), int(pair[1])


class ProfileSteps(keras.callbacks.Callback):
    """Profiles the same training steps on every worker, then merges the traces into one timeline.

    Steps are the optimizer's, counted from 1 (step N takes
    `optimizer.iterations` from N-1 to N), so every worker of a synchronous
    job profiles the same steps, a resumed run included. TensorFlow's profiler
    (`tf.profiler.experimental.start`) starts on every worker just before step
    `first` and stops just after step `last` (both included); each step is
    marked with `tf.profiler.experimental.Trace("train", step_num=N, _r=1)`,
    the marker TensorBoard's profile tools read. Each worker writes its trace
    to `<log_dir>/plugins/profile/<run>/worker-<i>.xplane.pb` (`<run>` is the
    chief's start time, the same on every worker), so `log_dir` must be a
    directory every worker can write (a shared file system when workers run
    on several hosts). With `merge`, the chief then waits (at most
    `merge_timeout` seconds) for every trace and merges them into
    `<run>/timeline.json` with `tfdist.timeline.merge`: one Chrome trace, a
    process per worker, a lane per device and thread, a "steps" lane, open it
    in ui.perfetto.dev or chrome://tracing. A worker whose trace is missing
    is named in a `tfdist.timeline.TimelineWarning` and left out.

    The workers agree on the run name in one all-gather of one number at step
    `first` (a collective: give every worker this callback, in the same place
    of the callback list). A worker whose profiler fails writes
    `worker-<i>.error.txt` saying why, so the chief stops waiting for it.
    Keras' TensorBoard callback must not profile at the same time (its
    `profile_batch`, off by default): one profiler runs per process.

    Args:
        steps: the steps to profile: `(first, last)`, both included, or one
            step number.
        log_dir: where the traces go (created if missing); TensorBoard's log
            directory suits it: `tensorboard --logdir` shows the traces in its
            Profile tab.
        merge: whether the chief merges the traces into one timeline.
        merge_timeout: how long the chief waits for the other workers'
            traces to appear in `log_dir` after step `last`, in seconds.
        options: a `tf.profiler.experimental.ProfilerOptions` (tracer levels),
            or None for the profiler's defaults.
        workers: the indices of the workers that profile, or None for every
            worker (the others take part in the run's all-gather only).
            TensorFlow 2.21's profiler can abort a worker other than the chief
            of a multi-worker job when it stops (see the README); `[0]`
            profiles the chief alone.

    Attributes:
        run_dir: the run's directory, once profiling has started.
        trace_path: the merged timeline on the chief, once written; None
            elsewhere.

    Raises:
        ValueError: for bad `steps`, a `log_dir` that is a file or not
            writable, a non-positive `merge_timeout`, or `options` that are not
            ProfilerOptions.

    Example:

    >>> import json, keras, numpy as np, tempfile, tfdist
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> profile = tfdist.callbacks.ProfileSteps(steps=(2, 3), log_dir=tempfile.mkdtemp())
    >>> _ = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, verbose=0, callbacks=[profile])
    >>> trace = json.load(open(profile.trace_path))
    >>> sorted(e["name"] for e in trace["traceEvents"] if e.get("cat") == "step")
    ['step 2', 'step 3']
    """

    def __init__(
        self,
        *,
        steps,
        log_dir,
        merge: bool = True,
        merge_timeout: float = 60.0,
        options: tf.profiler.experimental.ProfilerOptions | None = None,
        workers=None,
    ):
        super().__init__()
        self.first, self.last = _steps(steps)
        self.log_dir = _files.check_writable_dir("log_dir", log_dir)
        if not isinstance(merge, bool):
            raise _validate.invalid("merge", merge, "True or False")
        self.merge = merge
        self.merge_timeout = _validate.positive_number("merge_timeout", merge_timeout, unit="seconds")
        if options is not None and not isinstance(options, tf.profiler.experimental.ProfilerOptions):
            raise _validate.invalid("options", options, "a tf.profiler.experimental.ProfilerOptions or None")
        self.options = options
        if workers is not None and (
            not isinstance(workers, (tuple, list))
            or not workers
            or not all(_validate.is_integer(w, minimum=0) for w in workers)
            or len(set(workers)) != len(workers)
        ):
            raise _validate.invalid("workers", workers, "None (every worker) or a non-empty list of worker indices")
        self.workers = None if workers is None else sorted(workers)
        self.run_dir: str | None = None
        self.trace_path: str | None = None
        self._state = "waiting"  # -> "active" (from step `first`) -> "done"
        self._capturing = False  # this worker's profiler runs (a failed start leaves it False while "active")
        self._marker = None
        self._temp_dir = None
        self._failure = None  # why this worker captured no trace

    def on_train_begin(self, logs=None):
        self._topology = topology.of(self.model.distribute_strategy)
        absent = [w for w in self.workers or () if w >= self._topology.num_workers]
        if absent:
            raise ValueError(
                f"ProfileSteps: workers={self.workers} names worker(s) {absent}, but this job has "
                f"{self._topology.num_workers} worker(s). Expected indices from 0 to {self._topology.num_workers - 1}."
            )
        self._profiled = list(range(self._topology.num_workers)) if self.workers is None else self.workers
        self._step = int(np.asarray(self.model.optimizer.iterations.numpy()))
        self._per_call = max(1, int(self.model.steps_per_execution))
        if self._state == "waiting" and self._step >= self.last:
            self._state = "done"
            warnings.warn(
                f"ProfileSteps: training starts after step {self._step}, past the steps to profile "
                f"({self.first} to {self.last}): nothing is profiled.",
                stacklevel=2,
            )

    def on_train_batch_begin(self, batch, logs=None):
        self._batch = batch
        if self._state == "waiting" and self._step + self._per_call >= self.first:
            self._start()
        if self._capturing:
            self._marker = tf.profiler.experimental.Trace(timeline.STEP_EVENT, step_num=self._step + 1, _r=1)
            self._marker.__enter__()

    def on_train_batch_end(self, batch, logs=None):
        if self._marker is not None:
            self._marker.__exit__(None, None, None)
            self._marker = None
        self._step += batch - self._batch + 1
        if self._state == "active" and self._step >= self.last:
            self._finish()

    def on_train_end(self, logs=None):
        if self._state == "active":  # training ended inside the range: keep what was profiled
            warnings.warn(
                f"ProfileSteps: training ended at step {self._step}, before step {self.last}: the traces cover "
                f"steps {self._started_at} to {self._step}.",
                stacklevel=2,
            )
            self._finish()
        elif self._state == "waiting":
            warnings.warn(
                f"ProfileSteps: training ended at step {self._step}, before step {self.first}: nothing was profiled.",
                stacklevel=2,
            )

    def _start(self) -> None:
        strategy = self.model.distribute_strategy
        # One all-gather: every worker names the run by the chief's clock, and they start together.
        chief_time = float(_workers.all_gather_rows(strategy, [time.time()])[0, 0])
        self.run_dir = timeline.run_directory(self.log_dir, timeline.run_name(chief_time))
        self._state = "active"
        self._started_at = self._step + 1
        self._failure = None
        if self._topology.worker_index not in self._profiled:
            return
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            self._temp_dir = tempfile.mkdtemp(prefix="tfdist-profile-")
            tf.profiler.experimental.start(self._temp_dir, options=self.options)
        except (OSError, tf.errors.OpError) as e:
            self._failure = f"the profiler did not start: {e}"
            self._remove_temp_dir()
            return
        self._capturing = True

    def _finish(self) -> None:
        self._state = "done"
        if self._capturing:
            self._write_trace()
        self._capturing = False
        if self._failure is not None and self._topology.worker_index in self._profiled:
            self._write_error()
        if not (self.merge and self._topology.is_chief):
            return
        try:
            self.trace_path = timeline.merge_run(self.run_dir, expected=self._profiled, timeout=self.merge_timeout)
        except FileNotFoundError as e:  # no worker wrote a trace: training goes on
            warnings.warn(f"ProfileSteps: no timeline written: {e}", timeline.TimelineWarning, stacklevel=3)

    def _write_trace(self) -> None:
        """Stops the profiler and moves its trace to `worker-<i>.xplane.pb` in the run directory."""
        path = os.path.join(self.run_dir, timeline.worker_file(self._topology.worker_index))
        try:
            tf.profiler.experimental.stop()
            pattern = os.path.join(self._temp_dir, timeline.PROFILE_SUBDIR, "*", "*" + timeline.TRACE_SUFFIX)
            (trace,) = glob.glob(pattern)
            with open(trace, "rb") as source, _files._atomic_file(path) as target:
                shutil.copyfileobj(source, target)
        except (OSError, ValueError, tf.errors.OpError) as e:  # ValueError: not exactly one trace file
            self._failure = f"its trace could not be written to {path!r}: {e}"
        finally:
            self._remove_temp_dir()

    def _write_error(self) -> None:
        """Says why this worker has no trace, in `worker-<i>.error.txt` (peers stop waiting for it)."""
        message = f"ProfileSteps: worker {self._topology.worker_index} captured no trace: {self._failure}"
        warnings.warn(message, stacklevel=4)
        with contextlib.suppress(OSError):
            with _files._atomic_file(os.path.join(self.run_dir, timeline.error_file(self._topology.worker_index))) as f:
                f.write(self._failure.encode())

    def _remove_temp_dir(self) -> None:
        if self._temp_dir is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(self._temp_dir)
            self._temp_dir = None
