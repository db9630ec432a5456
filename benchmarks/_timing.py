"""Step times measured inside `fit`: the intervals between batch ends after a warm-up.

A whole `fit()` call's wall time divided by its steps is not a step time: on the TensorFlow
backend up to seconds can pass inside `fit` after the last step (tf.data autotuning winding
down, the iterator's teardown, callbacks' `on_train_end`), and before the first one (building
the iterator, tracing). `fit_step_times` times only the steps: each figure is the time from one
batch end to the next, after `warmup` steps. `step_time` is their median (one slow step, e.g. a
pause of the shared host, does not move it as it would a sum). `interleaved` runs the variants
a benchmark compares in rounds, the order changing from round to round (`orders`); `round_medians` and
`round_ratios` reduce many short calls per round (each variant's, interleaved call by call) to one
figure per round.

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
    """Seconds between consecutive batch ends, from the end of step `warmup` on (steps `warmup` + 1, ...).

    Example (the first step's end is at 0.0; with warmup=2 the second step, 5 s, is left out too):

    >>> intervals([0.0, 5.0, 5.5, 6.5], warmup=2)
    [0.5, 1.0]
    >>> intervals([0.0, 5.0, 5.5, 6.5], warmup=1)
    [5.0, 0.5, 1.0]
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


def orders(n: int) -> list[list[int]]:
    """The orders in which `interleaved` runs n variants, turn after turn: a balanced Latin square (Williams).

    Every variant comes first, second, ... equally often, and right after every other variant
    equally often (with a rotation alone, each would always follow the same one: whatever that
    one leaves behind, e.g. caches or memory it filled, would weigh on it every time). For odd n
    the rotations are followed by their reverses.

    Example:

    >>> orders(2)
    [[0, 1], [1, 0]]
    >>> orders(4)
    [[0, 1, 3, 2], [1, 2, 0, 3], [2, 3, 1, 0], [3, 0, 2, 1]]
    """
    first, low, high = [0], 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(i + r) % n for i in first] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 and n > 1 else rows


def interleaved(variants: dict, rounds: int) -> dict[str, list]:
    """Calls every variant (name -> function of no arguments) once per round; each one's results in round order.

    Round r runs them in the order `orders(n)[r % len(orders(n))]` (with two, the order
    alternates), so that a slow spell of a shared host, or whatever the variant before leaves
    behind, weighs on all of them alike, and a figure of one round can be set against the others'
    of the same round (a ratio per round).
    """
    names = list(variants)
    out = {name: [] for name in names}
    rows = orders(len(names))
    for r in range(rounds):
        for i in rows[r % len(rows)]:
            out[names[i]].append(variants[names[i]]())
    return out


def round_medians(values: list[float], per_round: int) -> list[float]:
    """The median of each round of `per_round` consecutive values (e.g. one variant's call times).

    Example:

    >>> round_medians([1.0, 9.0, 2.0, 3.0, 4.0, 5.0], per_round=3)
    [2.0, 4.0]
    """
    return [statistics.median(values[i : i + per_round]) for i in range(0, len(values), per_round)]


def round_ratios(a: list[float], b: list[float], per_round: int) -> list[float]:
    """Per round of `per_round` calls: the median of a[k] / b[k], call k of `a` set against call k of `b`.

    For two variants' call times from `interleaved` (one call each per turn): calls k of both ran
    next to each other, so their ratio is free of whatever the host did at another moment of the
    round (a spell of other work on the cores slows both).

    Example:

    >>> round_ratios([2.0, 8.0, 3.0, 1.0], [1.0, 4.0, 1.0, 1.0], per_round=2)
    [2.0, 2.0]
    """
    if len(a) != len(b):
        raise ValueError(f"{len(a)} and {len(b)} calls: not the same rounds")
    return round_medians([x / y for x, y in zip(a, b)], per_round)
