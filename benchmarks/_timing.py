"""Step times measured inside `fit`: the intervals between batch ends after a warm-up.

A whole `fit()` call's wall time divided by its steps is not a step time: on the TensorFlow
backend up to seconds can pass inside `fit` after the last step (tf.data autotuning winding
down, the iterator's teardown, callbacks' `on_train_end`), and before the first one (building
the iterator, tracing). `fit_step_times` times only the steps: each figure is the time from one
batch end to the next, after `warmup` steps. `step_time` is their median (one slow step, e.g. a
pause of the shared host, does not move it as it would a sum). `interleaved` runs the variants
a benchmark compares in rounds, the order rotating from round to round.

This module imports only the standard library (and Keras, lazily), so that it also runs under
another backend (benchmarks/_model_parallel_jax.py uses it on JAX).
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
    """Seconds between consecutive batch ends, from the end of step `warmup` on.

    Example:

    >>> intervals([0.0, 5.0, 5.5, 6.5], warmup=1)
    [0.5, 1.0]
    """
    kept = ends[max(warmup - 1, 0) :] if warmup else ends
    return [b - a for a, b in zip(kept, kept[1:])]


def fit_step_times(
    model, x, y=None, *, steps: int, warmup: int = 2, batch_size: int | None = None, callbacks=()
) -> list[float]:
    """Seconds per training step of one epoch of `model.fit`, one figure per step after `warmup` steps.

    `x` is a dataset with at least `warmup + steps` batches (e.g. `.repeat()`), or, with `y` and
    `batch_size`, arrays with at least `(warmup + steps) * batch_size` rows (their first rows are
    used, in order). `steps_per_execution` must be 1 for one batch end per step.

    Raises:
        ValueError: the arrays are too short.
        RuntimeError: `fit` did not run `warmup + steps` steps.
    """
    clock = step_clock()
    fit = {"epochs": 1, "verbose": 0, "shuffle": False, "callbacks": [*callbacks, clock]}
    if y is None:
        model.fit(x, steps_per_epoch=warmup + steps, **fit)
    else:
        rows = (warmup + steps) * batch_size
        if len(x) < rows or len(y) < rows:
            raise ValueError(f"{warmup} + {steps} steps of {batch_size} need {rows} rows; got {len(x)}")
        model.fit(x[:rows], y[:rows], batch_size=batch_size, **fit)
    if len(clock.ends) != warmup + steps:
        raise RuntimeError(f"fit ran {len(clock.ends)} steps, not {warmup} + {steps}")
    return intervals(clock.ends, warmup)


def step_time(model, x, y=None, **kwargs) -> float:
    """The median of `fit_step_times(model, x, y, **kwargs)`: seconds per step, one figure for one round."""
    return statistics.median(fit_step_times(model, x, y, **kwargs))


def interleaved(variants: dict, rounds: int) -> dict[str, list]:
    """Calls every variant (name -> function of no arguments) once per round; each one's results in round order.

    Round r starts at the (r mod n)-th of the n variants and goes round (a, b, c; b, c, a; c, a, b;
    ...; with two, the order alternates), so that a slow spell of a shared host, or whatever the
    variant before leaves behind, weighs on all of them alike, and a figure of one round can be
    set against the others' of the same round (a ratio per round).
    """
    names = list(variants)
    out = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            out[name].append(variants[name]())
    return out
