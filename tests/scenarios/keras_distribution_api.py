"""Asserted by tests/compat/test_keras_distribution.py.

Keras' distribution API on TensorFlow through tfdist, in a fresh process (run as a script, not collected by pytest).

Usage: python tests/scenarios/keras_distribution_api.py SCENARIO OUT_DIR

* guide (8 simulated CPUs): Keras' distribution guide with `tfdist.use_keras_distribution()` added: a
  DataParallel over `DeviceMesh(shape=(8,), axis_names=["data"])`, a DataParallel(devices=...), then a
  ModelParallel over a 2 x 4 ("data", "model") mesh whose LayoutMap splits "d1/kernel" and relayouts
  "d2/output"; each trained on 101 random examples in batches of 16 (the last batch of 5 splits over no
  axis) with the guide's Dropout(0.4), and with Dropout(0) against one device. Then switching back
  (`set_distribution(None)`, leaving `scope()`), nesting, and bad input through both entry points.
* data_parallel (4 simulated CPUs): a `DataParallel()` set BEFORE `use_keras_distribution()`, trained
  on numpy arrays, against one device.
* hub (8 simulated CPUs): KerasHub's LlamaCausalLM and GemmaCausalLM (tiny configs, no weights, no
  vocabularies) placed by their backbone's `get_layout_map` on a {"batch": 2, "model": 4} mesh, through
  `tfdist.ModelParallelStrategy(rules=...)` and through `set_distribution(ModelParallel(...))`, against
  one device, with the placement report's bytes per device.

Numbers go to OUT_DIR/result.json for tests/compat/test_keras_distribution.py.
"""

import json
import os
import sys

import tfdist

SCENARIO, OUT = sys.argv[1], sys.argv[2]
tfdist.simulate_devices(4 if SCENARIO == "data_parallel" else 8)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import layers  # noqa: E402
from keras.src.distribution import distribution_lib  # noqa: E402

from tfdist import _compat  # noqa: E402
from tfdist._compat import keras_distribution as hooks  # noqa: E402
from tfdist.strategies.model_parallel import runtime  # noqa: E402

RESULT = {}


def weights_close(a, b, *, rtol=1e-4, atol=1e-5):
    """Whether two lists of weights agree, and the largest difference."""
    diff = max(float(np.abs(x - y).max()) for x, y in zip(a, b))
    return bool(all(np.allclose(x, y, rtol=rtol, atol=atol) for x, y in zip(a, b))), diff


def distributed(model) -> bool:
    """Whether the model's weights are DTensor variables or mirrored over several devices."""
    backing = getattr(model.weights[0], "value", model.weights[0])
    return type(backing).__name__ not in ("ResourceVariable", "UninitializedVariable")


def error(fn):
    """The message `fn()` raises (its type first), or None."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is part of what the test checks
        return f"{type(e).__name__}: {e}"
    return None


# ---------------------------------------------------------------------------------------------------- guide
def get_model(rate):
    """The guide's model (its Dropout rate given), from one seed."""
    keras.utils.set_random_seed(1)
    inputs = layers.Input(shape=(28, 28, 1))
    y = layers.Flatten()(inputs)
    y = layers.Dense(units=200, use_bias=False, activation="relu", name="d1")(y)
    y = layers.Dropout(rate)(y)
    y = layers.Dense(units=10, activation="softmax", name="d2")(y)
    return keras.Model(inputs=inputs, outputs=y)


def guide_dataset():
    rng = np.random.default_rng(0)
    inputs = rng.normal(size=(101, 28, 28, 1)).astype("float32")
    labels = rng.normal(size=(101, 10)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((inputs, labels)).batch(16)


def train_guide(rate):
    """Builds, compiles, fits (2 epochs) and evaluates the guide's model, as the guide does."""
    model = get_model(rate)
    model.compile(loss="mse")
    history = model.fit(guide_dataset(), epochs=2, verbose=0)
    return model, [float(v) for v in history.history["loss"]], float(model.evaluate(guide_dataset(), verbose=0))


def compare(name, trained, reference):
    model, losses, evaluation = trained
    _, ref_losses, ref_evaluation = reference
    close, diff = weights_close(model.get_weights(), reference[0].get_weights())
    RESULT[name] = {
        "losses": losses,
        "ref_losses": ref_losses,
        "evaluate": evaluation,
        "ref_evaluate": ref_evaluation,
        "weights_close": close,
        "weights_diff": diff,
        "strategy": type(model.distribute_strategy).__name__,
        "replicas": model.distribute_strategy.num_replicas_in_sync,
        "distributed": distributed(model),
    }


def guide():
    tfdist.use_keras_distribution()  # the one line added to the guide
    RESULT["hooks"] = {"installed": _compat.installed("keras_distribution"), "unpatched": hooks.unpatched_bindings()}
    devices = keras.distribution.list_devices()
    RESULT["devices"] = devices
    reference = train_guide(0.0)  # one device: no distribution set
    RESULT["reference"] = {"distributed": distributed(reference[0]), "has_strategy": tf.distribute.has_strategy()}

    # Data parallel, both ways the guide builds it.
    mesh_1d = keras.distribution.DeviceMesh(shape=(8,), axis_names=["data"], devices=devices)
    data_parallel = keras.distribution.DataParallel(device_mesh=mesh_1d)
    keras.distribution.set_distribution(data_parallel)
    _, losses, evaluation = train_guide(0.4)
    RESULT["dp_guide"] = {"losses": losses, "evaluate": evaluation}
    trained = train_guide(0.0)
    dp_strategy = trained[0].distribute_strategy
    compare("dp_mesh", trained, reference)
    # TensorFlow ties a model's variables to its strategy: each model is read while its own is current.
    with keras.distribution.DataParallel(devices=devices).scope():
        trained = train_guide(0.0)
        compare("dp_devices", trained, reference)
    RESULT["dp_devices"]["other_strategy"] = trained[0].distribute_strategy is not dp_strategy
    RESULT["dp_after_scope"] = {  # leaving the inner scope: the distribution set before is back
        "distribution_is_outer": keras.distribution.distribution() is data_parallel,
        "strategy_is_outer": tf.distribute.get_strategy() is dp_strategy,
    }
    keras.distribution.set_distribution(None)

    # Model parallel.
    mesh_2d = keras.distribution.DeviceMesh(shape=(2, 4), axis_names=["data", "model"], devices=devices)
    layout_map = keras.distribution.LayoutMap(mesh_2d)
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d1/bias"] = ("model",)
    layout_map["d2/output"] = ("data", None)
    model_parallel = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    keras.distribution.set_distribution(model_parallel)
    relayouts = record_relayouts()
    guide_model, losses, evaluation = train_guide(0.4)
    RESULT["mp_guide"] = {"losses": losses, "evaluate": evaluation}
    strategy = guide_model.distribute_strategy
    keras.distribution.set_distribution(None)
    RESULT["after_none"] = after_switch_back()
    with model_parallel.scope():
        trained = train_guide(0.0)
        RESULT["mp_scope_current"] = tf.distribute.get_strategy() is strategy
        compare("mp", trained, reference)
    RESULT["after_scope"] = after_switch_back()
    model = trained[0]
    RESULT["mp"].update(
        same_strategy=model.distribute_strategy is strategy,
        mesh=strategy.mesh_shape,
        batch_axis=strategy.batch_axis,
        mesh_devices=[d.split("/")[-1] for d in strategy.mesh.local_devices()],
        layouts={
            w.path: list(w.value.layout.sharding_specs)
            for w in list(model.weights) + list(model.optimizer.variables)
            if w.path in ("d1/kernel", "d2/kernel") or w.path.endswith("/d1_kernel_velocity")
        },
        relayouts=relayouts,
    )

    # A distribution set inside another one's scope, and switching back.
    keras.distribution.set_distribution(data_parallel)
    with model_parallel.scope():
        inner = tf.distribute.get_strategy()
    RESULT["nested"] = {
        "inner_is_mp": inner is strategy,
        "outer_back": tf.distribute.get_strategy() is dp_strategy,
        "distribution_back": keras.distribution.distribution() is data_parallel,
    }
    keras.distribution.set_distribution(None)

    guide_bad_input(mesh_2d, devices)


def after_switch_back():
    """After `set_distribution(None)` or leaving `scope()`: a model built now is not distributed."""
    model = get_model(0.0)
    return {
        "distribution": repr(keras.distribution.distribution()),
        "has_strategy": tf.distribute.has_strategy(),
        "distributed": distributed(model),
        "model_strategy": type(model.distribute_strategy).__name__,
    }


def record_relayouts():
    """Records the (shape, layout) of each activation relayout tfdist makes (a list filled as models run)."""
    seen = []
    original = runtime.ModelParallelExtended._relayout_activation

    def recording(self, value, layout):
        out = original(self, value, layout)
        if out is not value:
            key = hooks.layer_output_path()
            seen.append({"shape": value.shape.as_list(), "specs": list(_specs_of(out)), "key": key})
        return out

    runtime.ModelParallelExtended._relayout_activation = recording
    return seen


def _specs_of(tensor):
    # The layout string of the Relayout op (in a traced step) or of an eager DTensor.
    from tensorflow.experimental import dtensor

    if tf.executing_eagerly():
        return dtensor.fetch_layout(tensor).sharding_specs
    text = tensor.op.get_attr("layout").decode()
    return text.split("sharding_specs:")[1].split(",")[: tensor.shape.rank]


def guide_bad_input(mesh_2d, devices):
    bad = {}
    other = keras.distribution.DeviceMesh(shape=(4, 2), axis_names=["data", "model"], devices=devices)
    good_map = keras.distribution.LayoutMap(mesh_2d)
    good_map["d1/kernel"] = (None, "model")
    # A LayoutMap whose mesh is not the strategy's: the strategy's own argument, and a TensorLayout on
    # another DeviceMesh inside the map a Keras distribution gets.
    bad["strategy_mesh"] = error(
        lambda: tfdist.ModelParallelStrategy(mesh={"data": 4, "model": 2}, rules=good_map, batch_axis="data")
    )
    mixed = keras.distribution.LayoutMap(mesh_2d)
    mixed["d1/kernel"] = keras.distribution.TensorLayout((None, "model"), other)
    bad["distribution_mesh"] = error(
        lambda: keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=mixed, batch_dim_name="data")
        )
    )
    bad["distribution_mesh_left"] = repr(keras.distribution.distribution())
    # A TensorLayout whose rank is not the variable's, through both entry points.
    wrong_rank = keras.distribution.LayoutMap(mesh_2d)
    wrong_rank["d1/kernel"] = ("model",)

    def build_under_strategy():
        with tfdist.ModelParallelStrategy(rules=wrong_rank, batch_axis="data").scope():
            get_model(0.0)

    bad["strategy_rank"] = error(build_under_strategy)

    def build_under_distribution():
        with keras.distribution.ModelParallel(layout_map=wrong_rank, batch_dim_name="data").scope():
            get_model(0.0)

    bad["distribution_rank"] = error(build_under_distribution)
    bad["distribution_rank_left"] = [repr(keras.distribution.distribution()), tf.distribute.has_strategy()]

    # Unsupported distributions and devices.
    class AutoTPDistribution(distribution_lib.Distribution):  # Keras' automatic tensor parallelism, in later Keras
        pass

    bad["kind"] = error(lambda: keras.distribution.set_distribution(AutoTPDistribution(mesh_2d)))
    foreign = keras.distribution.DeviceMesh(
        shape=(2,), axis_names=["batch"], devices=["cpu:0", "/job:worker/replica:0/task:1/device:CPU:0"]
    )
    bad["devices"] = error(lambda: keras.distribution.set_distribution(keras.distribution.DataParallel(foreign)))
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 1}}
    )
    try:
        bad["processes"] = error(
            lambda: keras.distribution.set_distribution(
                keras.distribution.ModelParallel(layout_map=good_map, batch_dim_name="data")
            )
        )
    finally:
        del os.environ["TF_CONFIG"]
    with tfdist.DataParallelStrategy(devices=devices[:2]).scope():
        bad["other_scope"] = error(
            lambda: keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
        )
        keras.distribution.set_distribution(None)  # harmless there: no distribution to switch off
    bad["left"] = [repr(keras.distribution.distribution()), tf.distribute.has_strategy()]
    # An activation layout whose rank is not the output's: named when the step is traced (last: it fails a fit).
    activation = keras.distribution.LayoutMap(mesh_2d)
    activation["d2/output"] = ("data",)

    def fit_wrong_activation():
        with keras.distribution.ModelParallel(layout_map=activation, batch_dim_name="data").scope():
            model = get_model(0.0)
            model.compile(loss="mse")
            model.fit(guide_dataset(), epochs=1, verbose=0)

    bad["activation_rank"] = error(fit_wrong_activation)
    RESULT["bad"] = bad


# ---------------------------------------------------------------------------------------------- data parallel
def data_parallel():
    data_parallel = keras.distribution.DataParallel()  # all devices, set before tfdist is asked
    keras.distribution.set_distribution(data_parallel)
    RESULT["inert_before"] = tf.distribute.has_strategy()
    tfdist.use_keras_distribution()
    rng = np.random.default_rng(2)
    x = rng.normal(size=(50, 28, 28, 1)).astype("float32")
    y = rng.normal(size=(50, 10)).astype("float32")

    def train():
        model = get_model(0.0)
        model.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model, [float(v) for v in history.history["loss"]], float(model.evaluate(x, y, verbose=0))

    trained = train()
    keras.distribution.set_distribution(None)
    compare("dp_default", trained, train())
    RESULT["dp_default"]["devices"] = [d.split("/")[-1] for d in trained[0].distribute_strategy.extended.worker_devices]


# ------------------------------------------------------------------------------------------------------ hub
def hub():
    import keras_hub

    tfdist.use_keras_distribution()
    mesh = keras.distribution.DeviceMesh(
        shape=(2, 4), axis_names=["batch", "model"], devices=keras.distribution.list_devices()
    )
    rng = np.random.default_rng(3)
    tokens = rng.integers(1, 64, size=(16, 9))
    lengths = rng.integers(4, 9, size=(16, 1))
    mask = np.arange(8)[None, :] < lengths
    x = {"token_ids": tokens[:, :-1].astype("int32"), "padding_mask": mask}
    y, sample_weight = tokens[:, 1:].astype("int32"), mask.astype("float32")
    configs = {
        "llama": (
            keras_hub.models.LlamaBackbone,
            keras_hub.models.LlamaCausalLM,
            dict(vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=2, hidden_dim=32,
                 intermediate_dim=64),
        ),
        "gemma": (
            keras_hub.models.GemmaBackbone,
            keras_hub.models.GemmaCausalLM,
            dict(vocabulary_size=64, num_layers=2, num_query_heads=4, num_key_value_heads=4, hidden_dim=32,
                 intermediate_dim=64, head_dim=8),
        ),
    }

    def train(backbone_cls, task_cls, config):
        keras.utils.set_random_seed(4)
        model = task_cls(backbone=backbone_cls(**config), preprocessor=None)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), weighted_metrics=[])
        history = model.fit(x, y, sample_weight=sample_weight, batch_size=8, epochs=3, shuffle=False, verbose=0)
        return model, [float(v) for v in history.history["loss"]]

    for name, (backbone_cls, task_cls, config) in configs.items():

        reference, ref_losses = train(backbone_cls, task_cls, config)
        strategy = tfdist.ModelParallelStrategy(rules=backbone_cls.get_layout_map(mesh))
        with strategy.scope():
            by_strategy, strategy_losses = train(backbone_cls, task_cls, config)
        distribution = keras.distribution.ModelParallel(
            layout_map=backbone_cls.get_layout_map(mesh), batch_dim_name="batch"
        )
        with distribution.scope():
            by_distribution, distribution_losses = train(backbone_cls, task_cls, config)
        out = {"ref_losses": ref_losses, "strategy_mesh": strategy.mesh_shape}
        for entry, model, losses in (
            ("strategy", by_strategy, strategy_losses),
            ("distribution", by_distribution, distribution_losses),
        ):
            report = model.distribute_strategy.placement_report(model, print_fn=None)
            close, diff = weights_close(model.get_weights(), reference.get_weights(), atol=1e-4)
            sharded = sum(v.bytes_total for v in report.variables if any(a is not None for a in v.spec))
            replicated = sum(v.bytes_total for v in report.variables if all(a is None for a in v.spec))
            out[entry] = {
                "losses": losses,
                "weights_close": close,
                "weights_diff": diff,
                "strategy": type(model.distribute_strategy).__name__,
                "bytes_per_device": max(report.bytes_per_device.values()),
                "bytes_total": report.bytes_total,
                "sharded_bytes": sharded,
                "replicated_bytes": replicated,
                "split": sorted(v.path for v in report.variables if any(a is not None for a in v.spec)),
                "unmatched": [str(rule) for rule, _ in report.unmatched_rules],
            }
        RESULT[name] = out


try:
    {"guide": guide, "data_parallel": data_parallel, "hub": hub}[SCENARIO]()
finally:  # what was measured, also when a scenario fails (the test reads it only after a clean exit)
    with open(os.path.join(OUT, "result.json"), "w") as f:
        json.dump(RESULT, f, indent=1)
