"""Asserted by tests/strategies/test_multi_worker.py (and tests/cli/test_flight.py: `_procs.WORKER`).

A worker process for the multi-worker tests (run as a script, not collected by pytest).

Usage: python tests/scenarios/multi_worker_fit.py OUT.npz MODE [key=value ...]
(keys: n, batch, epochs, clip, accum, spe, jit, val, tfdata, bn (a BatchNormalization layer), and the strategy's
timeout, heartbeat, join, gdtype, bstats (batch_statistics))
MODE: "multi" (tfdist.MultiWorkerStrategy from TF_CONFIG), "reference" (one process, no strategy),
"die" (multi, but this process kills itself mid-fit when it is worker `die_rank`),
"stuck" (multi, but worker `die_rank` sleeps inside training).

Several runs in one process, one after the other (each from the same seed), in mode "references" (one
process, no strategy) or "multis" (one tfdist.MultiWorkerStrategy for all; its options from the first run):
python tests/scenarios/multi_worker_fit.py OUT_DIR references|multis NAME:key=value,key=value ... writes
OUT_DIR/NAME.npz each, and prints "run NAME begins" before each run (a test splits the log there).
"""

import os
import sys
import time

import numpy as np

OUT, MODE = sys.argv[1], sys.argv[2]
if MODE in ("references", "multis"):  # NAME:key=value,key=value ...
    RUNS = [(name, opts) for name, _, opts in (a.partition(":") for a in sys.argv[3:])]
    RUNS = [(name, os.path.join(OUT, f"{name}.npz"), dict(o.split("=", 1) for o in opts.split(",") if o))
            for name, opts in RUNS]
    MODE = {"references": "reference", "multis": "multi"}[MODE]
else:
    RUNS = [("", OUT, dict(a.split("=", 1) for a in sys.argv[3:]))]

if MODE != "reference":
    import tfdist

    OPTS = RUNS[0][2]
    STRATEGY_OPTS = ("timeout", "heartbeat", "join", "gdtype", "bstats")
    for _, _, opts in RUNS:  # one strategy per process
        assert all(opts.get(k) == OPTS.get(k) for k in STRATEGY_OPTS), (opts, OPTS)
    strategy = tfdist.MultiWorkerStrategy(
        timeout=float(OPTS.get("timeout", 60)),
        heartbeat_timeout=float(OPTS.get("heartbeat", 10)),
        join_timeout=float(OPTS.get("join", 60)),
        gradient_dtype=OPTS.get("gdtype") or None,
        batch_statistics=OPTS.get("bstats", "replica"),
    )
    rank = strategy.cluster.rank
else:
    import tensorflow as tf

    strategy = tf.distribute.get_strategy()
    rank = 0

import _xla  # noqa: E402
import keras  # noqa: E402


class Sabotage(keras.callbacks.Callback):
    def __init__(self, opts):
        super().__init__()
        self.opts = opts

    def on_train_batch_end(self, batch, logs=None):
        if rank != int(self.opts.get("die_rank", 1)) or self.model.optimizer.iterations.numpy() < 3:
            return
        if MODE == "die":
            print(f"worker dies at {time.time()}", flush=True)
            os._exit(17)
        if MODE == "stuck":
            print("worker is stuck now", flush=True)
            time.sleep(1000)


def run(out, opts):
    n = int(opts.get("n", 22))
    batch = int(opts.get("batch", 6))
    epochs = int(opts.get("epochs", 2))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32") + 0.1).astype("float32")
    keras.utils.set_random_seed(1)
    with strategy.scope():
        norm = [keras.layers.BatchNormalization()] if opts.get("bn") else []  # statistics of the batch
        model = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), *norm, keras.layers.Dense(1)]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(
                0.05,
                global_clipnorm=float(opts["clip"]) if "clip" in opts else None,
                gradient_accumulation_steps=int(opts["accum"]) if "accum" in opts else None,
            ),
            loss="mse",
            metrics=["mae"],
            steps_per_execution=int(opts.get("spe", 1)),
            jit_compile=bool(opts.get("jit")),
        )
    if opts.get("tfdata"):  # a user's in-memory tf.data pipeline, batched by the global batch
        import tensorflow as tf

        train = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
        history = model.fit(train, epochs=epochs, verbose=0, callbacks=[Sabotage(opts)])
    else:
        history = model.fit(
            x,
            y,
            batch_size=batch,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=[Sabotage(opts)],
            validation_data=(x[:10], y[:10]) if opts.get("val") else None,
        )
    ev = model.evaluate(x[:12], y[:12], batch_size=batch, verbose=0, return_dict=True)
    pred = model.predict(x[:12], batch_size=batch, verbose=0)
    np.savez(
        out,
        *[w for w in model.get_weights()],
        loss=np.array(history.history["loss"]),
        val_loss=np.array(history.history.get("val_loss", [])),
        eval_loss=np.array(ev["loss"]),
        pred=pred,
        # XLA-compiled calls in the traced train step (tests/_support/_xla.py), one per replica when jit_compile.
        xla_calls=np.array(len(_xla.compiled_calls(model.train_function))),
    )
    print("done", flush=True)


for name, out, opts in RUNS:
    if name:
        print(f"run {name} begins", flush=True)
    run(out, opts)
