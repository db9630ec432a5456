"""`StepStats`: which worker holds a distributed run back, and by how much: a straggler report from inside `fit`."""

from __future__ import annotations

import dataclasses
import os
import warnings

import keras
import numpy as np
import tensorflow as tf

from tfdist import _validate
from tfdist import errors
from tfdist.callbacks import _step_timing
from tfdist.callbacks import _workers
from tfdist.strategies import topology

__all__ = ["StepReport", "StepStats", "StragglerWarning", "summarize"]

COLUMNS = _step_timing.COLUMNS


class StragglerWarning(UserWarning):
    """One worker (or replica) has been slower than the others for `patience` reports in a row."""


@dataclasses.dataclass(frozen=True, eq=False)
class StepReport:
    """One report of `StepStats`: every worker's (or replica's) step, split, over one interval.

    Times are seconds per optimizer step, each the median over the interval's
    steps (the first call of `fit`, which traces, left out); NaN where not
    measured.

    Attributes:
        step: the optimizer step at the report.
        steps: how many train function calls the medians are taken over.
        kind: "worker" (one process each) or "replica" (one device each, in one process).
        units: who each row is, e.g. "worker 1 (127.0.0.1:4321)", "replica 0 (/job:localhost/.../CPU:0)".
        step_time, input_wait, compute, collective_wait: one figure per unit (see `tfdist.callbacks.StepStats`).
        own_time: per unit, the time not spent waiting for peers: step_time - collective_wait, or the
            input wait alone where the collective wait is not separable (ModelParallelStrategy).
        slowest: the index (into `units`) of the unit with the largest own time.
        lag: seconds per step by which the slowest unit's own time exceeds the median of the others' (0 with
            one unit).
        lag_fraction: `lag` / the median step time: the share of every step the others spend waiting for it.
        over_threshold: whether `lag` is beyond both thresholds in this interval.
        straggler: `slowest` once it has been over the thresholds for `patience` reports in a row (then the
            report flags it as the straggler), else None.
    """

    step: int
    steps: int
    kind: str
    units: tuple[str, ...]
    step_time: np.ndarray
    input_wait: np.ndarray
    compute: np.ndarray
    collective_wait: np.ndarray
    own_time: np.ndarray
    slowest: int
    lag: float
    lag_fraction: float
    over_threshold: bool
    straggler: int | None


@dataclasses.dataclass(frozen=True)
class Summary:
    """What `summarize` finds in one interval's table (see `StepReport` for each field)."""

    own_time: np.ndarray
    slowest: int
    lag: float
    lag_fraction: float
    over_threshold: bool


def _median(values, axis=None):
    """np.median over the finite values (NaN where there is none), without NumPy's all-NaN warning."""
    values = np.asarray(values, np.float64)
    if axis is None:
        finite = values[np.isfinite(values)]
        return float(np.median(finite)) if finite.size else float("nan")
    moved = np.moveaxis(values, axis, -1)
    out = np.full(moved.shape[:-1], np.nan)
    for index in np.ndindex(out.shape):
        out[index] = _median(moved[index])
    return out


def summarize(table, *, threshold: float, min_lag: float) -> Summary:
    """The slowest unit of one interval and its lag behind the median of the others.

    Args:
        table: shape [units, 4]: each unit's step_time, input_wait, compute
            and collective_wait (seconds per step; NaN: not measured).
        threshold: the lag, as a fraction of the median step time, from which
            the slowest unit is over the threshold.
        min_lag: the lag in seconds from which it is (both must hold).

    Returns:
        A `Summary`. The own time of a unit is its step time less its
        collective wait (its input wait alone where that is NaN); the lag is
        the slowest own time less the median of the other units' own times.

    Example (worker 1 waits 40 ms for its input; worker 0 waits for worker 1 in the all-reduce):

    >>> table = [[0.045, 0.001, 0.004, 0.040], [0.045, 0.040, 0.004, 0.001], [0.045, 0.001, 0.003, 0.041]]
    >>> s = summarize(table, threshold=0.2, min_lag=0.005)
    >>> s.slowest, round(s.lag, 4), round(s.lag_fraction, 2), s.over_threshold
    (1, 0.0395, 0.88, True)
    """
    table = np.asarray(table, np.float64).reshape(-1, len(COLUMNS))
    step, wait, _, collective = table.T
    own = np.where(np.isfinite(collective), step - collective, wait)
    if not np.isfinite(own).any():
        return Summary(own, 0, float("nan"), float("nan"), False)
    slowest = int(np.nanargmax(own))
    if len(own) == 1:
        return Summary(own, slowest, 0.0, 0.0, False)
    lag = float(own[slowest] - _median(np.delete(own, slowest)))
    fraction = lag / _median(step) if _median(step) > 0 else float("nan")
    over = bool(np.isfinite(lag) and lag >= min_lag and np.isfinite(fraction) and fraction >= threshold)
    return Summary(own, slowest, lag, fraction, over)


class _Episodes:
    """Counts the reports in a row with the same unit over the thresholds; an episode ends with one without."""

    def __init__(self, patience: int):
        self.patience = patience
        self.unit: int | None = None
        self.count = 0

    def update(self, slowest: int, over_threshold: bool) -> tuple[int | None, bool]:
        """(the straggler, or None; whether its episode just reached `patience`: warn now)."""
        if not over_threshold:
            self.unit, self.count = None, 0
            return None, False
        if slowest != self.unit:
            self.unit, self.count = slowest, 0
        self.count += 1
        if self.count < self.patience:
            return None, False
        return slowest, self.count == self.patience


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f} ms" if np.isfinite(seconds) else "not measured"


def _addresses(strategy, num_workers: int) -> list[str | None]:
    """Each worker's address (host:port) where the strategy's cluster says, else None."""
    cluster = getattr(strategy, "cluster", None)
    addresses = getattr(cluster, "addresses", None)
    if addresses is None:
        resolver = getattr(strategy, "cluster_resolver", None)
        spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
        addresses = [*spec.get("chief", ()), *spec.get("worker", ())]
    addresses = list(addresses)
    return addresses if len(addresses) == num_workers else [None] * num_workers


class StepStats(keras.callbacks.Callback):
    """Every `every` steps, reports each worker's step time, split, and names the one holding the others back.

    Each worker times its own steps without a profiler
    (`tfdist.callbacks._step_timing`): the step time (host wall time of the
    step), the input wait (from the step's start to its own batch being
    ready), the collective wait (waiting for the other workers: from its
    gradients being ready to the all-reduced gradients, plus the transfer,
    and from its batch being ready to the other workers' being ready too) and
    compute (the rest: forward and backward pass, update, the host's dispatch).
    In synchronous training every worker's step takes as long as the slowest
    one's; a straggler shows as the worker with the largest own time (step
    time less collective wait) while the others wait in the all-reduce.

    Every `every` optimizer steps each worker takes the median of each figure
    over the interval and the workers exchange them (one all-gather: a
    collective, so every worker runs it at the same step). The report
    (`StepReport`, appended to `history` on every worker) names the slowest
    worker and its lag: its own time less the median of the others'. It adds
    `slowest_worker` (its index) and `slowest_worker_lag_ms` to the batch and
    epoch logs (Keras' progress bar, History, `keras.callbacks.TensorBoard`
    show them; `slowest_replica...` under DataParallelStrategy); with
    `log_dir` the chief also writes every figure as TensorBoard scalars
    (`step_stats/...`). A worker whose lag is at least `threshold` of the step
    time and at least `min_lag` seconds for `patience` reports in a row is
    the straggler (`StepReport.straggler`) and gets a `StragglerWarning` on
    the chief, naming its index and address, once per episode (until a
    report finds it under the thresholds).

    What is measured where:

    - DataParallelStrategy: per replica (device), inside the step.
    - MultiWorkerStrategy: per worker (its slowest replica), inside the step.
    - PipelineStrategy, plain MirroredStrategy, no strategy: per replica, the
      collective wait only under tfdist's strategies (NaN under plain
      MirroredStrategy).
    - ModelParallelStrategy / ShardedDataParallelStrategy (one or several
      processes): per process; batches are drawn on the host (the input
      wait is the time in `next()`), and the collectives run inside one SPMD
      program, so the collective wait is not separable (NaN, part of compute)
      and the lag compares input waits only.
    - `steps_per_execution > 1`: figures per optimizer step; only the first
      step of each call is seen waiting for input (the later ones' batches are
      drawn during the step before).
    - `jit_compile=True`: a step compiled with XLA cannot hold the timestamps;
      only step times are measured and no straggler is named (a warning says so).

    StepStats replaces `model.train_function` (in `set_model`, before `fit`
    builds it; callbacks that wrap it in `on_train_begin` wrap this one) with
    one built around a timed copy of `train_step`; `fit` traces it once more.
    Give every worker the same callback list. Place StepStats before the
    callbacks that read its log keys.

    Args:
        every: optimizer steps per report (>= 1). Each report costs one
            all-gather of 4 numbers across workers and a read of the rows
            each replica kept.
        threshold: the lag, as a fraction of the median step time (>= 0),
            from which the slowest worker is over the threshold.
        min_lag: the lag in seconds (>= 0) from which it is over the
            threshold; both must hold (set one to 0 to use the other alone).
            The defaults stay quiet on the jitter of workers sharing a busy
            host; lower them on dedicated machines to catch smaller lags.
        patience: reports in a row (>= 1) a worker must be over the
            thresholds to be named the straggler (and warned about).
        log_dir: directory for TensorBoard event files (chief only), optional.

    Raises:
        ValueError: for a non-positive `every` or `patience`, a negative or
            non-finite `threshold` or `min_lag`, or both 0.

    Example:

    >>> import keras, numpy as np, tfdist
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> stats = tfdist.callbacks.StepStats(every=4)
    >>> history = model.fit(np.ones((16, 3)), np.ones((16, 1)), batch_size=2, verbose=0, callbacks=[stats])
    >>> [(r.step, r.steps, r.units[0].split(" ")[0], r.straggler) for r in stats.history]
    [(4, 3, 'replica', None), (8, 4, 'replica', None)]
    >>> sorted(k for k in history.history if k.startswith("slowest"))
    ['slowest_replica', 'slowest_replica_lag_ms']
    """

    def __init__(
        self,
        *,
        every: int = 100,
        threshold: float = 0.2,
        min_lag: float = 0.005,
        patience: int = 3,
        log_dir: str | os.PathLike | None = None,
    ):
        super().__init__()
        _validate.integer("every", every)
        _validate.integer("patience", patience)
        for name, value, expected in (
            ("threshold", threshold, "a fraction of the step time >= 0 (e.g. 0.2)"),
            ("min_lag", min_lag, "seconds >= 0 (e.g. 0.005)"),
        ):
            if not _validate.is_number(value) or not 0 <= value < float("inf"):
                raise _validate.invalid(name, value, expected)
        if threshold == 0 and min_lag == 0:
            raise ValueError(
                "Invalid values for arguments `threshold` and `min_lag`. Received: threshold=0, min_lag=0: every "
                "report would flag its slowest worker. Expected at least one of them above 0 (defaults: "
                "threshold=0.2, min_lag=0.005)."
            )
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise _validate.invalid("log_dir", log_dir, "a directory path (str or os.PathLike) or None")
        self.every = every
        self.threshold = float(threshold)
        self.min_lag = float(min_lag)
        self.patience = patience
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.history: list[StepReport] = []
        self._timer: _step_timing.StepTimer | None = None
        self._writer = None
        self._episodes = _Episodes(patience)

    # ---------------------------------------------------------------- fit
    def set_model(self, model):
        super().set_model(model)
        if not getattr(model, "compiled", False):
            return  # fit compiles first; evaluate/predict of an uncompiled model train nothing
        if self._timer is None or self._timer.model is not model:
            # Rows per report: one per step (per micro-batch under PipelineStrategy: room for 2).
            capacity = min(2 * self.every * max(1, int(model.steps_per_execution)), 4096)
            self._timer = _step_timing.StepTimer(model, capacity=capacity)
        self._timer.attach()

    def on_train_begin(self, logs=None):
        model = self.model
        if self._timer is None or self._timer.model is not model:
            self.set_model(model)
        self._timer.activate()
        strategy = model.distribute_strategy
        self._where = topology.of(strategy)
        self._addresses = _addresses(strategy, self._where.num_workers)
        if self._where.num_workers > 1:  # traces the all-gather now (every worker), not in the first report
            _workers.all_gather_rows(strategy, np.zeros(len(COLUMNS)))
        self._steps, self._calls, self._batch_begin = 0, 0, 0
        self._latest: dict[str, float] = {}
        self._episodes = _Episodes(self.patience)
        self._writer = None
        if self.log_dir and self._where.is_chief:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        if model.jit_compile and not model.run_eagerly:
            warnings.warn(
                f"tfdist StepStats: model {model.name!r} is compiled with jit_compile=True; a step compiled with "
                "XLA cannot hold StepStats' timestamps, so only step times are reported and no straggler is "
                "named. Compile with jit_compile=False to see the input and collective waits.",
                stacklevel=2,
            )

    def on_train_batch_begin(self, batch, logs=None):
        self._batch_begin = batch

    def on_train_batch_end(self, batch, logs=None):
        steps = max(1, batch - self._batch_begin + 1)
        self._timer.note_steps(steps)
        self._calls += 1
        before, self._steps = self._steps, self._steps + steps
        if self._steps // self.every > before // self.every:
            self._report()
        if logs is not None:
            logs.update(self._latest)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs.update(self._latest)

    def on_train_end(self, logs=None):
        self._timer.deactivate()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    # ---------------------------------------------------------------- reports
    def _report(self) -> StepReport:
        """Reports the steps since the last report (a collective: every worker calls it at the same step).

        Raises:
            tfdist.CompatError: when `fit` ran steps that StepStats' train
                function did not time (Keras no longer calls it).
        """
        strategy = self.model.distribute_strategy
        samples = self._timer.take()  # [local units, calls, 4]
        if self._calls > 1 and not self._timer.calls_timed:
            raise errors.CompatError(
                "tfdist StepStats: fit ran steps without calling the train function StepStats put in "
                "model.train_function (Keras or another callback replaced it after set_model); nothing was timed."
            )
        local = _median(samples, axis=1)  # [local units, 4]
        where = self._where
        if where.num_workers > 1:
            own = summarize(local, threshold=self.threshold, min_lag=self.min_lag).own_time
            row = local[int(np.nanargmax(own))] if np.isfinite(own).any() else local[0]
            table = _workers.all_gather_rows(strategy, row)
            kind = "worker"
            units = tuple(
                f"worker {i}" + (f" ({a})" if a else "") for i, a in enumerate(self._addresses)
            )
        elif self._timer.in_step:
            table, kind = local, "replica"
            units = tuple(f"replica {i} ({device})" for i, device in enumerate(self._timer.units))
        else:
            table, kind = local, "worker"
            units = ("worker 0" + (f" ({self._addresses[0]})" if self._addresses[0] else ""),)
        step = int(self.model.optimizer.iterations.numpy()) if self.model.optimizer is not None else self._steps
        return self._add_report(table, step=step, steps=samples.shape[1], kind=kind, units=units)

    def _add_report(self, table, *, step: int, steps: int, kind: str, units: tuple[str, ...]) -> StepReport:
        table = np.asarray(table, np.float64).reshape(len(units), len(COLUMNS))
        summary = summarize(table, threshold=self.threshold, min_lag=self.min_lag)
        straggler, warn = self._episodes.update(summary.slowest, summary.over_threshold)
        report = StepReport(
            step=step,
            steps=steps,
            kind=kind,
            units=units,
            step_time=table[:, 0],
            input_wait=table[:, 1],
            compute=table[:, 2],
            collective_wait=table[:, 3],
            own_time=summary.own_time,
            slowest=summary.slowest,
            lag=summary.lag,
            lag_fraction=summary.lag_fraction,
            over_threshold=summary.over_threshold,
            straggler=straggler,
        )
        self.history.append(report)
        self._latest = {f"slowest_{kind}": summary.slowest, f"slowest_{kind}_lag_ms": 1e3 * summary.lag}
        if warn and getattr(self, "_where", None) is not None and self._where.is_chief:
            warnings.warn(self.describe(report), StragglerWarning, stacklevel=2)
        self._write(report)
        return report

    def describe(self, report: StepReport) -> str:
        """A report in words: the slowest worker, its lag, and where its time goes."""
        i, kind = report.slowest, report.kind
        others = [j for j in range(len(report.units)) if j != i] or [i]
        parts = {name: getattr(report, name) for name in ("input_wait", "compute", "collective_wait")}
        excess = {name: parts[name][i] - _median(parts[name][others]) for name in ("input_wait", "compute")}
        cause = max(excess, key=lambda name: np.nan_to_num(excess[name], nan=-np.inf))
        hint = {
            "input_wait": "mostly waiting for its input: look at its input pipeline and data (reading, "
            "preprocessing, other load on its host)",
            "compute": "mostly its own compute: look at its devices and host (other load, a slower or throttled "
            "device)",
        }[cause]
        split = ", ".join(f"{name.replace('_', ' ')} {_ms(values[i])}" for name, values in parts.items())
        held = f"for {self.patience} reports in a row" if report.straggler is not None else "in this report"
        return (
            f"tfdist StepStats: {report.units[i]} is the slowest {kind} {held} (to step {report.step}): its own time "
            f"is {_ms(report.own_time[i])} per step, {_ms(report.lag)} more than the median of the other "
            f"{kind}s, who wait for it: {100 * report.lag_fraction:.0f}% of the {_ms(_median(report.step_time))} "
            f"step. Its step: {split}; {hint}."
        )

    def _write(self, report: StepReport) -> None:
        if self._writer is None:
            return
        with self._writer.as_default(step=report.step):
            tf.summary.scalar(f"step_stats/slowest_{report.kind}", report.slowest)
            tf.summary.scalar("step_stats/lag_ms", 1e3 * report.lag)
            tf.summary.scalar("step_stats/lag_fraction", report.lag_fraction)
            for i in range(len(report.units)):
                for name in COLUMNS:
                    tf.summary.scalar(f"step_stats/{report.kind}_{i}/{name}_ms", 1e3 * getattr(report, name)[i])
        self._writer.flush()
