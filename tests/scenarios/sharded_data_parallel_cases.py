"""Asserted by tests/strategies/test_sharded_data_parallel.py.

ShardedDataParallelStrategy scenarios in a fresh process (run as a script, not collected by pytest).

Usage: python tests/scenarios/sharded_data_parallel_cases.py DEVICES OUT_DIR [CHECKPOINT_DIR]

Simulates DEVICES CPUs. Without CHECKPOINT_DIR: for each model (MLP under SGD with momentum and clipnorm,
CNN with BatchNorm under Adam with global_clipnorm and gradient_accumulation_steps, transformer_lm, a
subclassed model) and each shard mode, trains once on one device (no
strategy) and once sharded, from the same seed on the same 102 examples in batches of 16 (the last batch,
6 examples, splits over neither 4 nor 8 devices), and measures the persistent bytes per device of
transformer_lm(d_model=256); with 8 devices it also trains on a 2-D mesh, saves checkpoints to
OUT_DIR/ckpt and resumes an interrupted run with BackupAndRestore, with 4 it trains under mixed_bfloat16.
With CHECKPOINT_DIR: loads those checkpoints onto DEVICES devices and onto one device. Numbers go to
OUT_DIR/result.json for tests/strategies/test_sharded_data_parallel.py.
"""

import json
import os
import re
import sys

import tfdist

DEVICES, OUT = int(sys.argv[1]), sys.argv[2]
CHECKPOINT = sys.argv[3] if len(sys.argv) > 3 else None
tfdist.simulate_devices(DEVICES)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tfdist.callbacks  # noqa: E402
from tfdist import layouts  # noqa: E402
from tfdist import models  # noqa: E402

MODES = ("weights", "optimizer")
EXAMPLES, BATCH, EPOCHS = 102, 16, 2
MIN_SIZE = 64  # small test models: most of their variables are split (the default, 1024, is measured in `bytes`)
RESULT = {}
TRAINED = {}  # (kind, mode) -> the sharded model train_all trained, reused by the checkpoint scenarios


def sgd():
    return keras.optimizers.SGD(0.05, momentum=0.9, clipnorm=0.5)


def adam(**kw):
    return keras.optimizers.Adam(1e-2, **kw)


def mlp():
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(64, activation="relu", name="hidden_1"),
            keras.layers.Dense(64, activation="relu", name="hidden_2"),
            keras.layers.Dense(4, name="out"),
        ],
        name="mlp",
    )
    model.compile(optimizer=sgd(), loss="mse")
    return model


def cnn():
    inputs = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(16, 3, use_bias=False, name="conv_1")(inputs)  # a bias before BatchNorm has no gradient
    x = keras.layers.BatchNormalization(name="norm")(x)
    x = keras.layers.Activation("relu")(x)
    x = keras.layers.Conv2D(16, 3, activation="relu", name="conv_2")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inputs, keras.layers.Dense(10, name="classes")(x), name="cnn")
    # Clipping by the global norm and accumulation over 2 steps act on the whole gradient, as on one device.
    optimizer = adam(global_clipnorm=1.0, gradient_accumulation_steps=2)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def lm():
    model = models.transformer_lm(seq_len=8, vocab_size=64, d_model=32, num_heads=4, num_layers=1)
    model.compile(optimizer=adam(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class Subclassed(keras.Model):
    """A residual MLP whose variables are created when it is first called."""

    def __init__(self):
        super().__init__(name="subclassed")
        self.inner = keras.layers.Dense(64, activation="tanh", name="inner")
        self.back = keras.layers.Dense(16, name="back")
        self.head = keras.layers.Dense(4, name="head")

    def call(self, x):
        return self.head(x + self.back(self.inner(x)))


def subclassed():
    model = Subclassed()
    model.compile(optimizer=sgd(), loss="mse")
    return model


BUILDERS = {"mlp": mlp, "cnn": cnn, "lm": lm, "subclassed": subclassed}


def data(kind, n=EXAMPLES, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "cnn":
        return rng.normal(size=(n, 8, 8, 3)).astype("float32"), rng.integers(0, 10, (n,)).astype("int32")
    if kind == "lm":
        return rng.integers(0, 64, (n, 8)).astype("int32"), rng.integers(0, 64, (n, 8)).astype("int32")
    x = rng.normal(size=(n, 16)).astype("float32")
    return x, np.tanh(x[:, :4] * 2.0).astype("float32")


def build(kind, strategy=None, seed=5):
    keras.utils.set_random_seed(seed)
    if strategy is None:
        return BUILDERS[kind]()
    with strategy.scope():
        return BUILDERS[kind]()


def max_diff(a, b):
    return float(max(np.max(np.abs(np.asarray(x, "float64") - np.asarray(y, "float64"))) for x, y in zip(a, b)))


def rel_diff(a, b):
    a, b = np.asarray(a, dtype="float64"), np.asarray(b, dtype="float64")
    return float(np.max(np.abs(a - b) / np.abs(b)))


def slots(model):
    return [np.asarray(v) for v in model.optimizer.variables]


def canonical(path):
    """Paths without Keras' uniquifying suffixes ("adam_3/mlp_2_hidden_1_kernel_momentum" -> "adam/mlp_hidden_1...")."""
    path = re.sub(r"^(adam|sgd)(_\d+)?/", r"\1/", path)
    return re.sub(r"(mlp|cnn|subclassed|transformer_lm)_\d+", r"\1", path)


def placements(strategy, model):
    report = strategy.placement_report(model, print_fn=None)
    return {
        canonical(v.path): {"spec": list(v.spec), "note": v.note, "total": v.bytes_total, "device": v.bytes_per_device}
        for v in report.variables
    }, report


def fit(model, x, y, **kw):
    return model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, **kw).history["loss"]


def train_all():
    for kind in BUILDERS:
        x, y = data(kind)
        ref = build(kind)
        ref_loss = fit(ref, x, y)
        for mode in MODES:
            strategy = tfdist.ShardedDataParallelStrategy(shard=mode, min_size=MIN_SIZE)
            model = build(kind, strategy)
            loss = fit(model, x, y)
            key = f"{kind}_{mode}"
            RESULT[f"{key}_loss_rel"] = rel_diff(loss, ref_loss)
            RESULT[f"{key}_weights_diff"] = max_diff(model.get_weights(), ref.get_weights())
            RESULT[f"{key}_slots_diff"] = max_diff(slots(model), slots(ref))
            if kind == "lm":
                RESULT[f"{key}_evaluate_diff"] = abs(
                    model.evaluate(x, y, batch_size=BATCH, verbose=0)
                    - ref.evaluate(x, y, batch_size=BATCH, verbose=0)
                )
                RESULT[f"{key}_predict_diff"] = max_diff(
                    [model.predict(x, batch_size=BATCH, verbose=0)], [ref.predict(x, batch_size=BATCH, verbose=0)]
                )
            RESULT[f"{key}_placements"], _ = placements(strategy, model)
            RESULT[f"{key}_trained"] = loss[-1] < loss[0]
            TRAINED[kind, mode] = model


def bytes_per_device():
    """transformer_lm(d_model=256) with Adam, float32: persistent bytes per device against ZeRO's formulas."""
    for mode in MODES:
        strategy = tfdist.ShardedDataParallelStrategy(shard=mode)
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = models.transformer_lm(seq_len=64, d_model=256, num_heads=4, num_layers=2)
            model.compile(optimizer=adam(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.optimizer.build(model.trainable_variables)
        rows, report = placements(strategy, model)
        RESULT[f"bytes_{mode}"] = {
            "parameters": int(model.count_params()),
            "per_device": sorted(set(report.bytes_per_device.values())),
            "replicated": {p: r["note"] for p, r in rows.items() if "replicated" in r["note"]},
            "placements": rows,
        }


def two_d_mesh():
    """{"batch": 2, "model": 4}: the transformer preset splits over "model", the sharding what it keeps whole."""
    x, y = data("lm")
    ref = build("lm")
    ref_loss = fit(ref, x[:96], y[:96])
    strategy = tfdist.ShardedDataParallelStrategy(
        shard="weights", mesh={"batch": 2, "model": 4}, rules=layouts.transformer(), min_size=MIN_SIZE
    )
    model = build("lm", strategy)
    loss = fit(model, x[:96], y[:96])
    RESULT["mesh2d_loss_rel"] = rel_diff(loss, ref_loss)
    RESULT["mesh2d_weights_diff"] = max_diff(model.get_weights(), ref.get_weights())
    RESULT["mesh2d_placements"], _ = placements(strategy, model)


def save_checkpoints():
    """train_all's N=8 shard="weights" LM saves .keras (weights + optimizer state), .weights.h5 and its arrays."""
    model = TRAINED["lm", "weights"]
    ckpt = os.path.join(OUT, "ckpt")
    os.makedirs(ckpt, exist_ok=True)
    model.save(os.path.join(ckpt, "lm.keras"))
    model.save_weights(os.path.join(ckpt, "lm.weights.h5"))
    np.savez(os.path.join(ckpt, "arrays.npz"), *model.get_weights())
    np.savez(os.path.join(ckpt, "slots.npz"), *slots(model))


def backup_and_restore():
    """A run killed after step 9 resumes from its last backup and ends as the uninterrupted run does."""
    x, y = data("mlp")

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 9:
                raise KeyboardInterrupt("simulated crash after step 9")

    strategy = tfdist.ShardedDataParallelStrategy(shard="weights", min_size=MIN_SIZE)
    whole = TRAINED["mlp", "weights"]  # the same training, uninterrupted
    backup_dir = os.path.join(OUT, "backup")
    crashed = build("mlp", strategy)
    try:
        fit(crashed, x, y, callbacks=[Crash(), tfdist.callbacks.BackupAndRestore(backup_dir, save_freq=4)])
    except KeyboardInterrupt:
        pass
    resumed = build("mlp", strategy)
    backup = tfdist.callbacks.BackupAndRestore(backup_dir, save_freq=4)
    fit(resumed, x, y, callbacks=[backup])
    RESULT["backup_restored_step"] = backup.restored_step
    RESULT["backup_weights_diff"] = max_diff(resumed.get_weights(), whole.get_weights())
    RESULT["backup_slots_diff"] = max_diff(slots(resumed), slots(whole))


def load_checkpoints():
    """The N=8 checkpoints onto this process' 4 devices (sharded) and onto one device (no strategy)."""
    saved = np.load(os.path.join(CHECKPOINT, "arrays.npz"))
    saved = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    saved_slots = np.load(os.path.join(CHECKPOINT, "slots.npz"))
    saved_slots = [saved_slots[f"arr_{i}"] for i in range(len(saved_slots.files))]
    strategy = tfdist.ShardedDataParallelStrategy(shard="weights", min_size=MIN_SIZE)
    for where, scope in (("n4", strategy), ("one", None)):
        if scope is None:
            loaded = keras.saving.load_model(os.path.join(CHECKPOINT, "lm.keras"))
        else:
            with scope.scope():
                loaded = keras.saving.load_model(os.path.join(CHECKPOINT, "lm.keras"))
            RESULT["loaded_placements"], _ = placements(strategy, loaded)
        RESULT[f"keras_{where}_weights_diff"] = max_diff(loaded.get_weights(), saved)
        RESULT[f"keras_{where}_slots_diff"] = max_diff(slots(loaded), saved_slots)
        fresh = build("lm", scope)
        fresh.build((None, 8))
        fresh.load_weights(os.path.join(CHECKPOINT, "lm.weights.h5"))
        RESULT[f"h5_{where}_weights_diff"] = max_diff(fresh.get_weights(), saved)


def mixed_bfloat16():
    """float32 master weights stored split, bfloat16 compute: the same training as one device's.

    Measures too how far bfloat16 compute alone moves one device's training from float32's (the bound the
    sharded run's difference is held to: its sums over devices round differently, by CPU kernels that
    differ between instruction sets, e.g. AVX2 and AVX-512).
    """
    x, y = data("mlp")
    float32 = build("mlp")
    fit(float32, x, y)
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        ref = build("mlp")
        ref_loss = fit(ref, x, y)
        strategy = tfdist.ShardedDataParallelStrategy(shard="weights", min_size=MIN_SIZE)
        model = build("mlp", strategy)
        loss = fit(model, x, y)
        RESULT["bf16_loss_rel"] = rel_diff(loss, ref_loss)
        RESULT["bf16_weights_diff"] = max_diff(model.get_weights(), ref.get_weights())
        RESULT["bf16_one_device_vs_float32"] = max_diff(ref.get_weights(), float32.get_weights())
        RESULT["bf16_variable_dtypes"] = sorted({v.dtype for v in model.weights})
        RESULT["bf16_placements"], _ = placements(strategy, model)
    finally:
        keras.mixed_precision.set_global_policy("float32")


if CHECKPOINT:
    load_checkpoints()
else:
    train_all()
    bytes_per_device()
    if DEVICES == 8:
        two_d_mesh()
        save_checkpoints()
        backup_and_restore()
    else:
        mixed_bfloat16()
with open(os.path.join(OUT, "result.json"), "w") as f:
    json.dump(RESULT, f, indent=1)
print("done", flush=True)
