"""Asserted by tests/callbacks/test_step_stats.py.

One worker of the StepStats tests (run as a script, not collected by pytest).

Usage: python tests/scenarios/step_stats_slow_and_even_workers.py OUT.json MODE [key=value ...]; the cluster comes
from TF_CONFIG.
MODE: "multi" (tfdist.MultiWorkerStrategy, one CPU each) or "model" (tfdist.ModelParallelStrategy over the
processes, 2 simulated CPUs each, mesh batch=2 x model=2).

Two fits, each with its own StepStats, write their reports to OUT.json:
- "slow": worker `slow_rank` sleeps `delay_ms` in its input pipeline for every batch (a tf.py_function);
  `every` steps per report, `reports` reports, patience=2;
- "even" (multi only): no delay, `even_steps` steps, a report every `even_every`, default thresholds.
"""

import json
import sys
import time
import warnings

OUT, MODE = sys.argv[1], sys.argv[2]
OPTS = dict(a.split("=", 1) for a in sys.argv[3:])

import tfdist  # noqa: E402

if MODE == "multi":
    strategy = tfdist.MultiWorkerStrategy(timeout=60, heartbeat_timeout=10, join_timeout=60, sharding="data")
else:
    tfdist.simulate_devices(2)
    strategy = tfdist.ModelParallelStrategy(
        mesh={"batch": 2, "model": 2}, rules=tfdist.layouts.transformer(), timeout=60, sharding="data"
    )
rank = strategy.topology.worker_index

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

BATCH = 16
DELAY = float(OPTS.get("delay_ms", 50)) / 1e3


def dataset(steps, delay):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * steps, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1))).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    if delay:

        def slow(features, labels):
            def sleep(value):
                time.sleep(delay)
                return value

            return tf.ensure_shape(tf.py_function(sleep, [features], tf.float32), features.shape), labels

        data = data.map(slow)
    options = tf.data.Options()
    options.autotune.enabled = False  # no buffer filled ahead while the first step traces: each batch waits
    return data.with_options(options)


def fit(name, stats, steps, delay):
    keras.utils.set_random_seed(1)
    with strategy.scope():
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, activation="tanh", name="mlp_in")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(1, name="mlp_out")(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", tfdist.callbacks.StragglerWarning)
        history = model.fit(dataset(steps, delay), epochs=1, shuffle=False, verbose=0, callbacks=[stats])
    reports = [
        {
            "step": r.step,
            "steps": r.steps,
            "units": list(r.units),
            "table": np.stack([r.step_time, r.input_wait, r.compute, r.collective_wait], axis=1).tolist(),
            "slowest": r.slowest,
            "lag": r.lag,
            "over": r.over_threshold,
            "straggler": r.straggler,
        }
        for r in stats.history
    ]
    warned = [str(w.message) for w in caught if issubclass(w.category, tfdist.callbacks.StragglerWarning)]
    logs = {k: v for k, v in history.history.items() if k.startswith("slowest")}
    return {"reports": reports, "warnings": warned, "logs": logs}


every = int(OPTS.get("every", 5))
result = {
    "slow": fit(
        "slow",
        tfdist.callbacks.StepStats(every=every, patience=2),
        every * int(OPTS.get("reports", 3)),
        DELAY if rank == int(OPTS.get("slow_rank", 1)) else 0.0,
    )
}
if MODE == "multi":
    result["even"] = fit(
        "even",
        tfdist.callbacks.StepStats(every=int(OPTS.get("even_every", 20))),
        int(OPTS.get("even_steps", 200)),
        0.0,
    )
with open(OUT, "w") as f:
    json.dump(result, f)
print("done", flush=True)
