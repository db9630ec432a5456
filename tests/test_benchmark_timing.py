"""benchmarks._timing: step times from batch ends inside `fit`, not from a `fit()` call's wall time."""

import statistics
import time

import keras
import numpy as np
import tensorflow as tf

from benchmarks import _timing

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
