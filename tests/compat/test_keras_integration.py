"""Keras' own integration tests of feeding and customizing `fit`, under every tfdist strategy.

The bodies of `integration_tests/tf_distribute_training_test.py` and
`integration_tests/tf_custom_fit_test.py` are ported from keras-team/keras (Apache-2.0): the strategy line
is changed (the custom-fit test gets a strategy scope), the distributed test's data and layers are
smaller. The second `fit` of the first takes `strategy.experimental_distribute_dataset(ds)`; the custom
`train_step` of the second logs its loss through its own `keras.metrics.Mean`.

Each runs under DataParallelStrategy (4 devices), PipelineStrategy (2 stages, 2 micro-batches),
ModelParallelStrategy ({batch: 2, model: 4}, every Dense kernel split by a path rule: on its outputs in the
first test, on its inputs in the custom-fit one, whose last kernel has one output) and
ShardedDataParallelStrategy ZeRO-3 and ZeRO-1 (8 devices, `min_size=16`: these small weights split too),
all in one child
on 8 logical CPUs (the DTensor ones last: a DTensor runtime error poisons the process), and under
MultiWorkerStrategy on two worker processes (127.0.0.1 ports; each checks, and the two must report the
same figures). Besides passing, each checks:
- a dataset the strategy distributed (`experimental_distribute_dataset`, `distribute_datasets_from_function`)
  trains, evaluates and predicts as the same undistributed dataset does under that strategy (weights and
  predictions 1e-6; the model has BatchNormalization, whose statistics are per replica under data
  parallelism, so the reference is the strategy's own run, not one device);
- the custom `train_step` logs the loss and mean absolute error one device logs (rtol 1e-6): Keras' own Adam
  run, and an SGD run over 70 examples (the last batch, 6, splits 2/2/1/1 over 4 replicas) whose weights
  equal one device's (1e-5) and whose custom `test_step` logs one device's evaluation (on two workers the
  last batch, 6, splits 3/3; the 64 examples of the Adam run, 32/32 per batch).

A function-distributed dataset is the user's to shard: `per_replica` batches by the replica's share and keeps
every `num_input_pipelines`-th batch, so each global batch is the plain dataset's.

Run as a script, this file is the child: `python tests/compat/test_keras_integration.py OUT local|multi`
(under `multi`, TF_CONFIG names the worker; it writes `result<task index>.json`).
"""

import json
import os
import sys

import numpy as np

import tfdist

DISTRIBUTED_TOL = 1e-6  # the same strategy fed the same batches two ways
LOGGED_RTOL = 1e-6  # a custom train_step's logged loss and metric against one device
SGD_WEIGHTS_TOL = 1e-5
STRATEGIES = {"local": ("data_parallel", "pipeline", "model_parallel", "zero3", "zero1"),
              "multi": ("multi_worker",)}


# ---------------------------------------------------------------------------------------------- the child
def make_strategy(name, kernel_split=(None, "model")):
    """The strategy `name`; under ModelParallel every kernel is split as `kernel_split` says (a path rule)."""
    if name == "data_parallel":
        return tfdist.DataParallelStrategy(devices=[f"CPU:{i}" for i in range(4)])
    if name == "pipeline":
        return tfdist.PipelineStrategy(stages=2, microbatches=2, devices=["CPU:0", "CPU:1"])
    if name == "model_parallel":
        # auto() finds no attention or feed-forward pair in a Dense stack: a path rule splits every kernel.
        return tfdist.ModelParallelStrategy(mesh={"batch": 2, "model": 4}, rules=[(r"kernel$", kernel_split)])
    if name in ("zero3", "zero1"):
        return tfdist.ShardedDataParallelStrategy(shard="weights" if name == "zero3" else "optimizer", min_size=16)
    return tfdist.MultiWorkerStrategy()


def model_fit(strategy):
    """Keras' `tf_distribute_training_test.test_model_fit` (smaller), then the same batches fed five ways."""
    import keras
    import tensorflow as tf
    from keras import layers
    from keras import losses
    from keras import metrics
    from keras import models
    from keras import optimizers

    keras.utils.set_random_seed(1337)

    with strategy.scope():
        inputs = layers.Input((10,), batch_size=32)
        x = layers.Dense(32, activation="relu")(inputs)
        x = layers.Dense(32, activation="relu")(x)
        x = layers.Dense(32, activation="relu")(x)
        x = layers.BatchNormalization()(x)
        outputs = layers.Dense(4)(x)
        model = models.Model(inputs, outputs)

    x = np.random.random((320, 10))
    y = np.random.random((320, 4))
    batch_size = 32
    epochs = 2

    # Fit from numpy arrays:
    with strategy.scope():
        model.compile(
            optimizer=optimizers.SGD(learning_rate=0.001, momentum=0.01),
            loss=losses.MeanSquaredError(),
            metrics=[metrics.MeanSquaredError()],
            jit_compile=False,
        )
        history = model.fit(x, y, batch_size=batch_size, epochs=epochs, validation_split=0.2, verbose=0)
    assert set(history.history) == {"loss", "mean_squared_error", "val_loss", "val_mean_squared_error"}

    saved = model.get_weights(), [v.numpy() for v in model.optimizer.variables]

    def restore():
        model.set_weights(saved[0])
        for variable, value in zip(model.optimizer.variables, saved[1]):
            variable.assign(value)

    # Fit again from distributed dataset:
    with strategy.scope():
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
        dataset = strategy.experimental_distribute_dataset(dataset)
        history = model.fit(dataset, epochs=epochs, verbose=0)

    # The same batches, undistributed and from a function: the same training, evaluation and predictions.
    plain = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)

    def per_replica(context):
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(context.get_per_replica_batch_size(batch_size))
        return dataset.shard(context.num_input_pipelines, context.input_pipeline_id)

    runs = {"distributed": (dataset, history.history, model.get_weights())}
    for name, data in (("plain", plain), ("from_function", strategy.distribute_datasets_from_function(per_replica))):
        restore()
        h = model.fit(data, epochs=epochs, verbose=0)
        runs[name] = data, h.history, model.get_weights()
    evaluated, predicted = model.evaluate(plain, verbose=0), model.predict(plain, verbose=0)
    checks = {}
    for name in ("distributed", "from_function"):
        data, h, weights = runs[name]
        checks[f"{name}_weights"] = max(float(np.abs(a - b).max()) for a, b in zip(weights, runs["plain"][2]))
        checks[f"{name}_loss"] = float(np.abs(np.subtract(h["loss"], runs["plain"][1]["loss"])).max())
        checks[f"{name}_evaluate"] = float(np.abs(np.subtract(model.evaluate(data, verbose=0), evaluated)).max())
        checks[f"{name}_predict"] = float(np.abs(model.predict(data, verbose=0) - predicted).max())
    return checks, split_variables(strategy, model)


def split_variables(strategy, model):
    """How many of the model's weights and optimizer variables a DTensor strategy split (None: not DTensor)."""
    if not isinstance(strategy, tfdist.ModelParallelStrategy):
        return None
    from tensorflow.experimental import dtensor

    def split(variables):
        specs = [dtensor.fetch_layout(v.value).sharding_specs for v in variables]
        return sum(any(s != dtensor.UNSHARDED for s in spec) for spec in specs)

    return {"weights": split(model.weights), "optimizer": split(model.optimizer.variables)}


def custom_fit(strategy, *, optimizer, n, epochs):
    """Keras' `tf_custom_fit_test.test_custom_fit` under `strategy` (None: one device), plus a custom test_step.

    `optimizer()` gives the optimizer to compile with (created in the strategy's scope).
    """
    import contextlib

    import keras
    import tensorflow as tf

    class CustomModel(keras.Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
            self.loss_fn = keras.losses.MeanSquaredError()

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.loss_fn(y, y_pred)
            trainable_vars = self.trainable_variables
            gradients = tape.gradient(loss, trainable_vars)
            self.optimizer.apply(gradients, trainable_vars)
            self.loss_tracker.update_state(loss)
            self.mae_metric.update_state(y, y_pred)
            return {
                "loss": self.loss_tracker.result(),
                "mae": self.mae_metric.result(),
            }

        def test_step(self, data):  # the guide's ("customizing what happens in fit"), on compute_loss
            x, y = data
            y_pred = self(x, training=False)
            loss = self.compute_loss(y=y, y_pred=y_pred)
            self.loss_tracker.update_state(loss)
            self.mae_metric.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}

        @property
        def metrics(self):
            return [self.loss_tracker, self.mae_metric]

    keras.utils.set_random_seed(7)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        inputs = keras.Input(shape=(32,))
        hidden = keras.layers.Dense(8)(inputs)  # a second layer: a pipeline's two stages need two
        outputs = keras.layers.Dense(1)(hidden)
        model = CustomModel(inputs, outputs)
        model.compile(optimizer=optimizer(), loss="mse")
    x = np.random.random((n, 32))
    y = np.random.random((n, 1))
    history = model.fit(x, y, epochs=epochs, verbose=0)

    assert "loss" in history.history
    assert "mae" in history.history
    evaluated = model.evaluate(x, y, return_dict=True, verbose=0)
    return {
        "loss": history.history["loss"],
        "mae": history.history["mae"],
        "eval": [evaluated["loss"], evaluated["mae"]],
        "weights": [w.tolist() for w in model.get_weights()],
    }


def custom_runs(strategy):
    import keras

    return {
        "adam": custom_fit(strategy, optimizer=lambda: "adam", n=64, epochs=1),
        "sgd": custom_fit(strategy, optimizer=lambda: keras.optimizers.SGD(0.1), n=70, epochs=2),
    }


def child(out, family):
    strategies = [make_strategy("multi_worker")] if family == "multi" else None
    if strategies is None:
        tfdist.simulate_devices(8)
    result = {"one_device": None}
    for i, name in enumerate(STRATEGIES[family]):
        strategy = strategies[0] if strategies else make_strategy(name)
        distributed, split = model_fit(strategy)
        if name == "model_parallel":  # the custom model's kernels, (32, 8) and (8, 1), split on their inputs
            strategy = make_strategy(name, kernel_split=("model", None))
        result[name] = {"distributed": distributed, "split": split, "custom": custom_runs(strategy),
                        "replicas": strategy.num_replicas_in_sync}
        if i == 0:
            result["one_device"] = custom_runs(None)
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"] if family == "multi" else ""
    with open(os.path.join(out, f"result{task}.json"), "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------------------------------------- the tests
def _run(tmp_path, family):
    import _procs

    out = tmp_path / family
    out.mkdir()
    return _procs.run_child(os.path.abspath(__file__), out, family, timeout=400)


SPLIT = {  # name -> (fewest split weights, fewest split optimizer variables): the 4 kernels (and their SGD
    # momenta) under ModelParallel; under the sharded modes also the 32-wide biases and BatchNormalization's vectors
    "model_parallel": (4, 4), "zero3": (8, 8), "zero1": (0, 8)}


def _assert_integration(result, names):
    one = result["one_device"]
    for name in names:
        distributed, custom = result[name]["distributed"], result[name]["custom"]
        if name in SPLIT:
            split, (weights, optimizer) = result[name]["split"], SPLIT[name]
            assert split["weights"] >= weights and split["optimizer"] >= optimizer, (name, split)
            if name == "zero1":
                assert split["weights"] == 0, split  # ZeRO-1 keeps the weights whole
        assert max(distributed.values()) <= DISTRIBUTED_TOL, (name, distributed)
        for run in ("adam", "sgd"):
            for key in ("loss", "mae", "eval"):
                np.testing.assert_allclose(
                    custom[run][key], one[run][key], rtol=LOGGED_RTOL, err_msg=f"{name} {run} {key}"
                )
        for got, want in zip(custom["sgd"]["weights"], one["sgd"]["weights"]):
            np.testing.assert_allclose(got, want, atol=SGD_WEIGHTS_TOL, err_msg=name)


def test_keras_integration_tests_pass_under_the_single_process_strategies(tmp_path):
    _assert_integration(_run(tmp_path, "local"), STRATEGIES["local"])


def test_keras_integration_tests_pass_under_multi_worker_strategy_on_two_workers(tmp_path):
    import _procs

    procs, workers = _procs.Procs(tmp_path), _procs.workers(2)
    cmd = [sys.executable, os.path.abspath(__file__), str(tmp_path), "multi"]
    try:
        for index in range(2):
            tf_config = tfdist.cluster.Cluster(workers=workers, task_index=index).to_tf_config()
            procs.start(cmd, _procs.clean_env(TF_CONFIG=tf_config, TF_CPP_MIN_LOG_LEVEL="3"))
        codes = procs.wait(timeout=400)
        assert codes == [0, 0], "\n".join(procs.log(i)[-4000:] for i in range(2))
    finally:
        procs.kill_all()
    results = [json.loads((tmp_path / f"result{i}.json").read_text()) for i in range(2)]
    assert results[0] == results[1]  # every worker logs, evaluates and holds the same
    assert results[0]["multi_worker"]["replicas"] == 2
    _assert_integration(results[0], STRATEGIES["multi"])


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2])
