"""Step times measured inside `fit`: the intervals between batch ends after a warm-up.

A whole `fit()` call's wall time divided by its steps is not a step time: on the TensorFlow
backend up to seconds can pass inside `fit` after the last step (tf.data autotuning winding
down, the iterator's teardown, callbacks' `on_train_end`), and before the first one (building
the iterator, tracing). Here each figure is the time from one batch end to the next, after a
warm-up; `interleaved_step_times` compares models in rounds that alternate between them, so
that a slow spell of a shared host weighs on all of them alike.
"""

from __future__ import annotations

import statistics
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
    """Seconds between consecutive batch ends, from the end of step `warmup` on: steps `warmup + 1` onwards.

    Example: the ends of steps 1 to 4 (the first traced; the second still slow).

    >>> intervals([4.0, 5.0, 5.5, 6.0], warmup=1)
    [1.0, 0.5, 0.5]
    >>> intervals([4.0, 5.0, 5.5, 6.0], warmup=2)
    [0.5, 0.5]
    """
    kept = ends[max(warmup - 1, 0) :]
    return [b - a for a, b in zip(kept, kept[1:])]


def interleaved_step_times(models: dict, dataset, *, rounds: int, steps: int, warmup: int = 2) -> dict:
    """Median seconds per training step of each `name: model` of `models`, their rounds interleaved.

    Each round runs one `fit` epoch of `warmup + steps` steps of every model, in an order that
    rotates from round to round, and keeps the `steps` intervals between batch ends after the
    first `warmup` steps (tracing and the iterator's start-up fall in those). The models train:
    their weights and optimizer state change.

    Args:
        models: compiled Keras models by name, with `steps_per_execution` 1 (one batch end per step).
        dataset: what each `fit` reads; it must hold `warmup + steps` batches (e.g. `.repeat()`).
        rounds: rounds per model, at least 1.
        steps: steps timed per round, at least 1.
        warmup: steps run before the timed ones in each round, at least 1.

    Returns:
        `{name: median seconds per step}` over all rounds' intervals.

    Raises:
        ValueError: for fewer than 1 round, 1 step or 1 warm-up step.

    Example:

    >>> import keras, numpy as np, tensorflow as tf
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> data = tf.data.Dataset.from_tensors((np.ones((8, 4)), np.ones((8, 1)))).repeat()
    >>> times = interleaved_step_times({"dense": model}, data, rounds=2, steps=3)
    >>> 0 < times["dense"] < 1
    True
    """
    from tfdist import _validate

    _validate.integer("rounds", rounds, where=" of interleaved_step_times()")
    _validate.integer("steps", steps, where=" of interleaved_step_times()")
    _validate.integer("warmup", warmup, where=" of interleaved_step_times()")
    names = list(models)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            clock = step_clock()
            models[name].fit(
                dataset, epochs=1, steps_per_epoch=warmup + steps, verbose=0, shuffle=False, callbacks=[clock]
            )
            times[name] += intervals(clock.ends, warmup)
    return {name: statistics.median(t) for name, t in times.items()}
