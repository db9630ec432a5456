"""Asserted by tests/callbacks/test_callbacks.py.

tfdist.callbacks under ModelParallelStrategy, in a fresh process (run as a script, not by pytest).

Usage: python tests/scenarios/callbacks_under_model_parallel.py OUT_DIR. A DTensor runtime error poisons its
process, so this runs alone, on 4 simulated CPUs (mesh batch=2 x model=2, MLP kernels split by the transformer
preset), and writes its numbers to OUT_DIR/result.json for tests/callbacks/test_callbacks.py.
"""

import dataclasses
import json
import os
import sys

import tfdist

tfdist.simulate_devices(4)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdist.callbacks  # noqa: E402
from tfdist.strategies import topology  # noqa: E402

OUT = sys.argv[1]
RESULT = {}
rng = np.random.default_rng(0)
x = rng.normal(size=(40, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1)) + 0.1).astype("float32")
strategy = tfdist.ModelParallelStrategy(mesh={"batch": 2, "model": 2}, rules=tfdist.layouts.transformer())
RESULT["topology"] = dataclasses.asdict(topology.of(strategy))


class Crash(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == 7:
            raise KeyboardInterrupt("simulated crash after step 7")


def make_model():
    keras.utils.set_random_seed(1)
    with strategy.scope():
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="tanh", name="mlp_in")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1, name="mlp_out")(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    return model


def fit(model, callbacks):
    return model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)


reference = make_model()
RESULT["kernel_layout"] = str(reference.layers[1].kernel.value.layout.sharding_specs)
check = tfdist.callbacks.SyncCheck(every_n_steps=2)
speed = tfdist.callbacks.Throughput(batch_size=8)
ckpt_dir = os.path.join(OUT, "ckpt")
history = fit(reference, [check, speed, tfdist.callbacks.Checkpoint(ckpt_dir, every_n_steps=5, keep=2)])
RESULT["sync_checks"] = check.checks
RESULT["replicas"] = speed._replicas
RESULT["checkpoints"] = sorted(os.listdir(ckpt_dir))

backup_dir = os.path.join(OUT, "backup")
crashed = make_model()
try:
    fit(crashed, [Crash(), tfdist.callbacks.BackupAndRestore(backup_dir, save_freq=2)])
except KeyboardInterrupt:
    RESULT["backups_after_crash"] = sorted(os.listdir(os.path.join(backup_dir, "worker-0")))
resumed = make_model()
backup = tfdist.callbacks.BackupAndRestore(backup_dir, save_freq=2)
fit(resumed, [backup])
RESULT["restored_step"] = backup.restored_step
RESULT["resume_max_diff"] = max(
    float(np.abs(a - b).max()) for a, b in zip(resumed.get_weights(), reference.get_weights())
)

# The latest checkpoint (step 15) loads into a fresh sharded model and equals the trained one.
fresh = make_model()
meta = tfdist.callbacks.restore_checkpoint(fresh, ckpt_dir)
RESULT["restored_checkpoint_step"] = meta["step"]
RESULT["checkpoint_max_diff"] = max(
    float(np.abs(a - b).max()) for a, b in zip(fresh.get_weights(), reference.get_weights())
)
RESULT["restored_kernel_layout"] = str(fresh.layers[1].kernel.value.layout.sharding_specs)

# LearningRateWarmup scales by the batch axis (2): 0.05 -> 0.1 after 3 steps.
warm = make_model()
fit(warm, [tfdist.callbacks.LearningRateWarmup(warmup_steps=3)])
RESULT["warmup_final_lr"] = float(np.asarray(warm.optimizer.learning_rate.numpy()))

# A NaN in the sharded kernel of mlp_in: SyncCheck names the variable.
kernel = fresh.layers[1].kernel
kernel.assign(np.where(np.arange(kernel.shape[1]) == 3, np.nan, kernel.numpy()).astype("float32"))
check = tfdist.callbacks.SyncCheck(every_n_steps=1)
check.set_model(fresh)
try:
    check.check(step=15)
except tfdist.callbacks.SyncError as e:
    RESULT["sync_error"] = str(e)
with open(os.path.join(OUT, "result.json"), "w") as f:
    json.dump(RESULT, f)
print("done", flush=True)
