"""Asserted by tests/callbacks/test_multi_worker_keras_callbacks.py.

A worker for the tests of Keras' own file callbacks on several workers (a script, not collected by pytest).

Usage: python tests/scenarios/keras_file_callbacks_two_workers.py OUT.npz [key=value ...]
TensorFlow's multi_worker_with_keras tutorial shape: a small CNN on 28x28x1 inputs under
tfdist.MultiWorkerStrategy from TF_CONFIG (single=1: one process, no strategy). Options:
backup=DIR (keras.callbacks.BackupAndRestore there; backup0=/backup1= per worker), keep=1
(delete_checkpoint=False), checkpoint=DIR (keras.callbacks.ModelCheckpoint of the weights after every
epoch and of the whole model), own=DIR (a ModelCheckpoint in DIR/w<worker index>), die_epoch=N (worker 1
exits 17 when epoch N begins), epochs.
"""

import os
import sys

import numpy as np

OUT = sys.argv[1]
OPTS = dict(a.split("=", 1) for a in sys.argv[2:])
EPOCHS = int(OPTS.get("epochs", 5))

import tfdist  # noqa: E402

if OPTS.get("single"):
    import tensorflow as tf

    strategy, rank = tf.distribute.get_strategy(), 0
else:
    strategy = tfdist.MultiWorkerStrategy(timeout=60, heartbeat_timeout=5, join_timeout=60)
    rank = strategy.cluster.rank

import keras  # noqa: E402

rng = np.random.default_rng(0)
x = rng.normal(size=(48, 28, 28, 1)).astype("float32")
y = rng.integers(0, 10, size=(48,)).astype("int64")


class Die(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if rank == 1 and epoch == int(OPTS.get("die_epoch", -1)):
            print(f"worker 1 exits at epoch {epoch}", flush=True)
            os._exit(17)


keras.utils.set_random_seed(1)
with strategy.scope():
    model = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
callbacks = [Die()]
backup = OPTS.get(f"backup{rank}", OPTS.get("backup"))
if backup:
    callbacks.append(keras.callbacks.BackupAndRestore(backup, delete_checkpoint=not OPTS.get("keep")))
if OPTS.get("checkpoint"):
    directory = OPTS["checkpoint"]
    callbacks.append(
        keras.callbacks.ModelCheckpoint(os.path.join(directory, "e{epoch:02d}.weights.h5"), save_weights_only=True)
    )
    callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(directory, "model.keras")))
if OPTS.get("own"):
    callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(OPTS["own"], f"w{rank}", "model.keras")))
history = model.fit(x, y, batch_size=16, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
np.savez(OUT, *model.get_weights(), epochs=np.array(history.epoch), loss=np.array(history.history["loss"]))
print("done", flush=True)
