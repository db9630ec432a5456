"""Asserted by tests/strategies/test_roles.py.

`tfdist.layouts.auto()` scenarios in a fresh process (run as a script, not collected by pytest).

Usage: python tests/scenarios/auto_layouts_by_role.py OUT_DIR

Simulates 8 CPUs. For KerasHub GPT2CausalLM, LlamaCausalLM, GemmaCausalLM and a BertTextClassifier (tiny
configs built from their config, no downloads) and `tfdist.models.transformer_lm`: trains on one device
and on a {"batch": 2, "model": 4} mesh with `layouts.auto()` from the same initial weights on the same
synthetic token ids (Adam, 2 epochs of 2 steps), and records the losses, the weights, each weight's
DTensor layout and the role that chose it, the bytes each device holds (from the DTensor shards) and, for
GPT-2, a weights file reloaded into a fresh model and what `layouts.transformer()` splits. Then the
build-time cases: a subclassed model built by Keras' symbolic trace, a block that reads a sublayer's
weight inside its build, a role whose dimension the axis does not divide. Numbers go to
OUT_DIR/result.json for tests/strategies/test_roles.py.
"""

import json
import os
import sys
import time
import warnings

import tfdist

OUT = sys.argv[1]
tfdist.simulate_devices(8)

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
from tensorflow.experimental import dtensor  # noqa: E402

from tfdist import layouts  # noqa: E402
from tfdist import models  # noqa: E402
from tfdist._compat import deferred_variables  # noqa: E402

MESH = {"batch": 2, "model": 4}
VOCAB, SEQ, EXAMPLES, BATCH, EPOCHS = 64, 8, 16, 8, 2
RESULT = {}


def lm_loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def gpt2():
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=4, hidden_dim=16, intermediate_dim=32,
        dropout=0.0, max_sequence_length=SEQ,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def llama():
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=8, num_key_value_heads=4, hidden_dim=32,
        intermediate_dim=48,
    )
    return keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)


def gemma():
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=4, num_key_value_heads=4, hidden_dim=16,
        intermediate_dim=64, head_dim=4,
    )
    return keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)


def bert():
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=4, hidden_dim=16, intermediate_dim=32,
        dropout=0.0, max_sequence_length=SEQ,
    )
    return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=None, dropout=0.0)


def transformer_lm():
    return models.transformer_lm(seq_len=SEQ, vocab_size=VOCAB, d_model=16, num_heads=4, num_layers=1)


BUILDERS = {"gpt2": gpt2, "llama": llama, "gemma": gemma, "bert": bert, "transformer_lm": transformer_lm}


def data(kind):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (EXAMPLES, SEQ)).astype("int32")
    if kind == "transformer_lm":
        return ids, rng.integers(0, VOCAB, (EXAMPLES, SEQ)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    if kind == "bert":
        x["segment_ids"] = np.zeros_like(ids)
        return x, rng.integers(0, 2, (EXAMPLES,)).astype("int32")
    return x, rng.integers(0, VOCAB, (EXAMPLES, SEQ)).astype("int32")


def build(kind):
    keras.utils.set_random_seed(3)
    model = BUILDERS[kind]()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=lm_loss(), weighted_metrics=[])
    return model


def fit(model, kind):
    x, y = data(kind)
    return model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history["loss"]


def max_diff(a, b):
    return float(max(np.max(np.abs(np.asarray(x, "float64") - np.asarray(y, "float64"))) for x, y in zip(a, b)))


def device_bytes(variables):
    """Bytes of the shards on the first device, from the DTensor components (not the report's arithmetic)."""
    total = 0
    for v in variables:
        shard = dtensor.unpack(v.value.read_value())[0]
        total += int(np.prod(shard.shape)) * shard.dtype.size
    return total


def layouts_of(model):
    specs = {w.path: w.value.layout.sharding_specs for w in model.weights}
    return {path: [None if a == dtensor.UNSHARDED else a for a in spec] for path, spec in specs.items()}


def scenario(kind):
    started = time.monotonic()
    ref = build(kind)
    initial = ref.get_weights()
    ref_loss = fit(ref, kind)
    strategy = tfdist.ModelParallelStrategy(mesh=MESH, rules=layouts.auto())
    with strategy.scope():
        model = build(kind)
    seeded_diff = max_diff(model.get_weights(), initial)
    model.set_weights(initial)
    loss = fit(model, kind)
    report = strategy.placement_report(model, print_fn=None)
    weights = {w.path for w in model.weights}
    if kind == "gpt2":  # weights saved from the mesh load into a model built fresh under the same rules
        path = os.path.join(OUT, "gpt2.weights.h5")
        model.save_weights(path)
        with strategy.scope():
            keras.utils.set_random_seed(9)
            fresh = BUILDERS[kind]()
        fresh.load_weights(path)
        RESULT["gpt2_reload_diff"] = max_diff(fresh.get_weights(), model.get_weights())
        RESULT["gpt2_reload_layouts_equal"] = layouts_of(fresh) == layouts_of(model)
    sharded = sum(v.bytes_total for v in report.variables if any(report_axis for report_axis in v.spec))
    replicated = report.bytes_total - sharded
    RESULT[kind] = {
        "ref_loss": ref_loss,
        "loss": loss,
        "weights_diff": max_diff(model.get_weights(), ref.get_weights()),
        "slots_diff": max_diff([np.asarray(v) for v in model.optimizer.variables],
                               [np.asarray(v) for v in ref.optimizer.variables]),
        "seeded_init_diff": seeded_diff,
        "layouts": layouts_of(model),
        "chosen_by": {v.path: v.chosen_by for v in report.variables if v.path in weights},
        "notes": {v.path: v.note for v in report.variables if v.note},
        "unmatched": [str(rule) for rule, _ in report.unmatched_rules],
        "misplaced": [list(map(str, m)) for m in report.misplaced],
        "bytes_total": report.bytes_total,
        "bytes_sharded": sharded,
        "bytes_replicated": replicated,
        "bytes_device": device_bytes(list(model.weights) + list(model.optimizer.variables)),
        "bytes_device_weights": device_bytes(model.weights),
        "weights_bytes_total": sum(v.bytes_total for v in report.variables if v.path in weights),
        "report_bytes_device": sorted(set(report.bytes_per_device.values())),
        "table": report.table(),
        "seconds": time.monotonic() - started,
    }


def by_name_preset():
    """What the name-based `layouts.transformer()` splits of the same GPT-2."""
    strategy = tfdist.ModelParallelStrategy(mesh=MESH, rules=layouts.transformer())
    with strategy.scope():
        model = build("gpt2")
    report = strategy.placement_report(model, print_fn=None)
    weights = [v for v in report.variables if v.path in {w.path for w in model.weights}]
    RESULT["gpt2_transformer_preset"] = {
        "split": sum(1 for v in weights if any(v.spec)),
        "variables": len(weights),
        "device_fraction": device_bytes(model.weights) / sum(v.bytes_total for v in weights),
    }


class Residual(keras.Model):
    """A subclassed model without `build`: Keras builds it by tracing `call` symbolically."""

    def __init__(self):
        super().__init__(name="residual")
        self.up = keras.layers.Dense(64, activation="relu")
        self.down = keras.layers.Dense(16)
        self.head = keras.layers.Dense(4)

    def call(self, x):
        return self.head(x + self.down(self.up(x)))


class ReadsInBuild(keras.layers.Layer):
    """A block whose build reads a sublayer's kernel before the build ends (and records what was pending)."""

    def __init__(self):
        super().__init__(name="reads_in_build")
        self.up = keras.layers.Dense(32)
        self.down = keras.layers.Dense(16)

    def build(self, shape):
        self.up.build(shape)
        RESULT["pending_inside_build"] = deferred_variables.pending(self)
        self.read = np.array(self.up.kernel)
        self.down.build((*shape[:-1], 32))

    def call(self, x):
        return self.down(self.up(x))


def build_cases():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(16, 16)).astype("float32"), rng.normal(size=(16, 4)).astype("float32")
    keras.utils.set_random_seed(4)
    ref = Residual()
    ref.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    ref(x)
    initial = ref.get_weights()
    ref_loss = ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    strategy = tfdist.ModelParallelStrategy(mesh=MESH, rules=layouts.auto())
    with strategy.scope():
        model = Residual()
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model(x)
    model.set_weights(initial)
    loss = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    RESULT["subclassed"] = {
        "ref_loss": ref_loss,
        "loss": loss,
        "weights_diff": max_diff(model.get_weights(), ref.get_weights()),
        "layouts": layouts_of(model),
    }
    with strategy.scope():
        inputs = keras.Input((4, 16))
        block = ReadsInBuild()
        keras.Model(inputs, block(inputs))
    RESULT["read_in_build"] = {
        "read_equals_weight": bool(np.array_equal(block.read, np.array(block.up.kernel))),
        "pending_after_build": deferred_variables.pending(block),
        "layouts": {w.path: str(w.value.layout.sharding_specs) for w in block.weights},
    }
    # A model in which auto() finds no role: its role rules are reported as matching nothing.
    with strategy.scope():
        mlp = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64), keras.layers.Dense(4)])
    RESULT["no_roles_unmatched"] = [str(rule) for rule, _ in strategy.extended.unmatched_rules(mlp)]
    # 2 key/value heads over 4 devices: the key and value projections stay whole, with a note.
    strategy = tfdist.ModelParallelStrategy(mesh=MESH, rules=layouts.auto())
    with strategy.scope():
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=VOCAB, num_layers=1, num_query_heads=8, num_key_value_heads=2, hidden_dim=32,
            intermediate_dim=48,
        )
    report = strategy.placement_report(backbone, print_fn=None)
    RESULT["indivisible"] = {
        v.path: [list(v.spec), v.note, v.chosen_by] for v in report.variables if "attention" in v.path
    }


def mixtral(num_layers=2):
    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=VOCAB, num_layers=num_layers, hidden_dim=16, intermediate_dim=32, num_query_heads=4,
        num_key_value_heads=2, num_experts=4, top_k=2,
    )
    return keras_hub.models.MixtralCausalLM(backbone=backbone, preprocessor=None)


def sgd_fit(model, x, y, batch_size=BATCH):
    return model.fit(x, y, batch_size=batch_size, epochs=EPOCHS, shuffle=False, verbose=0).history["loss"]


def expert_cases():
    """Mixtral's experts under auto(): placed on {batch: 2, model: 4}, and trained there against one device."""
    started = time.monotonic()
    strategy = tfdist.ModelParallelStrategy(mesh=MESH, rules=layouts.auto())
    with strategy.scope():
        keras.utils.set_random_seed(5)
        model = mixtral()
    report = strategy.placement_report(model, print_fn=None)
    experts = [w for w in model.weights if len(w.shape) == 3 and "experts" in w.path]
    sharded = sum(v.bytes_total for v in report.variables if any(v.spec))
    RESULT["mixtral_placed"] = {
        "experts": {w.path: [list(w.shape), list(dtensor.unpack(w.value.read_value())[0].shape)] for w in experts},
        "layouts": layouts_of(model),
        "chosen_by": {v.path: v.chosen_by for v in report.variables},
        "unmatched": [str(rule) for rule, _ in report.unmatched_rules],
        "bytes_sharded": sharded,
        "bytes_replicated": report.bytes_total - sharded,
        "bytes_device": device_bytes(model.weights),
        "report_bytes_device": sorted(set(report.bytes_per_device.values())),
        "table": report.table(),
    }
    x, y = data("llama")
    keras.utils.set_random_seed(5)
    ref = mixtral()
    ref.compile(optimizer=keras.optimizers.SGD(0.5), loss=lm_loss(), weighted_metrics=[])
    initial = ref.get_weights()
    ref_loss = sgd_fit(ref, x, y)
    with strategy.scope():  # the placed model, trained on {batch: 2, model: 4}
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=lm_loss(), weighted_metrics=[])
    model.set_weights(initial)
    RESULT["mixtral_trained"] = {
        "ref_loss": ref_loss,
        "loss": sgd_fit(model, x, y),
        "weights_diff": max_diff(model.get_weights(), ref.get_weights()),
        "moved": max_diff(ref.get_weights(), initial),
        "expert_layouts": {p: s for p, s in layouts_of(model).items() if "experts/" in p},
        "seconds": time.monotonic() - started,
    }


class SubclassedModel(keras.Model):
    """TensorFlow's DTensor Keras tutorial's subclassed model (`feature`, `feature_2`), as written there.

    `rate=0.0` where training is compared with one device (dropout draws other numbers under a strategy).
    """

    def __init__(self, name=None, rate=0.1):
        super().__init__(name=name)
        self.feature = keras.layers.Dense(16)
        self.feature_2 = keras.layers.Dense(24)
        self.dropout = keras.layers.Dropout(rate)

    def call(self, inputs, training=None):
        x = self.feature(inputs)
        x = self.dropout(x, training=training)
        return self.feature_2(x)


def tutorial_layout_map():
    """The tutorial's LayoutMap keys on a Keras DeviceMesh {batch: 4, model: 2}."""
    mesh = keras.distribution.DeviceMesh((4, 2), ["batch", "model"], devices=[f"cpu:{i}" for i in range(8)])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["feature.*kernel"] = keras.distribution.TensorLayout(("batch", None), mesh)
    layout_map["feature.*bias"] = keras.distribution.TensorLayout(("batch",), mesh)
    return layout_map


def caught(fn):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        value = fn()
    return value, [str(w.message) for w in seen if "layout rules" in str(w.message) or "placement" in str(w.message)]


def attribute_path_cases():
    """The tutorial's subclassed model under its LayoutMap: placed by attribute path, trained as on one device."""
    started = time.monotonic()
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(16, 16)).astype("float32"), rng.normal(size=(16, 24)).astype("float32")

    def train(model):
        return model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]

    keras.utils.set_random_seed(6)
    ref = SubclassedModel(rate=0.0)
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref(x[:1])
    initial = ref.get_weights()
    ref_loss = train(ref)
    strategy = tfdist.ModelParallelStrategy(rules=tutorial_layout_map())
    with strategy.scope():
        model = SubclassedModel(rate=0.0)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    _, built_warnings = caught(lambda: model(np.zeros((16, 16), "float32")))  # the tutorial's call, then training
    model.set_weights(initial)
    loss = train(model)
    report, report_warnings = caught(lambda: strategy.placement_report(model, print_fn=None))
    RESULT["tutorial"] = {
        "ref_loss": ref_loss,
        "loss": loss,
        "weights_diff": max_diff(model.get_weights(), ref.get_weights()),
        "layouts": layouts_of(model),
        "chosen_by": {v.path: v.chosen_by for v in report.variables if v.path.startswith(model.name)},
        "warnings": built_warnings + report_warnings,
        "table": report.table(),
    }
    # A rule matching neither path is still reported, with the attribute paths among the near misses.
    strategy = tfdist.ModelParallelStrategy(mesh=MESH, rules=[(r"^featur/kernel$", (None, "model"))])
    with strategy.scope():
        model = SubclassedModel()
    _, missed = caught(lambda: model(np.zeros((8, 16), "float32")))
    RESULT["tutorial_typo_warnings"] = missed
    RESULT["tutorial_seconds"] = time.monotonic() - started


def keras_distribution_case():
    """The tutorial's cells through Keras' own API (`tfdist.use_keras_distribution()` + ModelParallel); last."""
    tfdist.use_keras_distribution()
    distribution = keras.distribution.ModelParallel(layout_map=tutorial_layout_map(), batch_dim_name="batch")
    with distribution.scope():
        model = SubclassedModel()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(np.ones((16, 16), "float32"), np.ones((16, 24), "float32"), batch_size=16, verbose=0)
    RESULT["tutorial_keras_distribution"] = layouts_of(model)


def conv_case():
    """A KerasHub ResNet under auto(): its convolution kernels stored split over their output channels."""
    strategy = tfdist.ModelParallelStrategy(mesh=MESH, rules=layouts.auto())
    with strategy.scope():
        model = keras_hub.models.ResNetBackbone(
            input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 64],
            stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block",
            use_pre_activation=False, image_shape=(16, 16, 3),
        )
    report = strategy.placement_report(model, print_fn=None)
    RESULT["resnet"] = {
        v.path: [list(v.spec), v.gathered, v.chosen_by] for v in report.variables if v.path.endswith("kernel")
    }


for kind in BUILDERS:
    scenario(kind)
by_name_preset()
build_cases()
expert_cases()
attribute_path_cases()
conv_case()
keras_distribution_case()
with open(os.path.join(OUT, "result.json"), "w") as f:
    json.dump(RESULT, f, indent=1)
print("done", flush=True)
