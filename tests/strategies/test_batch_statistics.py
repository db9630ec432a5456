"""Layers that compute from the batch under data parallelism: said once at `fit`, exact with batch_statistics="global".

A KerasHub ResNet (BatchNormalization) and a KerasHub Mixtral (MoE with its load-balancing loss on)
train under `DataParallelStrategy` on 4 devices and are compared with one device: SGD (with
momentum) weights, moving statistics included, within 1e-5 of each variable's largest entry (as
`tfdist.check` compares: a moving variance of 5.6 is 2e-5 off after its 2-example steps, 3.9e-6 of it,
float32 rounding through 1/sqrt(variance)). The ResNet's
global batch of 10 splits 8 + 2, so its last step leaves two replicas without an example (padded:
they must add nothing to the statistics). With the default batch_statistics="replica", `fit` warns
exactly once, naming the layers, and training differs from one device. Mixtral also trains under a
`PipelineStrategy` of 2 replicas x 2 stages x 2 micro-batches with the balancing loss over all four parts,
and its logged loss equals one device's (rtol 1e-6: each replica's step holds its own `add_loss` terms
once, though the replicas' threads interleave at the loss's all-reduce). Every check runs in one child
process with 8 logical CPUs (this file is also that child's script).
"""

import json
import os
import re
import sys
import warnings

import numpy as np

if __name__ != "__main__":
    import _procs

RTOL = 1e-5


def test_batch_statistics_exact_and_said(tmp_path):
    result = _procs.run_child(os.path.abspath(__file__), tmp_path, timeout=600)
    resnet, mixtral = result["resnet"], result["mixtral"]

    assert resnet["global_sgd"] < RTOL, resnet
    assert "jit_compile=True under DataParallelStrategy(batch_statistics='global')" in resnet["global_xla"]
    assert resnet["global_warnings"] == []
    assert resnet["replica_sgd"] > 1e-3, resnet  # per-replica statistics: not one device's training
    [message] = resnet["replica_warnings"]
    assert len(resnet["norms"]) >= 3, resnet["norms"]
    assert f"DataParallelStrategy: {len(resnet['norms'])} layer(s) of model 'resnet'" in message, message
    for path in resnet["norms"]:
        assert f"BatchNormalization {path!r}" in message, message
    assert "batch_statistics='global'" in message, message

    assert mixtral["global_sgd"] < RTOL, mixtral
    assert mixtral["global_warnings"] == []
    assert mixtral["replica_sgd"] > 1e-4, mixtral
    [message] = mixtral["replica_warnings"]
    assert "1 layer(s) of model 'mixtral'" in message, message
    moe_block = r"MixtralSparseMoeBlock '\S*mixtral_sparse_moe_block\S*' \(load-balancing loss\)"
    assert re.search(moe_block, message), message
    # Logged: each replica's step holds its own `add_loss` terms once (Keras' per-layer lists, made per replica).
    np.testing.assert_allclose(mixtral["global_loss"], mixtral["one_loss"], rtol=1e-6)

    piped = result["mixtral_pipeline"]
    assert piped["global_sgd"] < RTOL, piped
    np.testing.assert_allclose(piped["global_loss"], mixtral["one_loss"], rtol=1e-6)
    assert piped["global_warnings"] == []
    assert piped["replica_sgd"] > 1e-4, piped
    [message] = piped["replica_warnings"]
    assert "one micro-batch" in message and re.search(moe_block, message), message
    assert "PipelineStrategy(batch_statistics='global')" in message, message

    assert result["pipeline_warnings"] == [result["pipeline_warnings"][0]]
    assert "one micro-batch" in result["pipeline_warnings"][0]
    assert "BatchNormalization" in result["pipeline_warnings"][0]
    assert result["bad_input"].startswith("Invalid value for argument `batch_statistics`"), result["bad_input"]


def test_every_keras_hub_moe_family_still_computes_the_balancing_loss_replaced():
    from tfdist._compat import batch_statistics

    hooks = batch_statistics.moe_hooks(load=True)
    assert len(hooks) == 2 * len(batch_statistics.MOE_FAMILIES)
    for h in hooks:
        h.check()


# ---------------------------------------------------------------- the child
def _child(out):
    import keras
    import keras_hub
    import numpy as np

    import tfdist

    devices = tfdist.simulate_devices(8)

    def max_diff(a, b):  # relative to each variable's largest entry (its one-device value `a`)
        return max(float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(x))), 1e-6)) for x, y in zip(a, b))

    def train(build, data, strategy, optimizer, jit_compile=False, batch_size=8):
        keras.utils.set_random_seed(3)
        scope = strategy.scope() if strategy is not None else keras.utils.custom_object_scope({})
        with scope:
            model = build()
            model.compile(optimizer=optimizer(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          jit_compile=jit_compile)
        x, y = data
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0).history
        said = [str(w.message) for w in caught if "compute from the batch" in str(w.message)]
        return [w.numpy() for w in model.weights], history["loss"], said

    def dp(batch_statistics):
        return tfdist.DataParallelStrategy(devices=devices[:4], batch_statistics=batch_statistics)

    def sgd():
        return keras.optimizers.SGD(0.1, momentum=0.9)

    # ResNet: BatchNormalization after every convolution.
    def resnet():
        backbone = keras_hub.models.ResNetBackbone(
            input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64],
            stackwise_num_blocks=[1], stackwise_num_strides=[1], block_type="basic_block",
            image_shape=(8, 8, 3), name="resnet_backbone",
        )
        inputs = keras.Input((8, 8, 3))
        logits = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(backbone(inputs)))
        return keras.Model(inputs, logits, name="resnet")

    rng = np.random.default_rng(0)
    images = (rng.normal(size=(10, 8, 8, 3)).astype("float32"), rng.integers(0, 3, size=(10,)).astype("int32"))
    one, _, _ = train(resnet, images, None, sgd)
    exact, _, global_said = train(resnet, images, dp("global"), sgd)
    per_replica, _, replica_said = train(resnet, images, dp("replica"), sgd)
    norms = [layer.path for layer in resnet()._flatten_layers() if isinstance(layer, keras.layers.BatchNormalization)]
    results = {"resnet": {
        "global_sgd": max_diff(one, exact), "norms": norms,
        "replica_sgd": max_diff(one, per_replica), "global_warnings": global_said, "replica_warnings": replica_said,
    }}

    # Mixtral: the router's load-balancing loss (on by default), some padded tokens.
    def mixtral():
        backbone = keras_hub.models.MixtralBackbone(
            vocabulary_size=64, num_layers=1, hidden_dim=16, intermediate_dim=32, num_query_heads=4,
            num_key_value_heads=2, num_experts=4, top_k=2, name="mixtral_backbone",
        )
        ids, mask = keras.Input((6,), dtype="int32"), keras.Input((6,), dtype="int32")
        hidden = backbone({"token_ids": ids, "padding_mask": mask})
        return keras.Model([ids, mask], keras.layers.Dense(64)(hidden), name="mixtral")

    ids = rng.integers(0, 64, size=(16, 6)).astype("int32")
    mask = np.ones((16, 6), "int32")
    mask[::3, 4:] = 0
    tokens = ((ids, mask), np.roll(ids, -1, axis=1))
    one, one_loss, _ = train(mixtral, tokens, None, sgd)
    exact, exact_loss, global_said = train(mixtral, tokens, dp("global"), sgd)
    per_replica, _, replica_said = train(mixtral, tokens, dp("replica"), sgd)
    results["mixtral"] = {
        "global_sgd": max_diff(one, exact), "replica_sgd": max_diff(one, per_replica),
        "global_warnings": global_said, "replica_warnings": replica_said,
        "one_loss": one_loss, "global_loss": exact_loss,
    }

    # The same in a pipeline: 2 replicas x 2 stages x 2 micro-batches (the balancing loss over all four parts).
    def pipe(batch_statistics):
        return tfdist.PipelineStrategy(devices=devices[:4], stages=2, microbatches=2, replicas=2,
                                       batch_statistics=batch_statistics)

    exact, exact_loss, global_said = train(mixtral, tokens, pipe("global"), sgd)
    per_part, _, part_said = train(mixtral, tokens, pipe("replica"), sgd)
    results["mixtral_pipeline"] = {
        "global_sgd": max_diff(one, exact), "replica_sgd": max_diff(one, per_part), "global_loss": exact_loss,
        "global_warnings": global_said, "replica_warnings": part_said,
    }

    pipeline = tfdist.PipelineStrategy(devices=devices[:2], stages=2, microbatches=2)
    results["pipeline_warnings"] = train(resnet, images, pipeline, sgd, batch_size=4)[2]
    try:
        tfdist.DataParallelStrategy(devices=devices[:2], batch_statistics="sync")
    except ValueError as e:
        results["bad_input"] = str(e)
    try:
        train(resnet, images, dp("global"), sgd, jit_compile=True)
    except ValueError as e:
        results["resnet"]["global_xla"] = str(e)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    _child(sys.argv[1])
