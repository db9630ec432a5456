"""Asserted by tests/strategies/test_model_parallel.py.

One ModelParallelStrategy scenario in a fresh process (run as a script, not collected by pytest).

Usage: python tests/scenarios/model_parallel_vs_one_device.py SCENARIO OUT_DIR

A DTensor runtime error poisons the process it happens in, so every scenario runs in a process
of its own with 8 simulated CPUs. Each scenario trains the same model once unsharded (no
strategy) and once under ModelParallelStrategy, and writes the numbers to OUT_DIR/result.json
for tests/strategies/test_model_parallel.py to check.
"""

import json
import os
import re
import sys
import warnings

SCENARIO, OUT = sys.argv[1], sys.argv[2]

if SCENARIO == "hybrid":
    # TensorFlow imported BEFORE tfdist, without DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION:
    # the strategy must still make DTensor skip its all-reduce combining pass (Adam check below).
    os.environ.pop("DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION", None)
    import tensorflow  # noqa: F401

import tfdist  # noqa: E402

tfdist.simulate_devices(8)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

from tfdist import layouts  # noqa: E402
from tfdist._compat import variables as keras_variables  # noqa: E402
from tfdist.placement import attributes  # noqa: E402
from tfdist.strategies import model_parallel  # noqa: E402
from tfdist.strategies.model_parallel import ModelParallelStrategy  # noqa: E402

VOCAB, SEQ, D_MODEL, HEADS, MLP = 64, 8, 32, 8, 64
RESULT = {}


def adam():
    return keras.optimizers.Adam(learning_rate=1e-2)


def lm_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def transformer_block(optimizer=adam):
    """Embedding + MultiHeadAttention + LayerNorm + FFN + LM head (functional)."""
    keras.utils.set_random_seed(11)
    tokens = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, D_MODEL, name="token_embedding")(tokens)
    h = keras.layers.LayerNormalization(name="attention_norm")(x)
    x = x + keras.layers.MultiHeadAttention(HEADS, D_MODEL // HEADS, name="attention")(h, h)
    h = keras.layers.LayerNormalization(name="mlp_norm")(x)
    h = keras.layers.Dense(MLP, activation="gelu", name="mlp_in")(h)
    x = x + keras.layers.Dense(D_MODEL, name="mlp_out")(h)
    logits = keras.layers.Dense(VOCAB, name="logits")(x)
    model = keras.Model(tokens, logits, name="block")
    model.compile(optimizer=optimizer(), loss=lm_loss(), metrics=["accuracy"])
    return model


class SubclassedBlock(keras.Model):
    """The same block as a subclassed model: its variables are created when it is first called."""

    def __init__(self):
        super().__init__(name="sub")
        self.embed = keras.layers.Embedding(VOCAB, D_MODEL, name="token_embedding")
        self.attention = keras.layers.MultiHeadAttention(HEADS, D_MODEL // HEADS, name="attention")
        self.norm = keras.layers.LayerNormalization(name="mlp_norm")
        self.mlp_in = keras.layers.Dense(MLP, activation="gelu", name="mlp_in")
        self.mlp_out = keras.layers.Dense(D_MODEL, name="mlp_out")
        self.head = keras.layers.Dense(VOCAB, name="logits")

    def call(self, tokens):
        x = self.embed(tokens)
        x = x + self.attention(x, x)
        x = x + self.mlp_out(self.mlp_in(self.norm(x)))
        return self.head(x)


def subclassed_block():
    keras.utils.set_random_seed(12)
    model = SubclassedBlock()
    model.compile(optimizer=adam(), loss=lm_loss())
    return model


def tokens(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, VOCAB, (n, SEQ)).astype("int32"), rng.integers(0, VOCAB, (n, SEQ)).astype("int32")


def max_diff(a, b):
    return float(max(np.max(np.abs(np.asarray(x) - np.asarray(y))) for x, y in zip(a, b)))


def rel_diff(a, b):
    a, b = np.asarray(a, dtype="float64"), np.asarray(b, dtype="float64")
    return float(np.max(np.abs(a - b) / np.abs(b)))


def compare(name, ref, ref_hist, model, hist, keys=("loss",)):
    for key in keys:
        RESULT[f"{name}_{key}_rel"] = rel_diff(hist[key], ref_hist[key])
    RESULT[f"{name}_weights_diff"] = max_diff(model.get_weights(), ref.get_weights())


def canonical(path):
    """Optimizer paths without Keras' uniquifying suffix ("adam_1/..." -> "adam/...")."""
    return re.sub(r"^adam(_\d+)?/", "adam/", path)


def specs(strategy, model):
    report = strategy.placement_report(model, print_fn=None)
    return {canonical(v.path): [v.spec, v.bytes_total, v.bytes_per_device] for v in report.variables}, report


def two_steps(model, x, y):
    """The losses of two train_on_batch steps on the first 16 examples (plain numpy input)."""
    return [float(model.train_on_batch(x[:16], y[:16], return_dict=True)["loss"]) for _ in range(2)]


def optimizer_state(model):
    return [np.asarray(v) for v in model.optimizer.variables]


def scenario_hybrid():
    """2x4 mesh, transformer preset, numpy input + validation_data, Adam; then saves checkpoints."""
    RESULT["env_after_construction"] = None
    x, y = tokens(64)
    vx, vy = tokens(16, seed=1)
    fit = {"batch_size": 16, "epochs": 2, "shuffle": False, "verbose": 0, "validation_data": (vx, vy)}
    ref = transformer_block()
    ref_hist = ref.fit(x, y, **fit).history
    strategy = ModelParallelStrategy(mesh={"batch": 2, "model": 4}, rules=layouts.transformer())
    RESULT["env_after_construction"] = os.environ.get(model_parallel.COMBINE_ALL_REDUCES_ENV)
    with strategy.scope():
        model = transformer_block()
    hist = model.fit(x, y, **fit).history
    compare("fit", ref, ref_hist, model, hist, keys=("loss", "val_loss", "accuracy"))
    RESULT["evaluate_diff"] = max_diff(model.evaluate(vx, vy, verbose=0), ref.evaluate(vx, vy, verbose=0))
    RESULT["predict_diff"] = max_diff([model.predict(vx, verbose=0)], [ref.predict(vx, verbose=0)])

    placements, report = specs(strategy, model)
    RESULT["placements"] = placements
    RESULT["table"] = report.table()
    RESULT["bytes_per_device"] = list(report.bytes_per_device.values())
    RESULT["bytes_total"] = report.bytes_total
    RESULT["unmatched"] = [str(rule) for rule, _ in report.unmatched_rules]
    # The real shards on the devices, not the report's arithmetic.
    kernel = next(w for w in model.weights if w.path == "mlp_in/kernel")
    RESULT["mlp_in_shard_shapes"] = [list(c.shape) for c in dtensor.unpack(kernel.value.read_value())]
    slots = {canonical(v.path): str(v.value.layout.sharding_specs) for v in model.optimizer.variables}
    RESULT["slot_layouts"] = slots

    # get_weights / set_weights round trip: the sharded model takes the unsharded one's weights.
    model.set_weights(ref.get_weights())
    RESULT["set_weights_diff"] = max_diff(model.get_weights(), ref.get_weights())
    RESULT["set_weights_evaluate_diff"] = max_diff(model.evaluate(vx, vy, verbose=0), ref.evaluate(vx, vy, verbose=0))

    # Checkpoints for the "reshard" scenario, then the next two steps' losses on this mesh.
    model.save(os.path.join(OUT, "model.keras"))
    model.save_weights(os.path.join(OUT, "model.weights.h5"))
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(os.path.join(OUT, "ckpt"))
    np.savez(
        os.path.join(OUT, "saved.npz"),
        *[np.asarray(w) for w in model.get_weights()],
        *optimizer_state(model),
    )
    RESULT["num_weights"] = len(model.get_weights())
    RESULT["next_losses"] = two_steps(model, x, y)
    RESULT["ref_next_losses"] = two_steps(ref, x, y)
    RESULT["test_on_batch"] = float(model.test_on_batch(vx[:8], vy[:8], return_dict=True)["loss"])
    RESULT["ref_test_on_batch"] = float(ref.test_on_batch(vx[:8], vy[:8], return_dict=True)["loss"])
    RESULT["predict_on_batch_diff"] = max_diff([model.predict_on_batch(vx[:8])], [ref.predict_on_batch(vx[:8])])

    # A dataset that reshuffles on every pass: the mesh trains on the same order as one device.
    def reshuffled():
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=3).batch(16)

    ref_shuffled = transformer_block()
    ref_shuffled.fit(reshuffled(), epochs=1, verbose=0)
    with strategy.scope():
        model_shuffled = transformer_block()
    model_shuffled.fit(reshuffled(), epochs=1, verbose=0)
    RESULT["reshuffled_weights_diff"] = max_diff(model_shuffled.get_weights(), ref_shuffled.get_weights())


def scenario_reshard():
    """Restores the hybrid scenario's checkpoints onto 4x2, 1x8 and one device.

    One model per target: the Keras file's, trained two steps; then the .weights.h5 file and then the
    TensorFlow checkpoint read over what those steps changed (weights, slots and the iteration count), each
    followed by the same two steps, which reuse the model's traced train step.
    """
    src = sys.argv[3]
    saved = np.load(os.path.join(src, "saved.npz"))
    saved = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    x, y = tokens(64)
    targets = {
        "4x2": {"batch": 4, "model": 2},
        "1x8": {"batch": 1, "model": 8},
        "one_device": None,
    }
    for target, mesh in targets.items():
        strategy = tf.distribute.get_strategy() if mesh is None else ModelParallelStrategy(
            mesh=mesh, rules=layouts.transformer())
        for fmt in ("keras", "weights_h5", "checkpoint"):
            with strategy.scope():
                if fmt == "keras":
                    model = keras.saving.load_model(os.path.join(src, "model.keras"))
                elif fmt == "weights_h5":
                    model.load_weights(os.path.join(src, "model.weights.h5"))
                else:
                    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
                    checkpoint.read(os.path.join(src, "ckpt")).assert_consumed()
            key = f"{target}_{fmt}"
            state = [np.asarray(w) for w in model.get_weights()] + optimizer_state(model)
            RESULT[f"{key}_state_diff"] = max_diff(state, saved)
            RESULT[f"{key}_state_count"] = [len(state), len(saved)]
            RESULT[f"{key}_next_losses"] = two_steps(model, x, y)
            if mesh is not None:
                kernel = next(w for w in model.weights if w.path.endswith("mlp_in/kernel"))
                RESULT[f"{key}_mlp_in_layout"] = list(kernel.value.layout.sharding_specs)
                RESULT[f"{key}_mesh_shape"] = list(kernel.value.layout.mesh.shape())


def scenario_subclassed():
    """Subclassed model on a 1-D model mesh, tf.data input and validation data."""
    x, y = tokens(48)
    vx, vy = tokens(16, seed=1)
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    val = tf.data.Dataset.from_tensor_slices((vx, vy)).batch(8)
    fit = {"epochs": 2, "verbose": 0, "validation_data": val}
    ref = subclassed_block()
    ref_hist = ref.fit(train, **fit).history
    strategy = ModelParallelStrategy(mesh={"model": 8}, rules=layouts.transformer())
    RESULT["batch_axis"] = strategy.batch_axis
    with strategy.scope():
        model = subclassed_block()
    hist = model.fit(train, **fit).history
    compare("fit", ref, ref_hist, model, hist, keys=("loss", "val_loss"))
    placements, report = specs(strategy, model)
    RESULT["placements"] = placements
    RESULT["unmatched"] = [str(rule) for rule, _ in report.unmatched_rules]
    RESULT["misplaced"] = [list(m) for m in report.misplaced]

    # With Keras' name scope as the only source of paths (the hook's answer and the attribute paths, which
    # the rules would match too, hidden), the rules would silently miss every variable of a model built
    # later; the report says so.
    with strategy.scope():
        late = subclassed_block()
    real, real_attribute = keras_variables.creating_variable_path, attributes.path_at_creation
    keras_variables.creating_variable_path = lambda: None
    attributes.path_at_creation = lambda variable, rules: None
    try:
        late.predict(x[:16], verbose=0)
    finally:
        keras_variables.creating_variable_path, attributes.path_at_creation = real, real_attribute
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        late_report = strategy.placement_report(late, print_fn=None)
    RESULT["late_warnings"] = [str(w.message) for w in caught]
    RESULT["late_misplaced"] = [m[0] for m in late_report.misplaced]
    RESULT["late_problems"] = late_report.problems()

    # The project's reference LM (custom block layers built in build()): every preset rule applies.
    from tfdist import models

    with strategy.scope():
        lm = models.transformer_lm(seq_len=SEQ, vocab_size=VOCAB, d_model=D_MODEL, num_heads=HEADS, num_layers=1)
        lm.compile(optimizer=adam(), loss=lm_loss())
    RESULT["lm_loss"] = float(lm.train_on_batch(x[:16], y[:16], return_dict=True)["loss"])
    lm_placements, lm_report = specs(strategy, lm)
    RESULT["lm_placements"] = {path: entry[0] for path, entry in lm_placements.items()}
    RESULT["lm_problems"] = lm_report.problems()


def scenario_data_and_conv():
    """A batch-only mesh (pure data parallelism) and the conv preset on a Sequential CNN."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(32, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 4, size=(32,)).astype("int32")

    def cnn():
        keras.utils.set_random_seed(5)
        model = keras.Sequential(
            [
                keras.Input((8, 8, 3)),
                keras.layers.Conv2D(8, 3, activation="relu"),
                keras.layers.Conv2D(16, 3, activation="relu"),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(4),
            ]
        )
        model.compile(optimizer=adam(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    fit = {"batch_size": 16, "epochs": 2, "shuffle": False, "verbose": 0}
    for name, mesh, rules in (
        ("batch_only", {"batch": 8}, layouts.data_parallel()),
        ("conv", {"batch": 2, "model": 4}, layouts.conv()),
    ):
        ref = cnn()
        ref_hist = ref.fit(x, y, **fit).history
        strategy = ModelParallelStrategy(mesh=mesh, rules=rules)
        with strategy.scope():
            model = cnn()
        hist = model.fit(x, y, **fit).history
        compare(name, ref, ref_hist, model, hist)
        RESULT[f"{name}_placements"], _ = specs(strategy, model)

    # A batch the batch axis does not divide (9 over 2): every device computes all of it, as one device does.
    ref.fit(x[:9], y[:9], batch_size=9, shuffle=False, verbose=0)
    model.fit(x[:9], y[:9], batch_size=9, shuffle=False, verbose=0)
    RESULT["uneven_weights_diff"] = max_diff(model.get_weights(), ref.get_weights())

    # shard_value (each variable and host batch onto the mesh): each device gets its numpy slice of the value.
    mesh, sizes = strategy.mesh, {"batch": 2, "model": 4}
    value = np.arange(8 * 12 * 4, dtype="float32").reshape(8, 12, 4)
    exact = {}
    for spec in ((None, "model", None), ("batch", None, None), ("batch", "model", None), ("model", None, "batch")):
        layout = model_parallel.variables.layout_of(spec, mesh)
        parts = [c.numpy() for c in dtensor.unpack(model_parallel.shard_value(value, layout))]
        wanted = []
        for location in mesh.local_device_locations():
            index = [slice(None) if axis is None else
                     slice(location[axis] * n // sizes[axis], (location[axis] + 1) * n // sizes[axis])
                     for n, axis in zip(value.shape, spec)]
            wanted.append(value[tuple(index)])
        exact[str(spec)] = all(np.array_equal(a, b) for a, b in zip(parts, wanted, strict=True))
    RESULT["shard_value_exact"] = exact
    try:
        model_parallel.shard_value(value[:6], model_parallel.variables.layout_of(("model", None, None), mesh))
        RESULT["shard_value_uneven"] = "no error"
    except ValueError as e:
        RESULT["shard_value_uneven"] = str(e)


class TutorialSubclassed(keras.Model):
    """The DTensor tutorial's subclassed MLP: layers created in __init__, variables when first called."""

    def __init__(self, name=None):
        super().__init__(name=name)
        self.dense_in = keras.layers.Dense(16, activation="relu", name="dense_in")
        self.dense_out = keras.layers.Dense(8, name="dense_out")

    def call(self, x):
        return self.dense_out(self.dense_in(x))


def tutorial_model(kind):
    keras.utils.set_random_seed(21)
    if kind == "sequential":
        return keras.Sequential(
            [
                keras.Input((12,)),
                keras.layers.Dense(16, activation="relu", name="dense_in"),
                keras.layers.Dense(8, name="dense_out"),
            ]
        )
    return TutorialSubclassed(name="sub")


TUTORIAL_RULES = [
    (r"dense_in/kernel$", (None, "model")),
    (r"dense_in/bias$", ("model",)),
    (r"dense_out/kernel$", ("model", None)),
]
TUTORIAL_STEPS, TUTORIAL_BATCH = 5, 16


def tutorial_step(model, optimizer, compile_step=True):
    """The dtensor_keras tutorial's training step: tape, loss, gradients, `apply_gradients`; no `strategy.run`."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(loss_fn(y, logits))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return tf.function(train_step) if compile_step else train_step


def tutorial_data():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(TUTORIAL_STEPS * TUTORIAL_BATCH, 12)).astype("float32")
    y = rng.integers(0, 8, size=(TUTORIAL_STEPS * TUTORIAL_BATCH,)).astype("int32")
    return x, y


def tfdist_warnings(caught):
    return [str(w.message) for w in caught if str(w.message).startswith("ModelParallelStrategy")]


def scenario_dtensor_loop():
    """The dtensor_keras tutorial's custom loop (no `strategy.run`), in the scope and outside it, vs one device."""
    x, y = tutorial_data()
    batches = [(x[i : i + TUTORIAL_BATCH], y[i : i + TUTORIAL_BATCH]) for i in range(0, len(x), TUTORIAL_BATCH)]
    for kind in ("sequential", "subclassed"):
        ref = tutorial_model(kind)
        ref_optimizer = adam()
        ref_step = tutorial_step(ref, ref_optimizer)
        RESULT[f"{kind}_ref_losses"] = [float(ref_step(bx, by)) for bx, by in batches]
        RESULT[f"{kind}_num_weights"] = len(ref.weights)
        ref_weights = ref.get_weights()
        ref_predictions = tutorial_model(kind)(x[:TUTORIAL_BATCH]).numpy()
        # inside: the loop runs in the scope; outside: after it; eager: outside, no tf.function, and the
        # model is first called on a plain numpy batch.
        for where in ("inside", "outside", "eager") if kind == "subclassed" else ("inside", "outside"):
            key = f"{kind}_{where}"
            strategy = ModelParallelStrategy(mesh={"batch": 2, "model": 4}, rules=TUTORIAL_RULES)
            with strategy.scope():
                model = tutorial_model(kind)
                optimizer = adam()
            step = tutorial_step(model, optimizer, compile_step=where != "eager")
            if where == "outside":  # DTensor batches from the strategy's dataset
                dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(TUTORIAL_BATCH)
                inputs = list(strategy.experimental_distribute_dataset(dataset))
            else:  # host arrays packed into batch-sharded DTensors
                inputs = [strategy.shard_batch(batch) for batch in batches]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if where == "eager":
                    predictions = model(x[:TUTORIAL_BATCH])
                    RESULT[f"{key}_first_call_diff"] = max_diff([predictions], [ref_predictions])
                    RESULT[f"{key}_first_call_layout"] = list(dtensor.fetch_layout(predictions).sharding_specs)
                if where == "inside":
                    with strategy.scope():
                        losses = [float(step(bx, by)) for bx, by in inputs]
                else:
                    losses = [float(step(bx, by)) for bx, by in inputs]
            RESULT[f"{key}_warnings"] = tfdist_warnings(caught)
            RESULT[f"{key}_losses"] = losses
            RESULT[f"{key}_weights_diff"] = max_diff(model.get_weights(), ref_weights)
            RESULT[f"{key}_num_weights"] = len(model.weights)
            kernel = next(w for w in model.weights if w.path.endswith("dense_in/kernel"))
            RESULT[f"{key}_kernel_layout"] = list(kernel.value.layout.sharding_specs)
            RESULT[f"{key}_kernel_shards"] = [list(c.shape) for c in dtensor.unpack(kernel.value.read_value())]
            # Slot paths carry the model's name ("adam/sequential_2_dense_in_kernel_momentum"): keyed from "dense_".
            RESULT[f"{key}_slot_layouts"] = {
                "dense_" + v.path.split("dense_", 1)[1]: list(v.value.layout.sharding_specs)
                for v in optimizer.variables
                if "dense_" in v.path
            }


def scenario_unmatched_rules():
    """Rules that match no weight: one warning per model once it is built, at fit or in a custom loop."""
    x, y = tutorial_data()
    # The tutorial's rule on a subclassed model whose layers keep Keras' default names.
    rules = [("feature.*kernel", (None, "model")), (r"dense_in/kernel$", (None, "model"))]
    strategy = ModelParallelStrategy(mesh={"batch": 2, "model": 4}, rules=rules)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with strategy.scope():
            model = TutorialSubclassed()
            model.compile(optimizer=adam(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        RESULT["fit_built_before"] = model.built
        model.fit(x, y, batch_size=TUTORIAL_BATCH, epochs=2, verbose=0)
        RESULT["fit_warnings"] = tfdist_warnings(caught)
        model.evaluate(x, y, batch_size=TUTORIAL_BATCH, verbose=0)
        model.predict(x, batch_size=TUTORIAL_BATCH, verbose=0)
        RESULT["after_evaluate_predict_warnings"] = tfdist_warnings(caught)
    RESULT["fit_paths"] = [w.path for w in model.weights]

    # A custom loop: the warning comes once, at the first step (when the model is built).
    with strategy.scope():
        looped = TutorialSubclassed()
        optimizer = adam()
    step = tutorial_step(looped, optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            step(*strategy.shard_batch((x[i * 16 : (i + 1) * 16], y[i * 16 : (i + 1) * 16])))
    RESULT["loop_warnings"] = tfdist_warnings(caught)

    # A model inside another: the inner model's call does not report the outer model's rules.
    nested_rules = [(r"inner_dense/kernel$", (None, "model")), (r"head/kernel$", ("model", None))]
    nested_strategy = ModelParallelStrategy(mesh={"batch": 2, "model": 4}, rules=nested_rules)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nested_strategy.scope():
            inputs = keras.Input((12,))
            inner = keras.Model(inputs, keras.layers.Dense(16, name="inner_dense")(inputs), name="inner")
            outer = keras.Sequential([keras.Input((12,)), inner, keras.layers.Dense(8, name="head")], name="outer")
            outer.compile(optimizer=adam(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        outer.fit(x, y, batch_size=TUTORIAL_BATCH, epochs=1, verbose=0)
    RESULT["nested_warnings"] = tfdist_warnings(caught)
    RESULT["nested_head_layout"] = list(outer.layers[-1].kernel.value.layout.sharding_specs)


def scenario_unsafe_env():
    """With DTensor's all-reduce combining pass on: the strategy refuses; forced, Adam goes wrong."""
    try:
        ModelParallelStrategy(mesh={"batch": 2, "model": 4}, rules=layouts.transformer())
        RESULT["refused"] = None
    except RuntimeError as e:
        RESULT["refused"] = str(e)
    model_parallel.strategy.ensure_safe_dtensor_env = lambda: None  # force it, to show what the guard prevents
    x, y = tokens(64)
    fit = {"batch_size": 16, "epochs": 2, "shuffle": False, "verbose": 0}
    ref = transformer_block()
    ref_hist = ref.fit(x, y, **fit).history
    strategy = ModelParallelStrategy(mesh={"batch": 2, "model": 4}, rules=layouts.transformer())
    with strategy.scope():
        model = transformer_block()
    hist = model.fit(x, y, **fit).history
    compare("unsafe", ref, ref_hist, model, hist)


if __name__ == "__main__":
    globals()[f"scenario_{SCENARIO}"]()
    with open(os.path.join(OUT, "result.json"), "w") as f:
        json.dump(RESULT, f, indent=1, default=str)
