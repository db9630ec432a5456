"""Asserted by tests/cli/test_multi_worker_signals.py.

A multi-worker `fit` with tfdist's BackupAndRestore that waits to be preempted (run as a script).

Usage: python tests/scenarios/two_worker_preemption_backup.py BACKUP_DIR
Prints "training" once a few steps ran; every step then takes ~20 ms, for up to 10,000 steps.
"""

import sys
import time

import tfdist

strategy = tfdist.MultiWorkerStrategy(timeout=60)

import keras  # noqa: E402
import numpy as np  # noqa: E402


class Slow(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3:
            print("training", flush=True)
        time.sleep(0.02)


with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
x = np.ones((10000 * 4, 4), "float32")
backup = tfdist.callbacks.BackupAndRestore(sys.argv[1], save_freq=100000, delete_checkpoint=False)
model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0, callbacks=[backup, Slow()])
print("fit ended without preemption", flush=True)
