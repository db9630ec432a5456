"""Step times a worker measures itself, without a profiler: `StepTimer`, for `tfdist.callbacks.StepStats`.

Each optimizer step of `fit` is split into four times (seconds, `COLUMNS`):

- `step_time`: host wall time of the train function call (one step, or
  `steps_per_execution` of them), until its outputs are ready;
- `input_wait`: from the step's start to this worker's batch being ready;
- `collective_wait`: waiting for the other workers and replicas: from this
  replica's gradients being ready to the all-reduced ones (the wait for
  slower peers plus the transfer), and from this worker's batch being ready
  to the batch being usable (TensorFlow's cross-worker "has a value" check,
  tfdist's global example count: both wait for the slowest worker's batch);
- `compute`: the rest (forward and backward pass, weight update, metrics, and
  the host's dispatch of the step).

Where the batch is drawn inside the traced step (a tf.data / tf.distribute
iterator: any MirroredStrategy, MultiWorkerStrategy, PipelineStrategy, or no
strategy), the timer builds a second train function around a timed copy of
`train_step` with `tf.timestamp()`s: the step's start (an op with no inputs in
the train function's own graph, which runs before the batch is drawn; see
`tfdist._compat.step_timing.step_start_graph`), this worker's batch ready
(before the cross-worker checks), the batch usable in the replica, and
around the gradient all-reduce of a tfdist strategy
(`_tfdist_all_reduce_gradients`). Each timestamp waits only for tensors the
step computes anyway, and nothing else waits for them
(`tfdist._compat.step_timing.timestamp`). Each replica keeps its last rows in a sync-on-read
variable of its own, read on the host only by `take()`.

Where batches are drawn on the host (ModelParallelStrategy and
ShardedDataParallelStrategy hand Keras DTensor batches from a Python
iterator), the time spent in `next()` is the input wait, and the collectives
run inside one SPMD program: the collective wait is not separable there (NaN)
and counts as compute. A model compiled with `jit_compile=True` runs its step
as XLA clusters, which cannot hold these ops: only step times are measured.
With `run_eagerly=True` the step starts at the host's call.

Example:

>>> import keras, numpy as np
>>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
>>> model.compile(optimizer="sgd", loss="mse")
>>> timer = StepTimer(model, capacity=8)
>>> timer.attach(); timer.activate()
>>> _ = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, verbose=0)
>>> timer.deactivate()
>>> samples = timer.take()  # [local units, calls after the first, COLUMNS]
>>> samples.shape, timer.in_step, timer.units
((1, 3, 4), True, ('/job:localhost/replica:0/task:0/device:CPU:0',))
"""

from __future__ import annotations

import functools
import threading
import time
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import mirrored_strategy

from tfdist import _compat
from tfdist import errors
from tfdist._compat import step_timing as keras_step_timing
from tfdist.strategies import _exact
from tfdist.strategies import _extended

stamp = keras_step_timing.timestamp

COLUMNS = ("step_time", "input_wait", "compute", "collective_wait")
_TF_ITERATORS = (tf.data.Iterator, tf.distribute.DistributedIterator)
# Each ring row: the step's start, this worker's batch ready, the batch ready in the replica (after any
# cross-worker wait for the other workers' batches), all in tf.timestamp() seconds; then the seconds the
# step's collectives waited (gradient all-reduce, the global example count).
_COLUMNS_KEPT = ("start", "local", "ready", "collective")
_START, _LOCAL, _READY, _COLLECTIVE = range(len(_COLUMNS_KEPT))

# While a timed train step is traced on this thread: the all-reduce durations it has met (else None), and the
# graph it is traced in (an all-reduce in a branch of a `cond`, e.g. gradient accumulation's, is not timed:
# its tensors cannot leave the branch). `recording`: a timed train function is running on this thread.
_tracing = threading.local()
# Per traced graph, the timestamps taken before the replicas' steps: "start" (the train function's start),
# "local" (this worker's batch ready) and "synced" (after a cross-worker wait for the other workers' batches).
_marks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tensors(structure) -> list:
    return [t for t in tf.nest.flatten(structure, expand_composites=True) if isinstance(t, tf.Tensor)]


def _graph():
    return tf.compat.v1.get_default_graph()


def _time_around(call, value, record):
    """`call(value)` (a collective), with `record` handed its duration: from `value` ready to the result ready."""
    start = stamp(_tensors(value))
    result = call(value)
    record(stamp(_tensors(result)) - start)
    return result


def _timed_all_reduce(original):
    """`original` (an `_tfdist_all_reduce_gradients`) recording its duration in the timed step being traced."""

    @functools.wraps(original)
    def all_reduce_gradients(grads):
        marks = getattr(_tracing, "marks", None)
        if marks is None or _graph() is not _tracing.graph:
            return original(grads)
        return _time_around(original, grads, marks.append)

    all_reduce_gradients._tfdist_step_timing = True
    return all_reduce_gradients


def _timed_global_count(original):
    """`original` (an `_tfdist_global_count`: a cross-worker sum after this worker's batch is ready), marked."""

    @functools.wraps(original)
    def global_count(local_count):
        if not getattr(_tracing, "recording", False):
            return original(local_count)
        local = stamp(_tensors(local_count))
        total = original(local_count)
        if total is not local_count:  # else one worker: nothing was exchanged
            marks = _marks.setdefault(_graph(), {})
            marks.setdefault("local", local)
            marks["synced"] = stamp(_tensors(total))
        return total

    global_count._tfdist_step_timing = True
    return global_count


def _time_collectives(strategy) -> bool:
    """Times the collectives of a tfdist data-parallel strategy's step (once per strategy); False for others."""
    extended = strategy.extended
    if not isinstance(extended, _exact.ExactReplicas):
        return False
    for name, timed in (
        ("_tfdist_all_reduce_gradients", _timed_all_reduce),
        ("_tfdist_global_count", _timed_global_count),
    ):
        if getattr(type(extended), name) is getattr(_extended.TfdistExtended, name):
            continue  # the default: nothing exchanged (one worker)
        current = getattr(extended, name)
        if not getattr(current, "_tfdist_step_timing", False):
            setattr(extended, name, timed(current))
    return True


def _local_input(local) -> None:
    _marks.setdefault(_graph(), {})["local"] = local


class _Recording:
    """While a timed train function runs (and traces) on this thread: its collectives and local input are timed."""

    def __enter__(self):
        _tracing.recording = True
        self._previous = keras_step_timing.set_local_input_listener(_local_input)

    def __exit__(self, *exc):
        keras_step_timing.set_local_input_listener(self._previous)
        _tracing.recording = False


def _first_tensor(outputs):
    """One tensor of a train function's outputs (Keras' logs: a dict of scalars), or None."""
    if isinstance(outputs, dict):
        for value in outputs.values():
            if isinstance(value, tf.Tensor):
                return value
    leaves = _tensors(outputs)
    return leaves[0] if leaves else None


class _TimedIterator:
    """A host iterator that adds up the seconds spent drawing from it (`seconds`) and the batches drawn."""

    def __init__(self, iterator):
        self._iterator = iterator
        self.seconds = 0.0
        self.steps = 0

    def __iter__(self):
        return self

    def __next__(self):
        start = time.time()
        try:
            value = next(self._iterator)
        finally:
            self.seconds += time.time() - start
        self.steps += 1
        return value


class _TimedTrainFunction:
    """Stands in for `model.train_function`: times each call while its timer is active, else calls Keras' own."""

    def __init__(self, timer: StepTimer, plain):
        self.timer = timer
        self.plain = plain

    def __call__(self, iterator):
        timer = self.timer
        if not timer.active:
            return self.plain(iterator)
        host = None
        if isinstance(iterator, _TF_ITERATORS):
            function = timer._in_step_function() if timer.in_step else self.plain
        else:
            function, iterator = self.plain, _TimedIterator(iterator)
            host = iterator
        start = time.time()
        with _Recording():  # while it traces (the first call, a new input signature)
            outputs = function(iterator)
        first = _first_tensor(outputs)
        if first is not None:
            first.numpy()  # the step's kernels have run (on a GPU, the call returns once they are queued)
        timer._record(start, time.time(), host)
        return outputs


class StepTimer:
    """Times every training step of `model.fit` while active (see the module docstring).

    Call `attach()` before `fit` builds its train function (a callback's
    `set_model`: Keras builds it after making the callback list, and callbacks
    that wrap it in `on_train_begin` then wrap this one), `activate()` /
    `deactivate()` around the steps to time (`on_train_begin` / `on_train_end`),
    optionally `note_steps(n)` after each call (the optimizer steps it ran),
    and `take()` for the samples since the last `take()`.

    Args:
        model: a compiled Keras model.
        capacity: rows each replica keeps between two `take()`s (one per
            step, or per micro-batch); the calls whose rows were dropped are
            left out of the samples (NaN).
    """

    def __init__(self, model, *, capacity: int):
        self.model = model
        self.capacity = int(capacity)
        self.active = False
        self.in_step = False
        self.units: tuple[str, ...] = ()
        self._function = None
        self._rings = None
        self._calls: list[list] = []  # [start, end, optimizer steps, host input seconds or None]
        self._skip = 0
        self.calls_timed = 0  # calls of the train function timed since `activate()`

    # ---------------------------------------------------------------- lifecycle
    def attach(self) -> None:
        """Makes `model.train_function` this timer's (building Keras' own first if there is none)."""
        _compat.install("step_stats")
        model = self.model
        current = model.train_function
        if isinstance(current, _TimedTrainFunction):
            if current.timer is self:
                return
            current = current.plain
        if current is None:
            model.make_train_function()
            current = model.train_function
        model.train_function = _TimedTrainFunction(self, current)

    def activate(self) -> None:
        """Starts timing (the first call after this, which may trace, is left out of the samples)."""
        model = self.model
        strategy = model.distribute_strategy
        default = strategy is tf.distribute.get_strategy() and not tf.distribute.has_strategy()
        self.in_step = (model.run_eagerly or not model.jit_compile) and (
            default or isinstance(strategy.extended, mirrored_strategy.MirroredExtended)
        )
        self._collectives_timed = self.in_step and _time_collectives(strategy)
        self._calls, self._skip, self.calls_timed = [], 1, 0
        self.active = True

    def deactivate(self) -> None:
        """Stops timing; puts Keras' own train function back if this timer's is still in place."""
        self.active = False
        current = self.model.train_function
        if isinstance(current, _TimedTrainFunction) and current.timer is self:
            self.model.train_function = current.plain

    @property
    def collective_measured(self) -> bool:
        """Whether the collective wait is measured (0 with one replica in sync: there is no all-reduce)."""
        return self.in_step and (self._collectives_timed or self.model.distribute_strategy.num_replicas_in_sync == 1)

    # ---------------------------------------------------------------- the timed step
    def _in_step_function(self):
        if self._function is None:
            self._make_rings()
            self._function = keras_step_timing.make_train_function(self.model, self._timed_step())
        return self._function

    def _make_rings(self) -> None:
        strategy = self.model.distribute_strategy
        empty = tf.fill([self.capacity, len(_COLUMNS_KEPT)], tf.constant(np.nan, tf.float64))
        with strategy.scope():
            self._rings = tf.Variable(
                empty,
                trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=tf.VariableAggregation.NONE,
                name="tfdist_step_timing",
            )
        self.units = tuple(ring.device for ring in strategy.experimental_local_results(self._rings))

    def _timed_step(self):
        train_step = self.model.train_step
        rings = self._rings
        no_collective = 0.0 if self.model.distribute_strategy.num_replicas_in_sync == 1 else np.nan

        @functools.wraps(train_step)  # still the model's train step to tfdist's hooks (`keras_step`)
        def timed_train_step(data):
            graph = _graph()
            outer = keras_step_timing.step_start_graph(graph)
            before, here = _marks.get(outer, {}), _marks.get(graph, {})
            if tf.executing_eagerly():  # `run_eagerly`: the batch is here already; the host's call is the start
                start = tf.constant(np.nan, tf.float64)
            elif "start" in before:  # another replica's
                start = before["start"]
            else:
                with outer.as_default():
                    start = stamp()  # waits for nothing: runs as the train function starts, before the batch
                _marks.setdefault(outer, {})["start"] = start
            ready = stamp(_tensors(data) + ([here["synced"]] if "synced" in here else []))
            local = before.get("local", here.get("local", ready))
            previous = getattr(_tracing, "marks", None), getattr(_tracing, "graph", None)
            _tracing.marks, _tracing.graph = [], graph
            try:
                outputs = train_step(data)
                marks = _tracing.marks
            finally:
                _tracing.marks, _tracing.graph = previous
            collective = tf.add_n(marks) if marks else tf.constant(no_collective, tf.float64)
            row = tf.stack([start, local, ready, collective])[None]
            rings.assign(tf.concat([rings[1:], row], axis=0))
            return outputs

        return timed_train_step

    # ---------------------------------------------------------------- samples
    def _record(self, start: float, end: float, host: _TimedIterator | None) -> None:
        self.calls_timed += 1
        if self._skip:  # the first call (it traces) is not a sample
            self._skip -= 1
            return
        if host is not None:
            self._calls.append([start, end, host.steps, host.seconds])
        else:
            self._calls.append([start, end, max(1, int(self.model.steps_per_execution)), None])

    def note_steps(self, steps: int) -> None:
        """The optimizer steps the last call ran, when timed inside the step (Keras' batch indices say).

        Without it a call counts `steps_per_execution` steps (fewer run at the end of an epoch's data).
        """
        if self._calls and self._calls[-1][3] is None:
            self._calls[-1][2] = int(steps)

    def take(self) -> np.ndarray:
        """Per-step seconds of each call since the last `take()`: shape [local units, calls, len(COLUMNS)].

        Local units are this process' replicas (`units`, their devices) when
        timed inside the step, else the process (one unit). A call of k
        optimizer steps gives its totals / k.
        """
        calls = [c for c in self._calls if c[2]]
        self._calls = []
        if self.in_step and self._rings is not None:
            samples = self._in_step_samples(calls)
        else:
            samples = np.full((1, len(calls), len(COLUMNS)), np.nan)
            for i, (start, end, steps, seconds) in enumerate(calls):
                step = (end - start) / steps
                wait = np.nan if seconds is None else seconds / steps
                samples[0, i] = (step, wait, step - wait, np.nan)
        return samples

    def _in_step_samples(self, calls) -> np.ndarray:
        strategy = self.model.distribute_strategy
        rings = [ring.numpy() for ring in strategy.experimental_local_results(self._rings)]
        samples = np.full((len(rings), len(calls), len(COLUMNS)), np.nan)
        if not calls:
            return samples
        starts, ends, steps = (np.array([c[k] for c in calls], np.float64) for k in range(3))
        for unit, ring in enumerate(rings):
            samples[unit, :, 1], samples[unit, :, 3] = _split(ring, starts, ends)
        if np.isnan(samples[:, :, 1]).all():
            raise errors.CompatError(
                "tfdist StepStats: the train function ran without the timed train step (no row was written while "
                f"it ran): {self.model.name!r}'s train function no longer calls the step function it was built with."
            )
        samples[:, :, 0] = ends - starts
        samples[:, :, 2] = samples[:, :, 0] - samples[:, :, 1] - np.nan_to_num(samples[:, :, 3])
        return samples / steps[None, :, None]


def _split(ring, starts, ends) -> tuple[np.ndarray, np.ndarray]:
    """Per call (host `starts`, `ends`, in order): one replica's (input wait, collective wait) seconds, NaN: no row.

    A call's rows are those whose batch was ready while it ran (one per step, or per micro-batch); rows
    of one step share its start and waited for their batch once; the collective waits add up (NaN where
    none was measured).
    """
    rows = ring[np.isfinite(ring[:, _READY])]  # the ring keeps rows in the order they were written
    call = np.searchsorted(starts, rows[:, _READY], side="right") - 1
    inside = (call >= 0) & (rows[:, _READY] <= ends[np.maximum(call, 0)])
    rows, call = rows[inside], call[inside]
    n = len(starts)
    wait, collective = np.full(n, np.nan), np.full(n, np.nan)
    if not len(rows):
        return wait, collective
    begin = np.where(np.isnan(rows[:, _START]), starts[call], rows[:, _START])  # NaN: run eagerly, from the call
    first = np.flatnonzero(np.r_[True, (call[1:] != call[:-1]) | (begin[1:] != begin[:-1])])  # each step's rows
    local = np.minimum.reduceat(rows[:, _LOCAL], first)
    ready = np.minimum.reduceat(rows[:, _READY], first)
    step_call = call[first]
    seen = np.bincount(step_call, minlength=n) > 0
    # Waiting for the other workers' batches (local -> ready) is waiting for peers.
    wait[seen] = np.bincount(step_call, local - begin[first], minlength=n)[seen]
    sync = np.bincount(step_call, ready - local, minlength=n)
    measured = np.bincount(call, np.isfinite(rows[:, _COLLECTIVE]), minlength=n) > 0
    total = np.bincount(call, np.nan_to_num(rows[:, _COLLECTIVE]), minlength=n) + sync
    collective[measured] = total[measured]
    return wait, collective
