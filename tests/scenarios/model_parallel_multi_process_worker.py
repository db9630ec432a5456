"""Asserted by tests/strategies/test_model_parallel_multi_process.py, test_sharded_data_parallel.py.

A process of a multi-process ModelParallelStrategy test: trains tfdist.models.transformer_lm, writes results.

    python tests/scenarios/model_parallel_multi_process_worker.py OUT MODE key=value...

MODE: "fit" (fit, evaluate, predict; save checkpoints with ckpt=DIR; shard=weights|optimizer: under
ShardedDataParallelStrategy), "reference" (one process; mesh=none: one
device), "load" (load ckpt=DIR's checkpoints onto this process' mesh), "backup" (fit with
tfdist.callbacks.BackupAndRestore in backup=DIR; kill_at=STEP makes worker 0 SIGKILL itself there), "conv" (a
tutorial-shaped CNN with tfdist.layouts.conv()). The cluster comes from TF_CONFIG.
"""

import json
import os
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfdist  # noqa: E402

OUT, MODE = sys.argv[1], sys.argv[2]
OPTS = dict(a.split("=", 1) for a in sys.argv[3:])
tfdist.simulate_devices(int(OPTS.get("local", 4)))


def parse_mesh(text):
    return None if text == "none" else {k: int(v) for k, v in (p.split(":") for p in text.split(","))}


MESH = parse_mesh(OPTS.get("mesh", "batch:2,model:4"))
if MESH is not None and OPTS.get("shard"):  # sharded data parallelism; the preset for a "model" axis if any
    strategy = tfdist.ShardedDataParallelStrategy(
        shard=OPTS["shard"],
        mesh=MESH,
        rules=tfdist.layouts.transformer() if "model" in MESH else None,
        min_size=int(OPTS.get("min_size", 64)),
        timeout=float(OPTS.get("timeout", 120)),
        heartbeat_timeout=float(OPTS.get("heartbeat", 5)),
        sharding="data",
    )
elif MESH is not None:
    strategy = tfdist.ModelParallelStrategy(
        mesh=MESH,
        rules=tfdist.layouts.conv() if MODE == "conv" else tfdist.layouts.transformer(),
        timeout=float(OPTS.get("timeout", 120)),
        heartbeat_timeout=float(OPTS.get("heartbeat", 5)),
        sharding=OPTS.get("sharding", "auto"),
    )
else:
    strategy = None

import contextlib  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

EPOCHS = int(OPTS.get("epochs", 2))
BATCH = int(OPTS.get("batch", 16))
rank = strategy.topology.worker_index if strategy else 0


def scope():
    return strategy.scope() if strategy else contextlib.nullcontext()


def lm_data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (int(OPTS.get("examples", 64)), 16)).astype("int32")
    return x, np.roll(x, -1, axis=1)


def build_lm():
    keras.utils.set_random_seed(1)
    with scope():
        model = tfdist.models.transformer_lm(seq_len=16, d_model=32, num_heads=8, num_layers=1)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def build_cnn():
    keras.utils.set_random_seed(1)
    with scope():
        model = keras.Sequential(
            [
                keras.Input((12, 12, 1)),
                keras.layers.Conv2D(8, 3, activation="relu"),
                keras.layers.MaxPooling2D(),
                keras.layers.Conv2D(16, 3, activation="relu"),
                keras.layers.Flatten(),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def local_fractions(model):
    """Path -> (bytes this process' first device holds) / (bytes of the whole variable), from the layouts."""
    out = {}
    for w in model.weights:
        backing = getattr(w, "value", w)
        if dtensor.is_dtensor(backing.read_value()):
            shard = dtensor.unpack(backing.read_value())[0]
            out[w.path] = float(np.prod(shard.shape)) / float(np.prod(w.shape) or 1)
    return out


def save(results):
    np.savez(OUT, **{k: np.asarray(v) for k, v in results.items()})


def weights_of(model, results, prefix="w"):
    for i, w in enumerate(model.get_weights()):
        results[f"{prefix}{i}"] = w
    for i, v in enumerate(model.optimizer.variables):
        results[f"opt{i}"] = np.asarray(v)


if MODE in ("fit", "reference"):
    x, y = lm_data()
    model = build_lm()
    data = (x, y)
    if OPTS.get("tfdata") == "global":  # every process gives the global batches
        data = (tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH),)
    elif OPTS.get("tfdata") == "own":  # sharding="off": each process gives only its rows of every global batch
        groups, group = strategy.extended.batch_groups
        rows = BATCH // groups
        mine = np.concatenate([np.arange(s + group * rows, s + (group + 1) * rows) for s in range(0, len(x), BATCH)])
        data = (tf.data.Dataset.from_tensor_slices((x[mine], y[mine])).batch(rows),)
    class Announce(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                print("TRAINING", rank, flush=True)
                if rank == 1 and OPTS.get("stall"):  # alive (it still heartbeats), but never takes its next step
                    time.sleep(float(OPTS["stall"]))

    callbacks = [Announce()]
    if OPTS.get("ckpt"):  # Keras' own callback, every process writing "the same" shared file
        os.makedirs(OPTS["ckpt"], exist_ok=True)
        path = os.path.join(OPTS["ckpt"], "keras_callback.weights.h5")
        callbacks.append(keras.callbacks.ModelCheckpoint(path, save_weights_only=True))
        callbacks.append(tfdist.callbacks.Checkpoint(os.path.join(OPTS["ckpt"], "tfdist"), every_n_epochs=1))
    history = model.fit(*data, batch_size=None if OPTS.get("tfdata") else BATCH, epochs=EPOCHS, verbose=0,
                        shuffle=False, callbacks=callbacks)
    results = {
        "loss": history.history["loss"],
        "eval_loss": model.evaluate(x, y, batch_size=BATCH, verbose=0),
        "pred": model.predict(x[:BATCH], batch_size=BATCH, verbose=0),
    }
    weights_of(model, results)
    if strategy is not None:
        results["fractions"] = json.dumps(local_fractions(model))
    ckpt = OPTS.get("ckpt")
    if ckpt:
        # Every process takes part in gathering the shards; worker 0 writes the shared files.
        chief = rank == 0
        os.makedirs(ckpt, exist_ok=True)
        mine = ckpt if chief else os.path.join(ckpt, f"worker-{rank}-scratch")
        os.makedirs(mine, exist_ok=True)
        model.save(os.path.join(mine, "model.keras"))
        model.save_weights(os.path.join(mine, "model.weights.h5"))
        tf.train.Checkpoint(model=model).write(os.path.join(mine, "tf_ckpt", "ckpt"))
    save(results)

elif MODE == "load":
    # One process loads the checkpoints onto several meshes of its 8 devices, then onto one device.
    import tfdist.models  # noqa: F401  - registers the model's layers for load_model

    ckpt = OPTS["ckpt"]
    x, _ = lm_data()
    results = {}
    for name in OPTS["onto"].split(";"):
        mesh = parse_mesh(name)
        strategy = tfdist.ModelParallelStrategy(mesh=mesh, rules=tfdist.layouts.transformer()) if mesh else None
        with scope():
            loaded = keras.saving.load_model(os.path.join(ckpt, "model.keras"))
        results[f"{name}/pred"] = loaded.predict(x[:BATCH], batch_size=BATCH, verbose=0)
        for i, w in enumerate(loaded.get_weights()):
            results[f"{name}/keras{i}"] = w
        model = build_lm()
        model.load_weights(os.path.join(ckpt, "model.weights.h5"))
        for i, w in enumerate(model.get_weights()):
            results[f"{name}/h5{i}"] = w
        model = build_lm()
        with scope():
            model.optimizer.build(model.trainable_variables)
        tfdist.callbacks.restore_checkpoint(model, os.path.join(ckpt, "tfdist"))
        for i, w in enumerate(model.get_weights()):
            results[f"{name}/tfdist{i}"] = w
        for i, v in enumerate(model.optimizer.variables):
            results[f"{name}/tfdist_opt{i}"] = np.asarray(v)
        model = build_lm()
        model.load_weights(os.path.join(ckpt, "keras_callback.weights.h5"))
        for i, w in enumerate(model.get_weights()):
            results[f"{name}/callback{i}"] = w
        model = build_lm()
        tf.train.Checkpoint(model=model).read(os.path.join(ckpt, "tf_ckpt", "ckpt")).expect_partial()
        for i, w in enumerate(model.get_weights()):
            results[f"{name}/tf{i}"] = w
    save(results)

elif MODE == "backup":
    x, y = lm_data()
    model = build_lm()
    kill_at = int(OPTS.get("kill_at", -1))

    class KillAt(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.step = 0

        def on_train_batch_end(self, batch, logs=None):
            self.step += 1
            if rank == 0 and self.step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    backup = tfdist.callbacks.BackupAndRestore(OPTS["backup"], save_freq=int(OPTS.get("save_freq", 2)))
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False,
                        callbacks=[backup, KillAt()])
    results = {"loss": history.history["loss"]}
    weights_of(model, results)
    save(results)

elif MODE == "conv":
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 12, 12, 1)).astype("float32")
    y = rng.integers(0, 10, 64).astype("int32")
    model = build_cnn()
    data = (x, y)
    if OPTS.get("tfdata") == "global":  # every process gives the global batches
        data = (tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH),)
    history = model.fit(*data, batch_size=None if OPTS.get("tfdata") else BATCH, epochs=EPOCHS, verbose=0,
                        shuffle=False)
    results = {"loss": history.history["loss"], "pred": model.predict(x[:BATCH], batch_size=BATCH, verbose=0)}
    weights_of(model, results)
    if strategy is not None:
        results["fractions"] = json.dumps(local_fractions(model))
    save(results)
else:
    raise SystemExit(f"unknown mode {MODE!r}")
print("WORKER DONE", rank, flush=True)
