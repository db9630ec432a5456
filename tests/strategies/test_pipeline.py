"""PipelineStrategy: stages on their devices, micro-batches, balancer, hybrid; equal to one device.

Every training comparison fits the same model (same seed, data order, global batch) once without
a strategy and once under PipelineStrategy on logical CPUs of the pytest process, then compares
weights (SGD atol 1e-5, Adam atol 1e-4), per-epoch loss and metrics (rtol 1e-5), evaluate and
predict (atol 1e-5): micro-batch gradients summed in another order than one device's differ
by float32 rounding only.
"""

import collections
import gc
import itertools
import os
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.placement import pipeline as pipeline_lib

SGD_ATOL = 1e-5
ADAM_ATOL = 1e-4
RTOL = 1e-5
OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1), "adam": lambda: keras.optimizers.Adam(1e-2)}


def mlp6(optimizer="sgd", widths=(32,) * 5, name="mlp6"):
    """Six Dense layers, d0..d5."""
    keras.utils.set_random_seed(3)
    layers = [keras.layers.Dense(w, activation="tanh", name=f"d{i}") for i, w in enumerate(widths)]
    model = keras.Sequential([keras.Input((16,)), *layers, keras.layers.Dense(3, name="d5")], name=name)
    model.compile(
        optimizer=OPTIMIZERS[optimizer](),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def mlp_data(n=40, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 16)).astype("float32"), rng.integers(0, 3, size=(n,)).astype("int32")


def lm(optimizer="adam"):
    keras.utils.set_random_seed(5)
    model = tfdist.models.transformer_lm(seq_len=16, vocab_size=64, d_model=32, num_heads=2, num_layers=2)
    model.compile(
        optimizer=OPTIMIZERS[optimizer](), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def lm_data(n=32, seed=1):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 64, size=(n, 17)).astype("int32")
    return tokens[:, :-1], tokens[:, 1:]


# One-device reference runs, shared by the tests that train the same model on the same data the same way.
_REFERENCES = {}


def reference(name, build, x, y, *, batch_size, epochs):
    """`build()` trained on one device, its history, evaluate and predict; trained once per module.

    `name` stands for `build` (a lambda or closure); the key holds every other input as well.
    """
    key = (name, x.tobytes(), y.tobytes(), batch_size, epochs)
    if key not in _REFERENCES:
        ref = build()
        ref_hist = ref.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0).history
        evaluated = ref.evaluate(x, y, batch_size=batch_size, verbose=0)
        _REFERENCES[key] = ref, ref_hist, evaluated, ref.predict(x, batch_size=batch_size, verbose=0)
    return _REFERENCES[key]


def compare(name, build, x, y, strategy, *, atol, batch_size=8, epochs=2):
    ref, ref_hist, ref_evaluated, ref_predicted = reference(name, build, x, y, batch_size=batch_size, epochs=epochs)
    with strategy.scope():
        model = build()
    hist = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0).history
    for a, b in zip(ref.weights, model.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), atol=atol, rtol=0, err_msg=a.path)
    for key in ref_hist:
        np.testing.assert_allclose(hist[key], ref_hist[key], rtol=RTOL, err_msg=key)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=batch_size, verbose=0), ref_evaluated, rtol=RTOL)
    np.testing.assert_allclose(model.predict(x, batch_size=batch_size, verbose=0), ref_predicted, atol=1e-5)
    return ref, model


def devices_of(variable):
    value = variable.value
    return {v.device.split("device:")[-1] for v in getattr(value, "values", [value])}


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_mlp_matches_one_device(stages, optimizer):
    x, y = mlp_data()
    strategy = tfdist.PipelineStrategy(stages=stages, microbatches=4)
    _, model = compare(
        ("mlp6", optimizer), lambda: mlp6(optimizer), x, y, strategy, atol=SGD_ATOL if optimizer == "sgd" else ADAM_ATOL
    )
    plan = strategy.plan
    assert plan.stages == stages and sum(len(s) for s in plan.layers) == 6
    # Each layer's weights and their optimizer slots live on the layer's stage device.
    for layer in model.layers:
        device = strategy.stage_devices[plan.stage_of(layer.name)][0].split("device:")[-1]
        for weight in layer.weights:
            assert devices_of(weight) == {device}, weight.path
            if optimizer == "adam":  # its slots too
                index = model.optimizer._get_variable_index(weight)
                assert devices_of(model.optimizer._momentums[index]) == {device}, weight.path
                assert devices_of(model.optimizer._velocities[index]) == {device}, weight.path


@pytest.mark.parametrize("stages", [2, 4])
def test_transformer_matches_one_device(stages):
    x, y = lm_data()
    strategy = tfdist.PipelineStrategy(stages=stages, microbatches=4)
    compare("lm", lm, x, y, strategy, atol=ADAM_ATOL, epochs=1)
    assert strategy.plan.stages == stages
    blocks = [strategy.plan.stage_of(f"block_{i}") for i in range(2)]
    assert blocks == sorted(blocks)


def test_hybrid_two_stages_two_replicas():
    x, y = mlp_data()
    strategy = tfdist.PipelineStrategy(stages=2, microbatches=2, replicas=2, devices=[f"CPU:{i}" for i in range(4)])
    assert strategy.num_replicas_in_sync == 2
    assert strategy.stage_devices == [["/device:CPU:0", "/device:CPU:2"], ["/device:CPU:1", "/device:CPU:3"]]
    _, model = compare(("mlp6", "adam"), lambda: mlp6("adam"), x, y, strategy, atol=ADAM_ATOL)
    assert strategy.plan.stage_of("d0") == 0 and strategy.plan.stage_of("d5") == 1
    assert devices_of(model.get_layer("d0").kernel) == {"CPU:0", "CPU:2"}
    assert devices_of(model.get_layer("d5").kernel) == {"CPU:1", "CPU:3"}


def test_uneven_final_batch_and_empty_microbatches():
    # 42 examples in batches of 8: the last batch has 2 examples for 4 micro-batches (two are empty).
    x, y = mlp_data(42)
    strategy = tfdist.PipelineStrategy(stages=2, microbatches=4)
    compare(("mlp6", "sgd"), lambda: mlp6("sgd"), x, y, strategy, atol=SGD_ATOL)


class UserPipelineStrategy(tfdist.PipelineStrategy):
    """A user's subclass, defined outside tfdist (in this test module): it keeps every fix."""


def test_a_users_subclass_keeps_the_uneven_first_batch_fix():
    # 9 examples in a global batch of 16: the first (only) batch splits 5/4 over the 2 replicas, which
    # crashes Keras' own symbolic build (AddN of unequal shapes), then 3/2 and 2/2 over micro-batches.
    x, y = mlp_data(9)
    strategy = UserPipelineStrategy(stages=2, microbatches=2, replicas=2, devices=[f"CPU:{i}" for i in range(4)])
    compare(("mlp6", "sgd"), lambda: mlp6("sgd"), x, y, strategy, atol=SGD_ATOL, batch_size=16)


def test_a_users_subclass_keeps_the_reshuffle_order():
    """A `shuffle()`d dataset reshuffles on every pass; building the model must not start a pass."""
    x, y = mlp_data(32)

    def dataset():
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(32, seed=5).batch(8)

    ref = mlp6("sgd")
    ref.fit(dataset(), epochs=2, verbose=0)
    strategy = UserPipelineStrategy(stages=2, microbatches=2, replicas=2, devices=[f"CPU:{i}" for i in range(4)])
    with strategy.scope():
        model = mlp6("sgd")
    model.fit(dataset(), epochs=2, verbose=0)
    for a, b in zip(ref.weights, model.weights):
        np.testing.assert_allclose(b.numpy(), a.numpy(), atol=SGD_ATOL, rtol=0, err_msg=a.path)


def test_explicit_placement_creates_weights_on_their_stage():
    strategy = tfdist.PipelineStrategy(stages=2, microbatches=2, placement={"d[0-1]": 0, "d[2-5]": 1})
    with strategy.scope():
        model = mlp6()
    # Placed as created, before any step.
    assert devices_of(model.get_layer("d1").kernel) == {"CPU:0"}
    assert devices_of(model.get_layer("d2").kernel) == {"CPU:1"}
    x, y = mlp_data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert strategy.plan.layers == (("d0", "d1"), ("d2", "d3", "d4", "d5"))
    assert strategy.plan.cost == "explicit"


def test_forward_and_gradient_ops_run_on_stage_devices():
    strategy = tfdist.PipelineStrategy(stages=2, microbatches=2, placement={"d[0-2]": 0, "d[3-5]": 1})
    with strategy.scope():
        model = mlp6()
    x, y = mlp_data(8)
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    graph = (
        tf.function(lambda d: strategy.run(model.train_step, args=(d,)))
        .get_concrete_function(next(iter(dataset)))
        .graph
    )
    matmuls = collections.Counter()
    for op in graph.get_operations():
        if op.type == "MatMul":
            layer = next(p for p in op.name.split("/") if p.startswith("d") and p[1].isdigit())
            kind = "backward" if "gradient_tape" in op.name else "forward"
            matmuls[(kind, layer.split("_")[0], op.device.split("device:")[-1])] += 1
    for i in range(6):
        device = "CPU:0" if i < 3 else "CPU:1"
        # 2 micro-batches: one forward matmul each; two backward matmuls each (input and kernel grads,
        # the first layer has no input gradient).
        assert matmuls[("forward", f"d{i}", device)] == 2, matmuls
        assert matmuls[("backward", f"d{i}", device)] == (2 if i == 0 else 4), matmuls
    assert sum(matmuls.values()) == 6 * 2 + 2 + 5 * 4, matmuls  # none elsewhere


def test_callbacks_and_save_load_on_one_device(tmp_path):
    x, y = mlp_data()
    strategy = tfdist.PipelineStrategy(stages=2, microbatches=4)
    with strategy.scope():
        model = mlp6("adam")
    path = str(tmp_path / "best.keras")
    callbacks = [
        keras.callbacks.ModelCheckpoint(path, monitor="loss", save_best_only=True),
        keras.callbacks.EarlyStopping(monitor="loss", patience=1),
    ]
    model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=callbacks)
    saved = str(tmp_path / "final.keras")
    model.save(saved)
    restored = keras.models.load_model(saved)  # no strategy: one device
    np.testing.assert_allclose(restored.predict(x, verbose=0), model.predict(x, batch_size=8, verbose=0), atol=1e-6)
    assert os.path.exists(path)
    for a, b in zip(model.weights, restored.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("replicas", [1, 2])
def test_gradient_accumulation_and_clipping(replicas):
    def build():
        model = mlp6("adam")
        optimizer = keras.optimizers.Adam(1e-2, gradient_accumulation_steps=2, global_clipnorm=0.5)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x, y = mlp_data()
    strategy = tfdist.PipelineStrategy(stages=2, microbatches=4 // replicas, replicas=replicas)
    _, model = compare("adam_accumulate_clip", build, x, y, strategy, atol=ADAM_ATOL)
    assert int(model.optimizer.iterations.numpy()) == 5  # 10 steps, accumulated in pairs


@pytest.mark.parametrize("replicas", [1, 2])
def test_loss_scale_optimizer(replicas):
    # Mixed precision's LossScaleOptimizer checks and unscales the summed micro-batch gradients.
    def build():
        model = mlp6("sgd")
        model.compile(
            optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        return model

    x, y = mlp_data()
    strategy = tfdist.PipelineStrategy(stages=2, microbatches=4 // replicas, replicas=replicas)
    _, model = compare("sgd_loss_scale", build, x, y, strategy, atol=SGD_ATOL)
    assert int(model.optimizer.iterations.numpy()) == 10  # 5 steps x 2 epochs, one update each


def test_auto_placement_frees_the_first_copies():
    # placement="auto" creates weights on stage 0 and moves them when the first step is traced:
    # the stage-0 copies (and their optimizer slots') must not stay alive.
    strategy = tfdist.PipelineStrategy(stages=2, microbatches=2)
    with strategy.scope():
        model = mlp6("adam")
    first = weakref.ref(model.get_layer("d5").kernel.value)
    x, y = mlp_data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    gc.collect()
    assert first() is None
    assert devices_of(model.get_layer("d5").kernel) == {"CPU:1"}


def test_steps_per_execution_and_on_batch_methods():
    x, y = mlp_data(32)

    def build():
        model = mlp6("sgd")
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=2,
        )
        return model

    compare("sgd_steps_per_execution_2", build, x, y, tfdist.PipelineStrategy(stages=2, microbatches=4), atol=SGD_ATOL)
    ref = mlp6("sgd")
    strategy = tfdist.PipelineStrategy(stages=2, microbatches=4)
    with strategy.scope():
        model = mlp6("sgd")
    for i in range(0, 32, 8):
        np.testing.assert_allclose(
            model.train_on_batch(x[i : i + 8], y[i : i + 8]), ref.train_on_batch(x[i : i + 8], y[i : i + 8]), rtol=RTOL
        )
    np.testing.assert_allclose(model.test_on_batch(x[:8], y[:8]), ref.test_on_batch(x[:8], y[:8]), rtol=RTOL)
    np.testing.assert_allclose(model.predict_on_batch(x[:8]), ref.predict_on_batch(x[:8]), atol=1e-5)


def test_model_without_input_built_by_fit():
    def build():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.layers.Dense(16, activation="tanh", name=f"d{i}") for i in range(3)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    x, y = mlp_data()
    strategy = tfdist.PipelineStrategy(stages=3, microbatches=2, placement={"d0": 0, "d1": 1, "d2": 2})
    compare("no_input", build, x, np.tile(y[:, None], (1, 16)).astype("float32"), strategy, atol=SGD_ATOL)
    assert strategy.plan.layers == (("d0",), ("d1",), ("d2",))


def test_plan_timed_reports_time_per_stage():
    plan = pipeline_lib.balance(unbalanced(), 4, cost="params").timed(unbalanced(), batch_size=8, rounds=1)
    assert plan.seconds is not None and len(plan.seconds) == 4 and all(t > 0 for t in plan.seconds)
    assert "ms per batch" in plan.report()


def test_gradient_colocation_hook_is_still_needed():
    # Plain tf.GradientTape builds backward ops in the device scope of `tape.gradient`, not next to
    # their forward ops: without tfdist's hook every gradient matmul below would be unplaced.
    with tf.device("CPU:1"):
        w = tf.Variable(tf.ones((4, 4)))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            with tf.device("CPU:1"):
                y = tf.matmul(x, w)
            loss = tf.reduce_sum(y)
        return tape.gradient(loss, w)

    graph = step.get_concrete_function(tf.TensorSpec((2, 4))).graph
    grads = [op for op in graph.get_operations() if op.type == "MatMul" and "gradient_tape" in op.name]
    assert grads and all(op.device == "" for op in grads)


def test_gradient_sums_and_bias_gradients_run_next_to_their_ops():
    # The tape sums the gradients of a tensor read twice (a residual stream) outside any gradient function,
    # and hands BiasAdd's gradient neither the op's inputs nor its outputs: TensorFlow leaves both
    # unplaced (they would run on the step's device, the last stage); while staging they run where their
    # gradients are.
    from tfdist import _compat
    from tfdist._compat import layer_call

    _compat.install("pipeline")
    with tf.device("CPU:1"):
        w, b = tf.Variable(tf.ones((4, 4))), tf.Variable(tf.zeros((4,)))

    def step(x):
        with tf.GradientTape() as tape:
            with tf.device("CPU:1"):
                h = tf.nn.bias_add(tf.matmul(x, w), b)
                y = h * h + h
            loss = tf.reduce_sum(y)
        return tape.gradient(loss, [w, b])

    def placed(staging):
        with layer_call.stage_devices({0: "CPU:1"} if staging else None):
            graph = tf.function(step).get_concrete_function(tf.TensorSpec((2, 4))).graph
        ops = [op for op in graph.get_operations() if op.type in ("AddN", "BiasAddGrad")]
        assert sorted(op.type for op in ops) == ["AddN", "BiasAddGrad"], ops
        return {op.device.split("device:")[-1] for op in ops}

    assert placed(False) == {""}
    assert placed(True) == {"CPU:1"}


# ------------------------------------------------------------------------------ balancer
def unbalanced():
    """Eight Dense layers; the first two hold half the parameters, so an equal number of layers per
    stage (two) is far from equal parameters over 4 stages, while [d0], [d1], [d2-d4], [d5-d7] is even."""
    keras.utils.set_random_seed(3)
    widths = [100] + [32] * 7
    layers = [keras.layers.Dense(w, activation="tanh", name=f"d{i}") for i, w in enumerate(widths)]
    model = keras.Sequential([keras.Input((32,)), *layers], name="unbalanced")
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_balancer_fixes_an_unbalanced_model():
    model = unbalanced()
    naive = pipeline_lib.even_split(model, 4)
    balanced = pipeline_lib.balance(model, 4, cost="params")
    assert naive.imbalance >= 2.0, naive.report()
    assert balanced.imbalance <= 1.25, balanced.report()
    assert balanced.layers == (("d0",), ("d1",), ("d2", "d3", "d4"), ("d5", "d6", "d7"))
    assert sum(balanced.params) == model.count_params()
    report = balanced.report()
    assert "| 0 | d0 | 3,300 |" in report and "max/mean stage cost 1.03" in report


@pytest.mark.parametrize("cost", ["flops", "time"])
def test_balancer_costs(cost):
    model = unbalanced()
    plan = pipeline_lib.balance(model, 4, cost=cost, batch_size=16, rounds=2)
    assert plan.stages == 4 and all(plan.layers)
    if cost == "flops":
        # Dense(32 -> 100) on 16 rows: a 2*16*32*100 matmul plus the bias-add and tanh, elementwise.
        assert plan.layer_costs["d0"] == 2 * 16 * 32 * 100 + 2 * 16 * 100
        assert plan.layers == (("d0",), ("d1",), ("d2", "d3", "d4"), ("d5", "d6", "d7"))
        assert plan.imbalance <= 1.25
    else:
        assert plan.seconds is not None and all(s > 0 for s in plan.seconds)
        assert "ms per batch" in plan.report()
    # A functional model whose layers take `training` and several inputs (the transformer LM).
    transformer = pipeline_lib.balance(lm(), 4, cost=cost, batch_size=2, rounds=1)
    assert transformer.stages == 4 and transformer.stage_of("logits") == 3


def test_partition_minimizes_the_largest_stage():
    assert tfdist.placement.pipeline is pipeline_lib  # reachable from the package, as documented
    assert pipeline_lib.partition([1, 1, 1, 1], 2) == [0, 0, 1, 1]
    assert pipeline_lib.partition([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [0] + [1] * 10
    costs = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    for stages in (2, 3, 4):
        assignment = pipeline_lib.partition(costs, stages)
        best = min(
            max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, len(costs))))
            for cuts in itertools.combinations(range(1, len(costs)), stages - 1)
        )
        sums = [sum(c for c, s in zip(costs, assignment) if s == k) for k in range(stages)]
        assert max(sums) == best and assignment == sorted(assignment) and min(sums) > 0


def test_strategy_auto_placement_balances():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 32)).astype("float32"), rng.integers(0, 32, size=(16,))
    strategy = tfdist.PipelineStrategy(stages=4, microbatches=2)
    with strategy.scope():
        model = unbalanced()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert strategy.plan.imbalance <= 1.25
    for layer, device in [("d0", "CPU:0"), ("d1", "CPU:1"), ("d4", "CPU:2"), ("d7", "CPU:3")]:
        assert devices_of(model.get_layer(layer).kernel) == {device}, layer


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"stages": 0, "microbatches": 2}, "stages"),
        ({"stages": 2, "microbatches": 0}, "microbatches"),
        ({"stages": 9, "microbatches": 2}, "needs 9 devices"),
        ({"stages": 2, "microbatches": 2, "devices": ["CPU:0"]}, "stages x replicas = 2 x 1 = 2"),
        ({"stages": 2, "microbatches": 2, "devices": ["CPU:0", "CPU:0"]}, "repeated"),
        ({"stages": 2, "microbatches": 2, "cost": "bytes"}, "Expected one of ('params', 'flops', 'time')"),
        ({"stages": 2, "microbatches": 2, "placement": "even"}, "Expected 'auto'"),
        ({"stages": 2, "microbatches": 2, "placement": {"d[": 0}}, "not a valid regular expression"),
        ({"stages": 2, "microbatches": 2, "placement": {"d0": 2}}, "integer in [0, 2)"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError) as e:
        tfdist.PipelineStrategy(**kwargs)
    assert message in str(e.value)


def fit_error(strategy, build=mlp6, batch_size=8):
    x, y = mlp_data()
    with strategy.scope():
        model = build()
    with pytest.raises(ValueError) as e:
        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
    return str(e.value)


def test_more_stages_than_layers():
    small = lambda: mlp6(widths=(8,) * 5)  # noqa: E731
    assert "stages=8 is more than the 6 layers" in fit_error(
        tfdist.PipelineStrategy(stages=8, microbatches=1), small
    )


def test_microbatches_not_dividing_the_global_batch():
    message = fit_error(tfdist.PipelineStrategy(stages=2, microbatches=4), batch_size=10)
    assert "microbatches=4 does not divide the global batch of 10" in message and "[1, 2, 5, 10]" in message


def test_rule_matching_nothing():
    message = fit_error(tfdist.PipelineStrategy(stages=2, microbatches=2, placement={"d[0-2]": 0, "dense_.*": 1}))
    assert "'dense_.*' matches no layer" in message and "['d0', 'd1', 'd2', 'd3', 'd4', 'd5']" in message


def test_rule_leaving_a_layer_unassigned():
    message = fit_error(tfdist.PipelineStrategy(stages=2, microbatches=2, placement={"d[0-2]": 0, "d[3-4]": 1}))
    assert "Layer 'd5'" in message and "matched by no placement rule" in message


def skip_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    a = keras.layers.Dense(8, name="a")(inputs)
    b = keras.layers.Dense(8, name="b")(a)
    c = keras.layers.Add(name="c")([a, b])
    out = keras.layers.Dense(3, name="out")(c)
    model = keras.Model(inputs, out)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_assignment_against_the_data_flow():
    placement = {"a": 0, "b": 1, "c": 0, "out": 1}  # c reads b (stage 1) but sits on stage 0
    message = fit_error(tfdist.PipelineStrategy(stages=2, microbatches=2, placement=placement), skip_model)
    assert "Layer 'c' (stage 0) reads the output of layer 'b' (stage 1)" in message


def test_weights_shared_across_stages_live_on_one():
    def tied():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        shared = keras.layers.Dense(8, name="shared")
        x = shared(inputs)
        x = keras.layers.Dense(8, name="middle")(x)
        x = shared(x)  # the same weights again, after a stage-1 layer
        model = keras.Model(inputs, keras.layers.Dense(3, name="head")(x))
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    class Tied(keras.layers.Layer):
        """Multiplies by another layer's kernel: a weight owned by two layers."""

        def __init__(self, source, **kwargs):
            super().__init__(**kwargs)
            self.source = source

        def call(self, x):
            return keras.ops.matmul(x, self.source.kernel)

    def shared_weight():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        first = keras.layers.Dense(8, name="first")
        x = keras.layers.Dense(8, name="middle")(first(inputs))
        x = Tied(first, name="tied")(x)
        model = keras.Model(inputs, keras.layers.Dense(3, name="head")(x))
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 8)).astype("float32"), rng.integers(0, 3, size=(8,))
    strategy = tfdist.PipelineStrategy(stages=2, microbatches=2, placement={"shared": 0, "middle": 1, "head": 1})
    with strategy.scope():
        model = tied()
    # A rule naming a layer places all its calls: its second call (after `middle`) is not on stage 1.
    with pytest.raises(ValueError, match="Layer 'shared:1' \\(stage 0\\) reads the output of layer 'middle'"):
        model.fit(x, y, batch_size=8, verbose=0)
    # `tied` reads `first`'s kernel on a later stage: the weights live on that stage, which runs `first` too.
    plan = pipeline_lib.plan_explicit(shared_weight(), {"first": 0, "middle": 0, "tied": 1, "head": 1}, 2)
    assert plan.layers == (("middle",), ("first", "tied", "head"))
    (shared,) = plan.shared
    assert shared.weights == ("first/kernel", "first/bias") and shared.placed == (0, 1) and shared.stage == 1
    assert plan.params == (72, 72 + 27)


def test_docstring_examples_run(python_subprocess):
    result = python_subprocess(
        """
        import doctest
        import tfdist
        tfdist.simulate_devices(2)
        from tfdist.placement import pipeline as placement
        from tfdist.strategies.pipeline import strategy
        for module in (placement, strategy):
            outcome = doctest.testmod(module)
            assert outcome.attempted > 0 and outcome.failed == 0, (module.__name__, outcome)
        print("ok")
        """
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stdout + result.stderr
