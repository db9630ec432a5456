"""tfdist.advise: right recommendation on a tiny and a wide model; predicted speed-up vs a measured one.

The wide-model test runs in its own process with 2 simulated CPU devices of one core each
(intra-op threads = 1), like two separate accelerators on this 2-core host: there data parallelism
really pays, and the advisor's predicted speed-up is checked against `model.fit` timed side by side
under DataParallelStrategy and on one device (steady-state seconds per step, from batch-end times;
tolerance 30%). With TensorFlow's default threads
every simulated device already uses all cores, and the advisor rightly finds nothing to gain.
"""

import json

import keras
import numpy as np
import pytest

import tfdist
from tfdist import advisor

SPEEDUP_RTOL = 0.30


def mlp(width, depth, optimizer="sgd"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((width,))] + [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        + [keras.layers.Dense(10)]
    )
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def batch(n, width):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, width)).astype("float32"), rng.integers(0, 10, size=(n,)).astype("int32")


def test_tiny_model_stays_on_one_device():
    model = mlp(8, 1)
    before = [w.copy() for w in model.get_weights()]
    advice = tfdist.advise(model, batch(32, 8), devices=[f"CPU:{i}" for i in range(4)], rounds=3)
    assert advice.recommendation == "one device" and advice.mesh is None
    assert advice.predicted_speedup < 1.0  # the all-reduce alone costs more than the whole step
    assert advice.all_reduce_time > advice.parallel_compute_time / 4
    assert advice.gradient_bytes == advice.parameter_bytes == (8 * 8 + 8 + 8 * 10 + 10) * 4
    report = str(advice)
    assert "Recommendation: one device" in report and "communication would dominate" in report
    for a, b in zip(before, model.get_weights()):  # the user's model is left alone
        np.testing.assert_array_equal(a, b)


WIDE = """
import json, statistics, time
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)   # one core per simulated device (before TF starts)
import tfdist
tfdist.simulate_devices(2)
import keras, numpy as np
from tests.test_advise import batch, mlp

WIDTH, DEPTH, BATCH, STEPS, ROUNDS = 512, 2, 4096, 12, 5
x, y = batch(BATCH, WIDTH)
advice = tfdist.advise(mlp(WIDTH, DEPTH), (x, y), devices=["CPU:0", "CPU:1"], rounds=5)
print(advice, flush=True)

data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
one = mlp(WIDTH, DEPTH)
with tfdist.DataParallelStrategy(devices=["CPU:0", "CPU:1"]).scope():
    dp = mlp(WIDTH, DEPTH)

class Clock(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter())

def step_time(model):
    # Steady-state seconds per fit step: the median interval between batch ends, after a warm-up
    # (a fit call's own start-up, such as building its input iterator, is not a training step).
    clock = Clock()
    clock.times = []
    model.fit(data, steps_per_epoch=STEPS, epochs=1, verbose=0, callbacks=[clock])
    return statistics.median(b - a for a, b in zip(clock.times[3:], clock.times[4:]))
step_time(one), step_time(dp)  # trace
ratios = []
for r in range(ROUNDS):
    first, second = (one, dp) if r % 2 == 0 else (dp, one)
    t = {id(first): step_time(first), id(second): step_time(second)}
    ratios.append(t[id(one)] / t[id(dp)])
print(json.dumps({"recommendation": advice.recommendation, "mesh": advice.mesh,
                  "predicted": advice.predicted_speedup, "measured": statistics.median(ratios), "ratios": ratios}))
"""


def test_wide_model_with_large_batch_goes_data_parallel_and_predicts_the_speedup(python_subprocess):
    proc = python_subprocess(WIDE, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(proc.stdout)
    assert abs(result["predicted"] - result["measured"]) <= SPEEDUP_RTOL * result["measured"], result
    # The advice is right: data parallel, and it is measurably faster than one device.
    assert result["recommendation"] == "data parallel" and result["mesh"] == {"batch": 2}, result
    assert result["measured"] > 1.0, result


def test_weights_that_do_not_fit_one_device_get_a_model_axis():
    devices = [f"CPU:{i}" for i in range(4)]
    model = mlp(64, 2, optimizer="adam")
    data = batch(8, 64)
    base = tfdist.advise(model, data, devices=devices, rounds=1)
    state, act = base.parameter_bytes + base.optimizer_bytes, base.activation_bytes
    assert state == (2 * (64 * 64 + 64) + 64 * 10 + 10) * 4 * 3  # weights + Adam's two moments
    assert 0 < act < state / 2

    def per_device(m):  # a (4/m) x m mesh: weights split m ways, the batch 4/m ways
        return state / m + act / (4 // m)

    memory = int(per_device(2) / advisor.MEMORY_HEADROOM) + 1  # fits a model axis of 2, not 1
    hybrid = tfdist.advise(model, data, devices=devices, rounds=1, device_memory=memory)
    assert hybrid.recommendation == "hybrid" and hybrid.mesh == {"batch": 2, "model": 2}
    memory = int((per_device(4) + per_device(2)) / 2 / advisor.MEMORY_HEADROOM)  # needs all 4
    sharded = tfdist.advise(model, data, devices=devices, rounds=1, device_memory=memory)
    assert sharded.recommendation == "model parallel" and sharded.mesh == {"batch": 1, "model": 4}
    assert "ModelParallelStrategy(mesh={'batch': 1, 'model': 4}" in str(sharded)


@pytest.mark.parametrize(
    "args,kwargs,message",
    [
        ((np.ones((8, 4)),), {}, r"argument `batch`.*Expected a tuple \(x, y\)"),
        (((np.ones((8, 4)), np.ones((7, 1))),), {}, r"different batch sizes \[7, 8\]"),
        (((np.ones((2, 4)), np.ones((2, 1))),), {"devices": ["CPU:0", "CPU:1", "CPU:2"]}, r"2 example\(s\) cannot"),
        (((np.ones((8, 4)), np.ones((8, 1))),), {"devices": ["CPU:99"]}, r"'CPU:99' does not exist"),
        (((np.ones((8, 4)), np.ones((8, 1))),), {"devices": "CPU:0"}, r"Received: devices='CPU:0'"),
        (((np.ones((8, 4)), np.ones((8, 1))),), {"rounds": 0}, r"rounds=0.*integer >= 1"),
        (((np.ones((8, 4)), np.ones((8, 1))),), {"device_memory": -1}, r"device_memory=-1"),
        (((np.ones((8, 4)), np.ones((8, 1))),), {"min_speedup": 0}, r"min_speedup=0"),
    ],
)
def test_bad_arguments_name_the_problem(args, kwargs, message):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match=message):
        tfdist.advise(model, *args, **kwargs)


def test_uncompiled_model_is_an_error():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"not compiled.*model.compile"):
        tfdist.advise(model, (np.ones((8, 4)), np.ones((8, 1))))


def test_binary_prints_advice(python_subprocess):
    proc = python_subprocess(
        "import sys; from tfdist import advisor; "
        "sys.exit(advisor.run(['--width=16', '--depth=1', '--batch_size=32', '--num_devices=2', '--rounds=1']))",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Recommendation: one device" in proc.stdout and "all-reduced over 2 devices" in proc.stdout
    bad = python_subprocess("from tfdist import advisor; advisor.run(['--batch_size=0'])", timeout=60)
    assert bad.returncode == 2 and "--batch_size: 0 is not a positive integer" in bad.stderr


def test_every_optimizer_choice_of_the_binary_is_a_keras_optimizer():
    for name in advisor.OPTIMIZERS:
        assert isinstance(keras.optimizers.get(name), keras.optimizers.Optimizer), name


def test_recommendations_are_the_documented_ones():
    assert advisor.RECOMMENDATIONS == ("one device", "data parallel", "model parallel", "hybrid")
