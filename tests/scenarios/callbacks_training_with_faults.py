"""Asserted by tests/callbacks/test_callbacks_fault.py.

A training process for the callback fault tests (run as a script, not collected by pytest).

Usage: python tests/scenarios/callbacks_training_with_faults.py OUT.npz MODE [key=value ...]
MODE: "single" (no strategy: the uninterrupted reference), "data" (DataParallelStrategy over 2 simulated
CPUs), "multi" (MultiWorkerStrategy from TF_CONFIG). Options: backup=DIR (BackupAndRestore there),
save_freq, epochs, crash_at=STEP (os._exit(17) after that optimizer step, on worker crash_rank),
term_at=STEP (print "waiting for SIGTERM" after that step and wait for it, on worker term_rank),
tfdata=plain|shuffle|repeat, shuffle=1, sync=1 (SyncCheck), diverge_at=STEP (worker 1 changes a weight),
ckpt=DIR (also SyncCheck, Throughput, MetricAverage and a Checkpoint in DIR).
"""

import os
import sys
import time

import numpy as np

OUT, MODE = sys.argv[1], sys.argv[2]
OPTS = dict(a.split("=", 1) for a in sys.argv[3:])
EPOCHS = int(OPTS.get("epochs", 3))

import tfdist  # noqa: E402

if MODE == "multi":
    strategy = tfdist.MultiWorkerStrategy(timeout=60, heartbeat_timeout=5, join_timeout=60)
    rank = strategy.cluster.rank
else:
    rank = 0
    if MODE == "data":
        tfdist.simulate_devices(2)
        strategy = tfdist.DataParallelStrategy()
    else:
        import tensorflow as tf

        strategy = tf.distribute.get_strategy()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist.callbacks  # noqa: E402
from tfdist.strategies import topology  # noqa: E402

print(f"topology {topology.of(strategy)}", flush=True)

rng = np.random.default_rng(0)
x = rng.normal(size=(40, 4)).astype("float32")
y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32") + 0.1).astype("float32")


class Fault(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if rank == 1 and step == int(OPTS.get("diverge_at", -1)):
            kernel = self.model.layers[0].kernel
            kernel.assign(kernel.numpy() + 1e-3)
        if rank == int(OPTS.get("crash_rank", rank)) and step == int(OPTS.get("crash_at", -1)):
            print(f"crashing after step {step}", flush=True)
            os._exit(17)
        if step == int(OPTS.get("term_at", -1)) and rank == int(OPTS.get("term_rank", rank)):
            print(f"waiting for SIGTERM after step {step}", flush=True)
            deadline = time.monotonic() + 60
            while not backup._preemption._signalled and time.monotonic() < deadline:
                time.sleep(0.05)


keras.utils.set_random_seed(1)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse", metrics=["mae"])
callbacks = [Fault()]
backup = None
if "backup" in OPTS:
    save_freq = OPTS.get("save_freq", "epoch")
    backup = tfdist.callbacks.BackupAndRestore(
        OPTS["backup"], save_freq=int(save_freq) if save_freq.isdigit() else save_freq
    )
    callbacks.append(backup)
if "ckpt" in OPTS:  # also the other callbacks, with their collectives, on every worker
    callbacks += [
        tfdist.callbacks.SyncCheck(every_n_steps=2),
        tfdist.callbacks.Throughput(batch_size=8),
        tfdist.callbacks.MetricAverage(),
        tfdist.callbacks.Checkpoint(OPTS["ckpt"], every_n_steps=4, keep=2),
    ]
if OPTS.get("sync"):
    callbacks.append(tfdist.callbacks.SyncCheck(every_n_steps=2))
shuffle = bool(OPTS.get("shuffle"))
if OPTS.get("tfdata"):  # "plain"; "shuffle": reshuffled each iteration; "repeat": reshuffled, repeated
    data = tf.data.Dataset.from_tensor_slices((x, y))
    if OPTS["tfdata"] in ("shuffle", "repeat"):
        data = data.shuffle(40)
    data = data.batch(8)
    if OPTS["tfdata"] == "repeat":
        data = data.repeat()
    steps = 5 if OPTS["tfdata"] == "repeat" else None
    history = model.fit(data, epochs=EPOCHS, steps_per_epoch=steps, verbose=0, callbacks=callbacks)
else:
    history = model.fit(x, y, batch_size=8, epochs=EPOCHS, shuffle=shuffle, verbose=0, callbacks=callbacks)
print(f"restored step {backup and backup.restored_step}", flush=True)
np.savez(
    OUT,
    *model.get_weights(),
    steps=np.array(int(model.optimizer.iterations.numpy())),
    loss=np.array(history.history["loss"]),
    mae=np.array(history.history["mae"]),
    step_time_ms=np.array(history.history.get("step_time_ms", [])),
)
print("done", flush=True)
