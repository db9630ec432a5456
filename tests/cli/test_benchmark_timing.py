"""benchmarks._timing: step times from batch ends inside `fit`, not from a `fit()` call's wall time."""

import statistics
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from benchmarks import _timing

pytestmark = pytest.mark.serial  # compares step times with sleeps of 1 s

SLEEP = 1.0


class SlowEnd(keras.callbacks.Callback):
    """Work inside `fit` after its last step (as tf.data autotuning or a callback's train end can be)."""

    def on_epoch_end(self, epoch, logs=None):
        time.sleep(SLEEP)

    def on_train_end(self, logs=None):
        time.sleep(SLEEP)


def test_step_times_exclude_work_after_the_last_step_and_the_warm_up():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    data = tf.data.Dataset.from_tensor_slices((np.ones((8, 4), "float32"), np.ones((8, 3), "float32")))
    start = time.perf_counter()
    times = _timing.fit_step_times(model, data.batch(4).repeat(), steps=6, warmup=2, callbacks=[SlowEnd()])
    wall = time.perf_counter() - start
    assert len(times) == 6
    # The 2 s of train-end work (and the first step's tracing) are in the fit() wall time, in no step time.
    assert wall > 2 * SLEEP and max(times) < SLEEP / 2, (wall, times)
    assert wall / 8 > 5 * statistics.median(times)  # what wall time / steps would have reported is far off


class SlowBatch(keras.callbacks.Callback):
    """One slow step after the warm-up (a pause of the shared host)."""

    def on_train_batch_begin(self, batch, logs=None):
        if batch == 4:
            time.sleep(SLEEP)


def test_step_time_is_the_median_step_not_the_mean_and_arrays_are_timed_like_datasets():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((40, 4), "float32"), np.ones((40, 3), "float32")
    times = _timing.fit_step_times(model, x, y, steps=6, warmup=2, batch_size=4, callbacks=[SlowBatch()])
    assert len(times) == 6 and max(times) > SLEEP > 5 * statistics.median(times), times  # the pause is in one step
    median = _timing.step_time(model, x, y, steps=6, warmup=2, batch_size=4, callbacks=[SlowBatch()])
    assert median < SLEEP / 10  # the mean (a sum over the steps / 6) would be over SLEEP / 6
    with pytest.raises(ValueError, match="need 32 rows"):
        _timing.fit_step_times(model, x[:20], y[:20], steps=6, warmup=2, batch_size=4)


def test_interleaved_changes_the_order_round_by_round_and_keeps_each_variants_results_in_round_order():
    calls = []

    def variant(name):
        def run():
            calls.append(name)
            return f"{name}{sum(c == name for c in calls)}"

        return run

    out = _timing.interleaved({n: variant(n) for n in "abc"}, rounds=7)
    assert calls == list("abc" "bca" "cab" "cba" "acb" "bac" "abc")
    assert out["a"] == ["a1", "a2", "a3", "a4", "a5", "a6", "a7"] and out["c"][:2] == ["c1", "c2"]
    calls.clear()
    _timing.interleaved({n: variant(n) for n in "ab"}, rounds=3)
    assert calls == list("ab" "ba" "ab")


def test_round_medians_and_round_ratios_reduce_each_round_of_calls_to_one_figure():
    # Calls k of a and b ran side by side: a slow spell (calls 1 and 2 here) slows both, the ratio stays 2.
    a = [2.0, 20.0, 20.0, 2.0, 2.0, 2.0]
    b = [1.0, 10.0, 10.0, 1.0, 1.0, 1.0]
    assert _timing.round_medians(a, per_round=3) == [20.0, 2.0]
    assert _timing.round_ratios(a, b, per_round=3) == [2.0, 2.0]
    # The median of the call-by-call ratios (4, 1, 2), not the ratio of the medians (4) or of the means (2.125).
    assert _timing.round_ratios([4.0, 1.0, 12.0], [1.0, 1.0, 6.0], per_round=3) == [2.0]
    with pytest.raises(ValueError, match="not the same rounds"):
        _timing.round_ratios([1.0, 2.0], [1.0], per_round=1)
    assert _timing.intervals([0.0, 5.0, 5.5, 6.5], warmup=2) == [0.5, 1.0]


def test_orders_are_balanced_every_variant_in_every_place_and_after_every_other_equally_often():
    for n in range(2, 8):
        rows = _timing.orders(n)
        assert all(sorted(row) == list(range(n)) for row in rows), (n, rows)
        places = {(row[i], i) for row in rows for i in range(n)}
        after = [(row[i], row[i + 1]) for row in rows for i in range(n - 1)]
        assert len(places) == n * n and all(after.count(a) == after.count(after[0]) for a in after), (n, rows)
        assert len(set(after)) == n * (n - 1), (n, rows)  # every ordered pair occurs


def test_reproduce_matches_figures_across_runs_by_their_stable_name():
    from benchmarks import reproduce

    def fig(name, median, lo, hi, rounds=5):
        return {"figure": name, "median": median, "min": lo, "max": hi, "rounds": rounds}

    earlier = {
        "All-reduce": {"date": "d1", "figures": [fig("busbw auto / best (ring), N=2", 1.0, 0.9, 1.1)]},
        "Sizes": {"date": "d1", "figures": [fig("bytes / ideal", 1.03, 1.03, 1.03, rounds=1)]},
    }
    now = {
        "All-reduce": {"date": "d2", "figures": [fig("busbw auto / best (hierarchical), N=2", 1.2, 1.1, 1.3)]},
        "Sizes": {"date": "d2", "figures": [fig("bytes / ideal", 1.04, 1.04, 1.04, rounds=1)]},
        "New": {"date": "d2", "figures": [fig("new figure", 1.0, 1.0, 1.0)]},
    }
    table = {(section, name): (old is not None, ok) for section, name, old, _, ok in reproduce.rows(earlier, now)}
    # Matched although the best choice differs between runs; 1.2 is outside the earlier 0.9-1.1.
    assert table[("All-reduce", "busbw auto / best (hierarchical), N=2")] == (True, False)
    assert table[("Sizes", "bytes / ideal")] == (True, True)  # one value: within 2%
    assert table[("New", "new figure")] == (False, None)
    assert reproduce.reproduces(earlier["All-reduce"]["figures"][0], fig("x", 1.05, 0, 9))
