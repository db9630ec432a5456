"""Asserted by tests/strategies/test_pipeline_nested.py.

PipelineStrategy on nested models and tied weights, in a fresh process (run as a script, not collected by pytest).

Usage: python tests/scenarios/pipeline_nested_and_tied.py OUT_DIR

Simulates 4 CPUs. Trains, each once on one device (no strategy) and once pipelined, from the same seed
on the same examples in the same order:

* "gpt2": a tiny KerasHub GPT2CausalLM (its token embedding tied to the output projection), Adam,
  2 stages x 4 micro-batches, 4 steps, with padding and sample weights; its plan, where its
  variables live, the tensors crossing stages in its traced train step, a `.keras` save loaded on one
  device, the plan from explicit path rules and the error of a rule naming no inner layer;
* "nested_auto": a functional model whose backbone is a functional model holding a Sequential block,
  SGD, 3 stages (the balancer), 2 micro-batches;
* "nested_rules": the same model, Adam, 2 stages placed by path rules (one naming the nested block);
* "tied": a layer reading another layer's kernel two stages apart, Adam, 2 stages x 2 replicas.

Numbers go to OUT_DIR/result.json for tests/strategies/test_pipeline_nested.py.
"""

import json
import os
import sys
import time

import tfdist

OUT = sys.argv[1]
tfdist.simulate_devices(4)

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfdist.placement import pipeline as pipeline_lib  # noqa: E402

RESULT = {}
VOCAB, SEQ, WIDTH = 96, 16, 32
GPT2_RULES = {
    "gpt2_backbone/(token|position)_embedding|gpt2_backbone/embeddings_.*|gpt2_backbone/transformer_layer_0": 0,
    "gpt2_backbone/(transformer_layer_1|layer_norm)|token_embedding": 1,
}


class StepLosses(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def fit(model, x, y, sample_weight=None, epochs=1):
    losses = StepLosses()
    model.fit(
        x, y, sample_weight=sample_weight, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=[losses]
    )
    return losses.losses


def devices_of(variable):
    value = variable.value
    return sorted({v.device.split("device:")[-1] for v in getattr(value, "values", [value])})


def compare(ref, model, ref_losses, losses):
    return {
        "weight_diff": max(float(np.max(np.abs(a.numpy() - b.numpy()))) for a, b in zip(ref.weights, model.weights)),
        "paths_match": [a.path for a in ref.weights] == [b.path for b in model.weights],
        "ref_losses": ref_losses,
        "losses": losses,
    }


def plan_record(plan):
    return {
        "layers": [list(s) for s in plan.layers],
        "params": list(plan.params),
        "shared": [
            {"weights": list(g.weights), "calls": list(g.calls), "placed": list(g.placed), "stage": g.stage}
            for g in plan.shared
        ],
        "report": plan.report(),
    }


# ------------------------------------------------------------------------------ GPT-2
def gpt2():
    keras.utils.set_random_seed(7)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=2,
        hidden_dim=WIDTH,
        intermediate_dim=64,
        max_sequence_length=SEQ,
        dropout=0.0,  # no random masks: one device and the pipeline draw them differently
        name="gpt2_backbone",
    )
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None, name="gpt2_causal_lm")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def gpt2_data(n=32):
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, VOCAB, size=(n, SEQ)).astype("int32")
    labels = rng.integers(0, VOCAB, size=(n, SEQ)).astype("int32")
    lengths = rng.integers(SEQ // 2, SEQ + 1, size=(n,))
    mask = (np.arange(SEQ)[None, :] < lengths[:, None]).astype("int32")
    return {"token_ids": inputs * mask, "padding_mask": mask}, labels, mask.astype("float32")


def crossing_tensors(strategy, model, x, y, w):
    """The tensors of the traced train step whose producer and consumer are on different devices."""
    data = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(8)
    batch = next(iter(strategy.experimental_distribute_dataset(data)))
    graph = tf.function(lambda d: strategy.run(model.train_step, args=(d,))).get_concrete_function(batch).graph
    # A variable read is left unplaced in the graph: it runs where its variable is.
    variable_devices = {internal.op.name: external.device for external, internal in graph.captures}

    def device(op):
        if op.device or op.type != "ReadVariableOp":
            return op.device
        return variable_devices.get(op.inputs[0].op.name, "")

    seen, crossing = set(), []
    for op in graph.get_operations():
        for t in op.inputs:
            src, dst = device(t.op), device(op)
            if src and dst and src != dst and t.dtype != tf.resource and (t.name, dst) not in seen:
                seen.add((t.name, dst))
                crossing.append(
                    {
                        "name": t.name,
                        "shape": t.shape.as_list(),
                        "bytes": int(np.prod(t.shape)) * t.dtype.size,
                        "from": src.split("device:")[-1],
                        "to": dst.split("device:")[-1],
                    }
                )
    gathers = sorted(
        {op.device.split("device:")[-1] for op in graph.get_operations() if op.type in ("GatherV2", "ResourceGather")}
    )
    return crossing, gathers


def tied_gradient_shares(model, x, y, w):
    """On one device, the norms of the token embedding's gradient from the lookup and from the output
    projection, each / the norm of their sum, on the first batch."""
    embedding = model.backbone.token_embedding
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y, w = {k: v[:8] for k, v in x.items()}, y[:8], w[:8]
    with tf.GradientTape(persistent=True) as tape:
        hidden = model.backbone(x)
        both = loss(y, embedding(hidden, reverse=True), sample_weight=w)
        projection = loss(y, embedding(tf.stop_gradient(hidden), reverse=True), sample_weight=w)
    total = tf.convert_to_tensor(tape.gradient(both, embedding.embeddings))
    from_projection = tf.convert_to_tensor(tape.gradient(projection, embedding.embeddings))
    norm = float(tf.norm(total))
    return {
        "lookup": float(tf.norm(total - from_projection)) / norm,
        "projection": float(tf.norm(from_projection)) / norm,
    }


def scenario_gpt2():
    x, y, w = gpt2_data()
    ref = gpt2()
    shares = tied_gradient_shares(ref, x, y, w)
    ref_losses = fit(ref, x, y, w)
    strategy = tfdist.PipelineStrategy(stages=2, microbatches=4, devices=["CPU:0", "CPU:1"])
    with strategy.scope():
        model = gpt2()
    losses = fit(model, x, y, w)
    out = compare(ref, model, ref_losses, losses)
    out["tied_gradient_shares"] = shares
    out["plan"] = plan_record(strategy.plan)
    out["count_params"] = model.count_params()
    out["devices"] = {v.path: devices_of(v) for v in model.weights}
    out["optimizer_devices"] = {v.path: devices_of(v) for v in model.optimizer.variables if "embeddings" in v.path}
    out["optimizer_variables"] = [v.path for v in model.optimizer.variables]
    out["crossing"], out["gather_devices"] = crossing_tensors(strategy, model, x, y, w)
    path = os.path.join(OUT, "gpt2.keras")
    model.save(path)
    restored = keras.models.load_model(path)  # no strategy: one device
    out["restored_weight_diff"] = max(
        float(np.max(np.abs(a.numpy() - b.numpy()))) for a, b in zip(model.weights, restored.weights)
    )
    out["restored_output_diff"] = float(np.max(np.abs(restored(x).numpy() - ref(x).numpy())))
    out["explicit_layers"] = [list(s) for s in pipeline_lib.plan_explicit(ref, GPT2_RULES, 2).layers]
    try:
        pipeline_lib.plan_explicit(ref, {**GPT2_RULES, "gpt2_backbone/transformer_layer_7": 1}, 2)
        out["bad_rule_error"] = None
    except ValueError as e:
        out["bad_rule_error"] = str(e)
    return out


# ------------------------------------------------------------------------------ plain Keras
def nested(optimizer):
    """features -> backbone(stem -> block(b0 -> b1) + stem -> neck) -> head; `block` is a Sequential."""
    keras.utils.set_random_seed(3)
    block = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, activation="tanh", name="b0"), keras.layers.Dense(16, name="b1")],
        name="block",
    )
    features = keras.Input((16,), name="features")
    stem = keras.layers.Dense(16, activation="tanh", name="stem")(features)
    h = keras.layers.Add(name="residual")([stem, block(stem)])
    backbone = keras.Model(features, keras.layers.Dense(16, activation="tanh", name="neck")(h), name="backbone")
    inputs = keras.Input((16,))
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(backbone(inputs)), name="nested")
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class Tied(keras.layers.Layer):
    """Multiplies by another layer's kernel: a weight owned by two layers."""

    def __init__(self, source, **kwargs):
        super().__init__(**kwargs)
        self.source = source

    def call(self, x):
        return keras.ops.matmul(x, self.source.kernel)


def tied():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    first = keras.layers.Dense(16, activation="tanh", name="first")
    x = keras.layers.Dense(16, activation="tanh", name="middle")(first(inputs))
    x = Tied(first, name="tied")(x)
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(x), name="tied_model")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model


def mlp_data(n=32):
    rng = np.random.default_rng(1)
    return rng.normal(size=(n, 16)).astype("float32"), rng.integers(0, 3, size=(n,)).astype("int32")


def scenario_plain(build, strategy):
    x, y = mlp_data()
    ref = build()
    ref_losses = fit(ref, x, y, epochs=2)
    with strategy.scope():
        model = build()
    losses = fit(model, x, y, epochs=2)
    out = compare(ref, model, ref_losses, losses)
    out["plan"] = plan_record(strategy.plan)
    out["count_params"] = model.count_params()
    out["devices"] = {v.path: devices_of(v) for v in model.weights}
    out["stage_devices"] = [[d.split("device:")[-1] for d in row] for row in strategy.stage_devices]
    return out


SCENARIOS = {
    "gpt2": scenario_gpt2,
    "nested_auto": lambda: scenario_plain(
        lambda: nested(keras.optimizers.SGD(0.1)), tfdist.PipelineStrategy(stages=3, microbatches=2)
    ),
    "nested_rules": lambda: scenario_plain(
        lambda: nested(keras.optimizers.Adam(1e-2)),
        tfdist.PipelineStrategy(
            stages=2,
            microbatches=2,
            devices=["CPU:0", "CPU:1"],
            placement={"backbone": 0, "backbone/block": 1, "backbone/block/b0": 0, "backbone/(residual|neck)|head": 1},
        ),
    ),
    "tied": lambda: scenario_plain(
        tied,
        tfdist.PipelineStrategy(
            stages=2,
            microbatches=2,
            replicas=2,
            devices=["CPU:0", "CPU:1", "CPU:2", "CPU:3"],
            placement={"first|middle": 0, "tied|head": 1},
        ),
    ),
}

for name, scenario in SCENARIOS.items():
    start = time.perf_counter()
    RESULT[name] = scenario()
    RESULT[name]["seconds"] = time.perf_counter() - start
with open(os.path.join(OUT, "result.json"), "w") as f:
    json.dump(RESULT, f)
