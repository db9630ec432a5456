"""Step times measured inside `fit`: the intervals between batch ends after a warm-up.

A whole `fit()` call's wall time divided by its steps is not a step time: on the TensorFlow
backend up to seconds can pass inside `fit` after the last step (tf.data autotuning winding
down, the iterator's teardown, callbacks' `on_train_end`), and before the first one (building
the iterator, tracing). `fit_step_times` times only the steps: each figure is the time from one
batch end to the next, after `warmup` steps.
"""

from __future__ import annotations

import time


def step_clock():
    """A Keras callback recording `time.perf_counter()` at every training batch end (`.ends`)."""
    import keras

    class StepClock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends: list[float] = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    return StepClock()


def intervals(ends: list[float], warmup: int) -> list[float]:
    """Seconds between consecutive batch ends, from the end of step `warmup` on.

    Example:

    >>> intervals([0.0, 5.0, 5.5, 6.5], warmup=1)
    [0.5, 1.0]
    """
    kept = ends[max(warmup - 1, 0) :] if warmup else ends
    return [b - a for a, b in zip(kept, kept[1:])]


def fit_step_times(model, dataset, *, steps: int, warmup: int = 2, callbacks=()) -> list[float]:
    """Seconds per training step of `model.fit(dataset)`, one figure per step after `warmup` steps.

    Runs one epoch of `warmup + steps` steps (the dataset must have that many batches, e.g.
    `.repeat()`); `steps_per_execution` must be 1 for one batch end per step.
    """
    clock = step_clock()
    model.fit(
        dataset, steps_per_epoch=warmup + steps, epochs=1, verbose=0, shuffle=False, callbacks=[*callbacks, clock]
    )
    return intervals(clock.ends, warmup)
