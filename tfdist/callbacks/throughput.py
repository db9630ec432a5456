"""`Throughput`: examples/s, tokens/s, step time and scaling efficiency in logs, progress bar and TensorBoard."""

from __future__ import annotations

import time

import keras
import numpy as np
import tensorflow as tf

from tfdist import _validate
from tfdist.strategies import topology

__all__ = ["Throughput"]


class Throughput(keras.callbacks.Callback):
    """Measures training speed and adds it to the logs.

    Adds to the batch logs (so Keras' progress bar shows them) and to the epoch
    logs (so `History`, `keras.callbacks.TensorBoard` and CSVLogger record
    them):

    - `step_time_ms`: wall time per optimizer step,
    - `examples_per_sec` (global), `examples_per_sec_per_replica`,
    - `tokens_per_sec` when `tokens_per_example` is given,
    - `scaling_efficiency` when `baseline_examples_per_sec` is given:
      examples_per_sec / (baseline x replicas), 1.0 being perfect scaling.

    Epoch values average the epoch's steps, leaving out the first `skip_steps`
    steps of `fit` (tracing and compilation). With `log_dir`, the chief also
    writes every step's and epoch's values as TensorBoard scalars
    (`throughput/<name>`, step = optimizer step). Timing is host wall time
    between step ends; the first step of each epoch is timed from its start.

    Place it before the callbacks that read its keys (MetricAverage,
    TensorBoard); Keras adds its progress bar after the user's callbacks.

    Args:
        batch_size: examples per optimizer step (the global batch).
        tokens_per_example: tokens per example (sequence length), optional.
        baseline_examples_per_sec: the same model's single-device speed,
            optional.
        replicas: the data-parallel size; default: the strategy's replicas in
            sync (the batch axis of a model-parallel mesh).
        skip_steps: steps at the start of `fit` left out of epoch averages.
        log_dir: directory for TensorBoard event files, optional.

    Raises:
        ValueError: for a non-positive `batch_size`, `tokens_per_example`,
            `baseline_examples_per_sec` or `replicas`, or a negative `skip_steps`.

    Example:

    >>> import keras, numpy as np, tfdist
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> speed = tfdist.callbacks.Throughput(batch_size=2, baseline_examples_per_sec=1000.0, skip_steps=1)
    >>> history = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, verbose=0, callbacks=[speed])
    >>> sorted(k for k in history.history if "per_sec" in k or k.endswith(("_ms", "efficiency")))
    ['examples_per_sec', 'examples_per_sec_per_replica', 'scaling_efficiency', 'step_time_ms']
    """

    def __init__(
        self,
        *,
        batch_size: int,
        tokens_per_example: int | None = None,
        baseline_examples_per_sec: float | None = None,
        replicas: int | None = None,
        skip_steps: int = 1,
        log_dir: str | None = None,
    ):
        super().__init__()
        for name, value, optional in (
            ("batch_size", batch_size, False),
            ("tokens_per_example", tokens_per_example, True),
            ("baseline_examples_per_sec", baseline_examples_per_sec, True),
            ("replicas", replicas, True),
        ):
            _validate.positive_number(name, value, allow_none=optional)
        _validate.integer("skip_steps", skip_steps, minimum=0)
        self.batch_size = batch_size
        self.tokens_per_example = tokens_per_example
        self.baseline_examples_per_sec = baseline_examples_per_sec
        self.replicas = replicas
        self.skip_steps = skip_steps
        self.log_dir = log_dir
        self._writer = None

    def on_train_begin(self, logs=None):
        strategy = self.model.distribute_strategy
        where = topology.of(strategy)
        self._replicas = self.replicas or where.data_parallel_size
        self._steps_seen = 0
        self._writer = None
        if self.log_dir and where.is_chief:
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_times, self._epoch_steps = [], []
        self._last = None

    def on_train_batch_begin(self, batch, logs=None):
        if self._last is None:
            self._last = time.perf_counter()

    def _rates(self, seconds: float, steps: int) -> dict:
        examples = self.batch_size * steps / seconds
        rates = {
            "step_time_ms": 1000.0 * seconds / steps,
            "examples_per_sec": examples,
            "examples_per_sec_per_replica": examples / self._replicas,
        }
        if self.tokens_per_example:
            rates["tokens_per_sec"] = examples * self.tokens_per_example
        if self.baseline_examples_per_sec:
            rates["scaling_efficiency"] = examples / (self.baseline_examples_per_sec * self._replicas)
        return rates

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        steps = max(1, int(self.model.steps_per_execution))
        self._steps_seen += steps
        rates = self._rates(max(seconds, 1e-9), steps)
        if logs is not None:
            logs.update(rates)
        if self._steps_seen > self.skip_steps:
            self._epoch_times.append(seconds)
            self._epoch_steps.append(steps)
        self._write(rates, "step")

    def on_epoch_end(self, epoch, logs=None):
        if not self._epoch_times:
            return
        rates = self._rates(max(float(np.sum(self._epoch_times)), 1e-9), int(np.sum(self._epoch_steps)))
        if logs is not None:
            logs.update(rates)
        self._write(rates, "epoch")

    def _write(self, rates, kind):
        if self._writer is None:
            return
        step = int(self.model.optimizer.iterations.numpy())
        with self._writer.as_default(step=step):
            for name, value in rates.items():
                tf.summary.scalar(f"throughput/{kind}_{name}", value)
        if kind == "epoch":
            self._writer.flush()

    def on_train_end(self, logs=None):
        if self._writer is not None:
            self._writer.close()
            self._writer = None
