"""Asserted by tests/strategies/test_multi_worker_soak.py.

A long multi-worker run that records this worker's threads and memory (run as a script, one per worker).

Usage: python tests/scenarios/multi_worker_soak_threads_memory.py OUT_PREFIX STEPS EPOCHS [native_timeout]
Writes OUT_PREFIX<rank>.json: threads and RSS at some optimizer steps, and the epoch losses.
Default: Keras `fit` (with validation) under tfdist.MultiWorkerStrategy. With `native_timeout`:
a custom loop of all-reduces under plain MultiWorkerMirroredStrategy with TensorFlow's own
collective timeout (the control; Keras `fit` does not run under plain MWMS).
"""

import json
import os
import sys
import time

OUT, STEPS, EPOCHS = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
NATIVE = sys.argv[4:] == ["native_timeout"]

if NATIVE:
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(timeout_seconds=300)
    )
else:
    import tfdist

    strategy = tfdist.MultiWorkerStrategy(timeout=300)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def sample() -> dict:
    with open("/proc/self/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"threads": len(os.listdir("/proc/self/task")), "rss_mib": rss_kib / 1024, "time": time.time()}


def due(step: int) -> bool:
    return step in (50, 250) or step % 500 == 0 or step == STEPS


samples, losses = {}, []
if NATIVE:

    @tf.function
    def step_fn(x):
        def replica(x):
            ctx = tf.distribute.get_replica_context()
            y = x + tf.cast(ctx.replica_id_in_sync_group, tf.float32)
            return ctx.all_reduce("sum", y) + ctx.all_reduce("sum", 2 * y)

        return strategy.run(replica, args=(x,))

    x = tf.ones([4])
    for step in range(1, STEPS + 1):
        step_fn(x)
        if due(step):
            samples[step] = sample()
else:

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if due(step):
                samples[step] = sample()

    per_epoch = STEPS // EPOCHS
    rng = np.random.default_rng(0)
    x = rng.normal(size=(per_epoch * 8, 16)).astype("float32")
    y = (x @ rng.normal(size=(16, 1))).astype("float32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", metrics=["mae"])
    history = model.fit(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8),
        epochs=EPOCHS,
        validation_data=(x[:64], y[:64]),
        verbose=0,
        callbacks=[Record()],
    )
    losses = history.history["loss"]

rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
with open(f"{OUT}{rank}.json", "w") as f:
    json.dump({"samples": samples, "loss": losses}, f)
print("done", flush=True)
