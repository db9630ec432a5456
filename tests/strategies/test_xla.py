"""XLA (`jit_compile=True`) under every strategy: compiled where the weights live, equal to one device.

Keras compiles a whole `strategy.run` as one XLA cluster, which fails under any MirroredStrategy
and is ignored by DTensor. tfdist compiles each replica's step on its own device
(DataParallelStrategy, MultiWorkerStrategy: see test_multi_worker's "xla" config), each stage's
layers on the stage's device (PipelineStrategy), and refuses it under ModelParallelStrategy.
Each run is compared with one device compiled the same way: weights SGD atol 1e-5, losses and
metrics rtol 1e-5, evaluate and predict atol 1e-5; the traced step is searched for calls of
XLA-compiled functions (`_XlaMustCompile`) and their devices.
"""

import collections
import re
import sys

import _procs
import _xla
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist

ATOL = 1e-5
RTOL = 1e-5


def mlp(jit_compile, *, optimizer="sgd", steps_per_execution=1):
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [
            keras.Input((12,)),
            keras.layers.Dense(32, activation="relu", name="d0"),
            keras.layers.Dense(32, activation="tanh", name="d1"),
            keras.layers.Dense(16, activation="relu", name="d2"),
            keras.layers.Dense(3, name="d3"),
        ]
    )
    sgd = keras.optimizers.SGD(
        0.1, global_clipnorm=1.0, gradient_accumulation_steps=2 if optimizer == "accumulate" else None
    )
    model.compile(
        optimizer=keras.optimizers.LossScaleOptimizer(sgd) if optimizer == "loss_scale" else sgd,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=jit_compile,
        steps_per_execution=steps_per_execution,
    )
    return model


def data(n=61):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 12)).astype("float32"), rng.integers(0, 3, size=(n,)).astype("int32")


def train(strategy, batch_size=16, n=61, **model_kwargs):
    x, y = data(n)
    with strategy.scope():
        model = mlp(**model_kwargs)
    history = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0).history
    evaluated = model.evaluate(x, y, batch_size=batch_size, verbose=0)
    predicted = model.predict(x, batch_size=batch_size, verbose=0)
    return model, history, evaluated, predicted


_ONE_DEVICE = {}


def one_device(optimizer="sgd", n=61):
    """The one-device run (compiled with XLA) that runs under a strategy are compared with; once per module.

    Keyed by what changes its numbers. Not by `steps_per_execution`: on one device Keras loops over the
    same compiled step on the same batches, and the run is bit for bit the one with steps_per_execution=1.
    """
    if (optimizer, n) not in _ONE_DEVICE:
        _ONE_DEVICE[optimizer, n] = train(tf.distribute.get_strategy(), n=n, jit_compile=True, optimizer=optimizer)
    return _ONE_DEVICE[optimizer, n]


def assert_same_run(run, reference):
    model, history, evaluated, predicted = run
    ref_model, ref_history, ref_evaluated, ref_predicted = reference
    for a, b in zip(ref_model.get_weights(), model.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=ATOL)
    for key in ref_history:
        np.testing.assert_allclose(history[key], ref_history[key], rtol=RTOL)
    np.testing.assert_allclose(evaluated, ref_evaluated, rtol=RTOL)
    np.testing.assert_allclose(predicted, ref_predicted, rtol=0, atol=ATOL)
    # Training moved the weights: the comparison is not trivially true.
    assert max(np.abs(w).max() for w in ref_model.get_weights()) > 0.1


def _device_index(device):
    return tf.DeviceSpec.from_string(device).device_index


@pytest.mark.parametrize(
    "optimizer, steps_per_execution",
    [("sgd", 1), ("loss_scale", 1), ("accumulate", 1), ("sgd", 2)],
)
def test_data_parallel_compiles_each_replica_and_matches_one_device(optimizer, steps_per_execution):
    kwargs = dict(optimizer=optimizer, steps_per_execution=steps_per_execution)
    reference = one_device(optimizer)
    strategy = tfdist.DataParallelStrategy(devices=["CPU:0", "CPU:1"])
    # 61 examples in batches of 16: the last step splits 7/6 over the replicas (each compiles its own shapes).
    run = train(strategy, jit_compile=True, **kwargs)
    assert_same_run(run, reference)
    model = run[0]
    for function in (model.train_function, model.test_function):
        calls = _xla.compiled_calls(function)
        # One compiled step per replica, each on its device (steps_per_execution=2: in the loop body).
        assert sorted(map(_device_index, calls)) == [0, 1], calls


def test_data_parallel_without_jit_compile_has_no_compiled_call():
    """The check above can fail: an uncompiled step has no XLA call."""
    model = train(tfdist.DataParallelStrategy(devices=["CPU:0", "CPU:1"]), jit_compile=False)[0]
    assert _xla.compiled_calls(model.train_function) == []


_XLA_RUN = """
import sys
import keras, numpy as np, tensorflow as tf
import tfdist
tfdist.simulate_devices(2)
raw = sys.argv[1] == "raw"
devices = ["CPU:0", "CPU:1"]
for jit in sys.argv[2:]:  # one fit per value, each with its own strategy and model; its log after a marker line
    print(f"RUN jit={jit}", file=sys.stderr, flush=True)
    s = tf.distribute.MirroredStrategy(devices) if raw else tfdist.DataParallelStrategy(devices=devices)
    with s.scope():
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        m.compile(optimizer="sgd", loss="mse", jit_compile=jit == "1")
    try:
        m.fit(np.ones((8, 4), "float32"), np.ones((8, 1), "float32"), batch_size=4, verbose=0)
        print(f"RESULT jit={jit} trained", flush=True)
    except tf.errors.InvalidArgumentError as e:
        print(f"RESULT jit={jit} failed", "Trying to access resource" in str(e), flush=True)
    sys.stderr.flush()
"""


def _xla_runs(tmp_path, raw, *jits):
    """Runs `_XLA_RUN` in a process of its own: {jit: (the RESULT line or None, that fit's stderr)}."""
    script = tmp_path / "xla_run.py"
    script.write_text(_XLA_RUN)
    out = _procs.run([sys.executable, str(script), raw, *jits], timeout=300, env={"TF_CPP_MIN_LOG_LEVEL": "0"})
    logs = re.split(r"^RUN jit=(\d)$", out.stderr, flags=re.MULTILINE)[1:]
    stderr = dict(zip(logs[::2], logs[1::2]))
    runs = {}
    for jit in jits:
        result = re.search(rf"RESULT jit={jit} (.*)", out.stdout)
        runs[jit] = (result and result.group(1), stderr.get(jit, out.stderr))
    return runs, out


@pytest.fixture(scope="module")
def tfdist_xla_runs(tmp_path_factory):
    """Both tfdist fits (jit_compile False, then True) in one process."""
    return _xla_runs(tmp_path_factory.mktemp("xla_run"), "tfdist", "0", "1")


@pytest.mark.parametrize("raw, jit", [("raw", "1"), ("tfdist", "1"), ("tfdist", "0")])
def test_xla_really_compiles_where_raw_mirrored_strategy_fails(request, tmp_path, raw, jit):
    """In processes of their own (plain MirroredStrategy collectives would share keys with the other
    tests), with TensorFlow's info log on: it says "Compiled cluster using XLA!" when XLA ran.
    The two tfdist fits share one process (each fit's log is told apart by a marker line before it)."""
    runs, out = request.getfixturevalue("tfdist_xla_runs") if raw == "tfdist" else _xla_runs(tmp_path, raw, jit)
    result, stderr = runs[jit]
    assert result, out.stdout[-2000:] + out.stderr[-3000:]
    compiled = "Compiled cluster using XLA" in stderr
    if raw == "raw":  # Keras' one cluster over both replicas cannot reach replica 1's variables
        assert result == "failed True", stderr[-3000:]
    else:
        assert result == "trained", stderr[-3000:]
        assert compiled == (jit == "1"), stderr[-3000:]


def test_pipeline_compiles_each_stage_layer_on_its_device():
    # 64 examples in batches of 16: one trace of the step.
    reference = one_device(n=64)
    strategy = tfdist.PipelineStrategy(stages=2, microbatches=2, devices=["CPU:0", "CPU:1"])
    run = train(strategy, jit_compile=True, n=64)
    assert_same_run(run, reference)
    model = run[0]
    placed = {layer.name: _device_index(layer.kernel.value.device) for layer in model.layers}
    assert sorted(set(placed.values())) == [0, 1], placed
    calls = collections.Counter(map(_device_index, _xla.compiled_calls(model.train_function)))
    # Each layer's forward and backward, compiled on its stage's device, called once per micro-batch (2).
    per_stage = collections.Counter(placed.values())
    assert calls == {stage: 2 * 2 * n for stage, n in per_stage.items()}, (calls, placed)


def test_model_parallel_refuses_jit_compile_with_a_clear_error():
    strategy = tfdist.ModelParallelStrategy(mesh={"batch": 2, "model": 2}, devices=[f"CPU:{i}" for i in range(4)])
    x, y = data(16)
    with strategy.scope():
        model = mlp(True)
    with pytest.raises(ValueError, match=r"ModelParallelStrategy does not compile steps with XLA.*jit_compile=False"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    with strategy.scope():
        model = mlp("auto")
    assert model.jit_compile is False
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def test_auto_follows_keras_one_device_rule():
    """Keras turns "auto" off under any tf.distribute strategy; tfdist's data-parallel strategies
    answer as Keras does for one device: XLA on accelerators, not on CPUs (as here)."""
    with tfdist.DataParallelStrategy(devices=["CPU:0", "CPU:1"]).scope():
        model = mlp("auto")
    assert model.jit_compile is False
    extended = tfdist.DataParallelStrategy(devices=["CPU:0", "CPU:1"]).extended
    assert extended._tfdist_auto_jit(model) is False


def test_a_cross_replica_operation_inside_a_compiled_step_gets_a_clear_error():
    strategy = tfdist.DataParallelStrategy(devices=["CPU:0", "CPU:1"])
    x, y = data(16)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((12,)), keras.layers.Dense(8), keras.layers.BatchNormalization(synchronized=True)]
        )
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    with pytest.raises(RuntimeError, match=r"jit_compile=True under DataParallelStrategy.*synchronized BatchNorm"):
        model.fit(x, np.zeros((16, 8), "float32"), batch_size=8, epochs=1, verbose=0)
