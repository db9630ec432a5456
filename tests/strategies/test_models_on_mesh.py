"""KerasHub models nobody here wrote, on DTensor meshes: `generate` equals one device; the DTensor faults worked around.

One file tells the whole scenario: run as a script (`python tests/strategies/test_models_on_mesh.py SCENARIO OUT`), it
simulates 8 CPUs and writes OUT/result.json; as a test module it runs the scenarios two at a time
(`_procs.Queue`) and checks their numbers.

- "dtensor_faults": the DTensor faults tfdist works around (tfdist/_compat/spmd_ops.py), reproduced on a raw
  8-device mesh with TensorFlow's own ops, in a process of their own (a DTensor runtime error poisons its process):
  when a test here says one is gone, TensorFlow fixed it and the workaround can go. (OneHot split on its depth shows
  only inside Qwen3-MoE's own layout map, and the Unpack of a stack's gradient only inside Gemma 3's attention under
  `layouts.auto()`: cells of tests/strategies/test_conformance.py, which also trains the MoE models on meshes.)
- "generate": a tiny KerasHub Qwen3 causal LM trained under ModelParallelStrategy {2, 4} and ZeRO-3, then
  greedy `generate` and a user's `tf.function` called with a plain batch.

Tolerances: weights after SGD 1e-5 (float32 sums over shards associate differently), losses rtol 1e-4.
"""

import json
import os
import sys

import _procs
import pytest

SGD_ATOL = 1e-5
LOSS_RTOL = 1e-4
TIMEOUT_S = 240
SCENARIOS = ("generate", "dtensor_faults")


# ---------------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """The scenarios, queued two at a time; `result(scenario)` waits for one and returns its result.json."""
    queue = _procs.Queue(tmp_path_factory.mktemp("logs"), parallel=2, timeout=TIMEOUT_S)
    dirs = {name: tmp_path_factory.mktemp(name) for name in SCENARIOS}
    for name in SCENARIOS:
        queue.add(name, [sys.executable, __file__, name, str(dirs[name])], _procs.clean_env(TF_CPP_MIN_LOG_LEVEL="3"))

    def result(name):
        code, output = queue.result(name)
        status = f"killed after {TIMEOUT_S}s" if code is None else f"exit status {code}"
        assert code == 0, f"scenario {name!r} failed ({status}):\n{output[-9000:]}"
        with open(os.path.join(dirs[name], "result.json")) as f:
            return json.load(f)

    yield result
    queue.kill_all()


def test_tensorflow_still_expands_top_k_gradient_wrongly_over_a_split_batch(results):
    # TensorFlow's own gradient of top-k after a reshape of a batch-split tensor: out of range or wrong.
    # If this fails, DTensor got it right: drop the "top_k_gradient" hook.
    assert results("dtensor_faults")["top_k_gradient"] != "equal"


@pytest.mark.parametrize("fault", ["depthwise_filter_gradient", "avg_pool_gradient"])
def test_tensorflow_still_cannot_lay_out_these_gradients(results, fault):
    # If one fails, DTensor lays out that gradient: drop its hook ("depthwise_conv_gradient" or
    # "avg_pool_gradient"), whose replacement EfficientNet's and DenseNet's training under DTensor uses.
    assert "does not implement layout propagation" in results("dtensor_faults")[fault]


def test_tensorflow_still_cannot_lay_out_dynamic_update_slice(results):
    # If this fails, DTensor lays out XlaDynamicUpdateSlice: drop the "slice_update" hook.
    assert "does not implement layout propagation" in results("dtensor_faults")["dynamic_update_slice"]


@pytest.mark.parametrize("strategy", ["mp_2x4", "zero3"])
def test_generate_and_a_users_function_give_one_devices_numbers(results, strategy):
    r = results("generate")
    cell = r[strategy]
    assert cell["loss_rel"] < LOSS_RTOL, cell
    assert cell["weights_diff"] < SGD_ATOL, cell
    assert cell["tokens"] == r["reference_tokens"], cell
    assert cell["user_function_type"] == "EagerTensor", cell  # plain in, plain out
    assert cell["user_function_diff"] < 1e-5, cell


# ---------------------------------------------------------------------------------------------------- the child
def _child(scenario, out):
    import tfdist

    tfdist.simulate_devices(8)
    import keras
    import keras_hub
    import numpy as np
    import tensorflow as tf

    vocab, length = 64, 8
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, vocab, size=(16, length + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((16, length), "int32")}
    y = tokens[:, 1:]
    common = dict(vocabulary_size=vocab, num_layers=1, num_query_heads=4, num_key_value_heads=2, hidden_dim=16)

    def causal_lm():
        keras.utils.set_random_seed(3)
        backbone = keras_hub.models.Qwen3Backbone(intermediate_dim=32, head_dim=4, **common)
        model = keras_hub.models.Qwen3CausalLM(backbone=backbone, preprocessor=None)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss, sampler="greedy")
        return model

    def train(model):
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        return np.array(history.history["loss"]), [w.numpy() for w in model.weights]

    references = []

    def compare(make_strategy):
        if not references:
            reference = causal_lm()
            initial = [w.numpy() for w in reference.weights]
            references.append((reference, initial, *train(reference)))
        reference, initial, losses, weights = references[0]
        strategy = make_strategy()
        with strategy.scope():
            model = causal_lm()
        model.set_weights(initial)
        got_losses, got_weights = train(model)
        cell = {
            "loss_rel": float(np.max(np.abs(got_losses - losses) / np.abs(losses))),
            "weights_diff": float(max(np.abs(a - b).max() for a, b in zip(weights, got_weights))),
        }
        return cell, model, strategy

    result = {}
    if scenario == "dtensor_faults":
        result = _dtensor_faults(tf, np)
    else:
        prompt = {
            "token_ids": np.concatenate([tokens[:2, :4], np.zeros((2, 12), "int32")], axis=1),
            "padding_mask": np.concatenate([np.ones((2, 4), bool), np.zeros((2, 12), bool)], axis=1),
        }
        batch = tf.constant(tokens[:4, :-1])
        strategies = {
            "mp_2x4": lambda: tfdist.ModelParallelStrategy(mesh={"batch": 2, "model": 4}, rules=tfdist.layouts.auto()),
            "zero3": lambda: tfdist.ShardedDataParallelStrategy(shard="weights", min_size=16),
        }
        for name, make in strategies.items():
            cell, model, _ = compare(make)
            reference = references[0][0]
            if "reference_tokens" not in result:
                tokens_out = reference.generate(prompt, stop_token_ids=None)["token_ids"]
                result["reference_tokens"] = np.asarray(tokens_out).tolist()
                expected = reference({"token_ids": batch, "padding_mask": tf.ones_like(batch)}).numpy()
            cell["tokens"] = np.asarray(model.generate(prompt, stop_token_ids=None)["token_ids"]).tolist()

            @tf.function
            def logits(token_ids, model=model):
                return model({"token_ids": token_ids, "padding_mask": tf.ones_like(token_ids)})

            got = logits(batch)
            cell["user_function_type"] = type(got).__name__
            cell["user_function_diff"] = float(np.abs(np.asarray(got) - expected).max())
            result[name] = cell
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)


def _dtensor_faults(tf, np):
    """TensorFlow's own ops on a raw 8-device DTensor mesh, where DTensor computes them wrongly or not at all."""
    from tensorflow.compiler.tf2xla.python.xla import dynamic_update_slice
    from tensorflow.experimental import dtensor

    mesh = dtensor.create_mesh([("batch", 8)], device_type="CPU")

    def split(value):
        return dtensor.pack(np.split(value, 8), dtensor.Layout.batch_sharded(mesh, "batch", value.ndim))

    def whole(value):
        return dtensor.pack([value] * 8, dtensor.Layout.replicated(mesh, value.ndim))

    def run(fn, expected, *args, on=mesh):
        """'equal', 'off by D', or the first line of DTensor's error (`fn`'s result on mesh `on`)."""
        replicated = dtensor.Layout.replicated(on, expected.ndim)
        try:
            got = tf.function(lambda *a: dtensor.relayout(fn(*a), replicated))(*args)
            diff = float(np.abs(dtensor.unpack(got)[0].numpy() - expected).max())
            return "equal" if diff < 1e-5 else f"off by {diff:.3g}"
        except tf.errors.OpError as e:
            return str(e)[:400]

    def top_k_gradient(x, kernel):
        with tf.GradientTape() as tape:
            tape.watch(x)
            values, _ = tf.math.top_k(tf.nn.softmax(tf.reshape(x, (-1, 8)) @ kernel), 2)
            loss = tf.reduce_sum(values * tf.constant([1.0, 2.0]))
        return tape.gradient(loss, x)

    cache = np.zeros((8, 6), "float32")
    expected = cache.copy()
    expected[:, 2] = 1
    update = lambda c: dynamic_update_slice(c, tf.ones((8, 1)), [0, 2])  # noqa: E731
    repro = {"dynamic_update_slice": run(update, expected, whole(cache))}

    rng = np.random.default_rng(2)

    def gradient(forward, *args):
        with tf.GradientTape() as tape:
            tape.watch(args)
            out = forward(*args)
            loss = tf.reduce_sum(out * out)
        return tape.gradient(loss, args[-1])

    images = rng.normal(size=(16, 6, 6, 4)).astype("float32")
    taps = rng.normal(size=(3, 3, 4, 1)).astype("float32")
    depthwise = lambda x, k: tf.nn.depthwise_conv2d(x, k, (1, 2, 2, 1), "SAME")  # noqa: E731
    expected = gradient(depthwise, tf.constant(images), tf.constant(taps)).numpy()
    repro["depthwise_filter_gradient"] = run(lambda x, k: gradient(depthwise, x, k), expected, split(images),
                                             whole(taps))
    pool = lambda x: tf.nn.avg_pool2d(x, 2, 2, "VALID")  # noqa: E731
    expected = gradient(pool, tf.constant(images)).numpy()
    repro["avg_pool_gradient"] = run(lambda x: gradient(pool, x), expected, split(images))

    x = np.random.default_rng(0).normal(size=(16, 3, 8)).astype("float32")
    kernel = np.random.default_rng(1).normal(size=(8, 4)).astype("float32")
    expected = top_k_gradient(tf.constant(x), tf.constant(kernel)).numpy()
    repro["top_k_gradient"] = run(top_k_gradient, expected, split(x), whole(kernel))  # a runtime error: last
    return repro


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
