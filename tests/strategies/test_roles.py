"""`tfdist.layouts.auto()`: weights placed by role (layer type and position), not by layer name.

In this process (no DTensor program runs): the roles found in KerasHub's GPT-2, Llama, Gemma and BERT
backbones, `tfdist.models.transformer_lm` and hand-made blocks, built on one device as the strategy sees
them (each top-level layer of a functional model once built); `auto()`'s validation; how role rules sit
with path rules. In a process of its own on 8 simulated CPUs (tests/scenarios/auto_layouts_by_role.py, one run for every
test below it): each model trained on a {"batch": 2, "model": 4} mesh with `auto()` against one device
from the same weights (Adam, 2 epochs of 2 steps: losses rtol 1e-4, weights and Adam slots atol 1e-5); every
attention and feed-forward kernel split, read from the variables' DTensor layouts; the bytes on one
device (from its DTensor shards) at most 1.15 x (split bytes / 4 + replicated bytes); the placement
report naming each weight's role, nothing unmatched; the build-time cases (a subclassed model built by
Keras' trace, a read inside a build, an indivisible role); Mixtral's experts split 4 ways (trained with SGD
on that {"batch": 2, "model": 4} mesh against one device: weights 1e-5); TensorFlow's DTensor Keras tutorial's
subclassed model placed by its LayoutMap's attribute-path keys (SGD against one device) and through
`use_keras_distribution()`; a ResNet's convolutions.
"""

import math
import os
import re

import keras
import keras_hub
import pytest
from _procs import REPO
from _procs import run_child
from keras.src.models.functional import Functional

import tfdist
from tfdist import layouts
from tfdist import models
from tfdist.placement import attributes
from tfdist.placement import report as report_lib
from tfdist.placement import roles

CHILD = os.path.join(REPO, "tests", "scenarios", "auto_layouts_by_role.py")
LOSS_RTOL, WEIGHTS_ATOL = 1e-4, 1e-5
BYTES_SLACK = 1.15
KINDS = ("gpt2", "llama", "gemma", "bert", "transformer_lm")
# Per model: the attention and feed-forward kernels (by the names the test knows) -> (role, dimension split).
ATTENTION = {r"/(query|key|value)/kernel$": ("attention_in", 1), r"/attention_output/kernel$": ("attention_out", 0)}
KERNELS = {
    "gpt2": {**ATTENTION, r"/feedforward_intermediate_dense/kernel$": ("mlp_in", 1),
             r"/feedforward_output_dense/kernel$": ("mlp_out", 0)},
    "llama": {**ATTENTION, r"/feedforward_(intermediate|gate)_dense/kernel$": ("mlp_in", 1),
              r"/feedforward_output_dense/kernel$": ("mlp_out", 0)},
    "gemma": {r"/(query|key|value)/kernel$": ("attention_in", 0), r"/attention_output/kernel$": ("attention_out", 0),
              r"/ffw_gating(_2)?/kernel$": ("mlp_in", 1), r"/ffw_linear/kernel$": ("mlp_out", 0)},
    "bert": {**ATTENTION, r"/feedforward_intermediate_dense/kernel$": ("mlp_in", 1),
             r"/feedforward_output_dense/kernel$": ("mlp_out", 0)},
    "transformer_lm": {**ATTENTION, r"/mlp_in/kernel$": ("mlp_in", 1), r"/mlp_out/kernel$": ("mlp_out", 0)},
}
EMBEDDINGS = {
    "gpt2": {"token_embedding/embeddings": 0},
    "llama": {"token_embedding/embeddings": 0, "token_embedding/reverse_embeddings": 1},
    "gemma": {"token_embedding/embeddings": 0},
    "bert": {"token_embedding/embeddings": 0},
    "transformer_lm": {"token_embedding/embeddings": 0, "logits/kernel": 1, "logits/bias": 0},
}


# ------------------------------------------------------------------------------------------ roles, one device
def found_roles(model):
    """path -> (role, dim) as the strategy finds them: each top-level layer of a functional model once built."""
    finder = roles.RoleFinder()

    def show(layer):
        if isinstance(layer, (Functional, keras.Sequential)):
            for sub in layer.layers:
                show(sub)
        else:
            finder.find(layer)

    show(model)
    out = {}
    for w in model.weights:
        role = finder.role_of(w)
        out[w.path] = (role.kind, role.dim) if role is not None else None
    return out


def hub(kind):
    keras.utils.set_random_seed(0)
    if kind == "gpt2":
        return keras_hub.models.GPT2Backbone(
            vocabulary_size=64, num_layers=1, num_heads=4, hidden_dim=16, intermediate_dim=32, max_sequence_length=8
        )
    if kind == "llama":
        return keras_hub.models.LlamaBackbone(
            vocabulary_size=64, num_layers=1, num_query_heads=8, num_key_value_heads=4, hidden_dim=32,
            intermediate_dim=48,
        )
    if kind == "gemma":
        return keras_hub.models.GemmaBackbone(
            vocabulary_size=64, num_layers=1, num_query_heads=4, num_key_value_heads=4, hidden_dim=16,
            intermediate_dim=64, head_dim=4,
        )
    if kind == "bert":
        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=64, num_layers=1, num_heads=4, hidden_dim=16, intermediate_dim=32, max_sequence_length=8
        )
        return keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=None)
    return models.transformer_lm(seq_len=8, vocab_size=64, d_model=16, num_heads=4, num_layers=1)


@pytest.mark.parametrize("kind", KINDS)
def test_roles_of_every_attention_and_feed_forward_kernel_and_the_embeddings(kind):
    found = found_roles(hub(kind))
    kernels = {p: r for p, r in found.items() if p.endswith("kernel") and r and r[0] != "lm_head"}
    for pattern, role in KERNELS[kind].items():
        matching = [p for p in found if re.search(pattern, p)]
        assert matching, (pattern, sorted(found))
        for path in matching:
            assert found[path] == role, (path, found[path])
            kernels.pop(path)
    assert kernels == {}, kernels  # no other kernel has an attention or feed-forward role
    embeddings = {p: r for p, r in found.items() if r and r[0] in ("embedding", "lm_head") and "segment" not in p}
    assert {p: r[1] for p, r in embeddings.items()} == EMBEDDINGS[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_norms_position_embeddings_row_biases_and_heads_of_other_widths_have_no_split(kind):
    found = found_roles(hub(kind))
    for path, role in found.items():
        if re.search(r"norm|position_embedding|attention_output/bias|(output_dense|mlp_out|ffw_linear)/bias", path):
            assert role is None or role[1] is None, (path, role)
    if kind == "bert":
        assert found["pooled_dense/kernel"] is None and found["logits/kernel"] is None  # 2 classes, not a vocabulary
        assert found["segment_embedding/embeddings"] == ("embedding", 0)


class DenseAttention(keras.layers.Layer):
    """Attention from four plain Dense layers (no head axes): the last one is the output projection."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.q, self.k, self.v, self.o = (keras.layers.Dense(16, name=n) for n in "qkvo")

    def build(self, shape):
        for layer in (self.q, self.k, self.v, self.o):
            layer.build(shape)


class Heads(keras.layers.Layer):
    """Not named like attention: found by its einsums that split into heads and merge them back."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.split = keras.layers.EinsumDense("btd,dnh->btnh", output_shape=(None, 4, 4), name="split")
        self.merge = keras.layers.EinsumDense("btnh,nhd->btd", output_shape=(None, 16), name="merge")

    def build(self, shape):
        self.split.build(shape)
        self.merge.build((*shape[:-1], 4, 4))


class Gated(keras.layers.Layer):
    """A gated feed-forward unit: two dense layers in, one out."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gate, self.up = keras.layers.Dense(48, name="gate"), keras.layers.Dense(48, name="up")
        self.down = keras.layers.Dense(16, name="down")

    def build(self, shape):
        self.gate.build(shape)
        self.up.build(shape)
        self.down.build((*shape[:-1], 48))


def test_roles_by_position_and_structure_in_hand_made_blocks():
    cases = {}
    for block in (DenseAttention(name="a"), Heads(name="h"), Gated(name="g")):
        block.build((2, 8, 16))
        cases.update(found_roles(block))
    assert [cases[f"a/{n}/kernel"] for n in "qkvo"] == [("attention_in", 1)] * 3 + [("attention_out", 0)]
    assert cases["a/q/bias"] == ("attention_in", 0) and cases["a/o/bias"] == ("attention_out", None)
    assert cases["h/split/kernel"] == ("attention_in", 1) and cases["h/merge/kernel"] == ("attention_out", 0)
    assert cases["g/gate/kernel"] == cases["g/up/kernel"] == ("mlp_in", 1)
    assert cases["g/down/kernel"] == ("mlp_out", 0)


def test_a_plain_classifier_mlp_has_no_roles():
    # 16 -> 64 -> 4 does not come back to its width: no feed-forward unit, and no vocabulary.
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64), keras.layers.Dense(4)])
    assert set(found_roles(model).values()) == {None}


def test_the_report_descriptions_name_the_layer_types():
    finder = roles.RoleFinder()
    backbone = hub("gpt2")
    for layer in backbone.layers:
        finder.find(layer)
    described = {w.path: finder.role_of(w).description for w in backbone.weights if finder.role_of(w)}
    assert described["transformer_layer_0/self_attention/query/kernel"] == (
        "attention query (EinsumDense in CachedMultiHeadAttention)"
    )
    assert described["transformer_layer_0/feedforward_output_dense/kernel"] == (
        "feed-forward out (Dense in TransformerDecoder)"
    )
    assert described["token_embedding/embeddings"] == "token embedding (ReversibleEmbedding)"


MOE = {
    "mixtral": lambda: keras_hub.models.MixtralBackbone(
        vocabulary_size=64, num_layers=1, hidden_dim=16, intermediate_dim=32, num_query_heads=4,
        num_key_value_heads=2, num_experts=4, top_k=2),
    "qwen3_moe": lambda: keras_hub.models.Qwen3MoeBackbone(
        vocabulary_size=64, num_layers=1, num_query_heads=4, num_key_value_heads=2, hidden_dim=16,
        intermediate_dim=32, moe_intermediate_dim=8, num_experts=4, head_dim=4, top_k=2),
    "qwen_moe": lambda: keras_hub.models.QwenMoeBackbone(
        vocabulary_size=64, num_layers=1, num_query_heads=4, num_key_value_heads=2, hidden_dim=16,
        intermediate_dim=32, moe_intermediate_dim=8, shared_expert_intermediate_dim=16, num_experts=4, top_k=2),
    "gpt_oss": lambda: keras_hub.models.GptOssBackbone(
        vocabulary_size=64, num_layers=1, num_query_heads=4, hidden_dim=16, intermediate_dim=8,
        num_key_value_heads=2, num_experts=4, top_k=2, head_dim=4),
}


class ExpertBank(keras.layers.Layer):
    """A user's own stacked experts, fused gate and up [E, h, 2m] then down [E, m, h], with per-expert biases."""

    def build(self, shape):
        self.up = self.add_weight(shape=(6, shape[-1], 24), name="w_in")
        self.up_bias = self.add_weight(shape=(6, 24), name="b_in")
        self.down = self.add_weight(shape=(6, 12, shape[-1]), name="w_out")
        self.down_bias = self.add_weight(shape=(6, shape[-1]), name="b_out")


@pytest.mark.parametrize("kind", sorted(MOE))
def test_every_expert_weight_of_keras_hub_moe_layers_gets_the_expert_role(kind):
    keras.utils.set_random_seed(0)
    model = MOE[kind]()
    found = found_roles(model)
    experts = {p: r for p, r in found.items() if r and r[0] == "expert"}
    assert experts and all(r == ("expert", 0) for r in experts.values()), experts
    # Every rank-3 weight is an expert bank; nothing else is (the router and shared experts keep their roles).
    rank3 = {w.path for w in model.weights if len(w.shape) == 3 and "attention" not in w.path}
    assert {p for p in experts if p in rank3} == rank3 and rank3, (rank3, experts)
    routers = [p for p in found if re.search(r"(sparse_feedforward_gate_dense|router_dense)/kernel$", p)]
    assert routers and all(found[p] is None for p in routers), routers


def test_a_users_expert_bank_is_found_by_shape_and_splits_experts_x_hidden_on_two_axes():
    block = ExpertBank(name="moe")
    block.build((2, 8, 16))
    finder = roles.RoleFinder()
    finder.find(block)
    found = {w.name: finder.role_of(w) for w in block.weights}
    assert {n: (r.kind, r.dim, r.inner) for n, r in found.items()} == {
        "w_in": ("expert", 0, 2), "b_in": ("expert", 0, 1), "w_out": ("expert", 0, 1), "b_out": ("expert", 0, None)}
    rules = layouts.auto(expert_axis="expert")
    mesh = {"batch": 1, "expert": 2, "model": 4}
    specs = {n: roles.resolve(rules, found[n], tuple(w.shape), mesh)[0] for n, w in zip(found, block.weights)}
    assert specs == {"w_in": ("expert", None, "model"), "b_in": ("expert", "model"),
                     "w_out": ("expert", "model", None), "b_out": ("expert", None)}
    # 6 experts over 4 devices: kept whole, with the reason.
    assert roles.resolve(layouts.auto(), found["w_in"], (6, 16, 24), {"model": 4})[::2] == (
        (None, None, None), "kept whole: 6 experts are not divisible by mesh axis 'model' (4)")
    with pytest.raises(ValueError, match=r"`expert_axis` of auto\(\) is 'model', the same axis as `axis`"):
        layouts.auto(expert_axis="model")


def resnet():
    return keras_hub.models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 64],
        stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block",
        use_pre_activation=False, image_shape=(16, 16, 3))


def test_every_convolution_of_a_resnet_gets_the_conv_role_over_its_output_channels():
    model = resnet()
    found = found_roles(model)
    kernels = [w for w in model.weights if w.path.endswith("conv/kernel")]
    assert len(kernels) >= 5 and all(found[w.path] == ("conv", 3) for w in kernels), found
    assert all(found[w.path] is None for w in model.weights if "_bn/" in w.path)
    assert [str(r) for r in layouts.auto(roles=["conv"])] == ["role 'conv' -> 'model' gathered for use"]


class Tutorial(keras.Model):
    """TensorFlow's DTensor Keras tutorial's subclassed model."""

    def __init__(self, name=None):
        super().__init__(name=name)
        self.feature = keras.layers.Dense(16)
        self.feature_2 = keras.layers.Dense(24)
        self.dropout = keras.layers.Dropout(0.1)
        self.blocks = [keras.layers.Dense(8), keras.layers.Dense(8)]

    def call(self, inputs, training=None):
        x = self.dropout(self.feature(inputs), training=training)
        return self.blocks[1](self.blocks[0](self.feature_2(x)))


def test_attribute_paths_are_the_attribute_chain_from_the_subclassed_model():
    model = Tutorial(name="subclassed_model")
    model(keras.ops.zeros((2, 16)))
    paths = attributes.attribute_paths(model)
    assert model.feature.kernel.path == f"subclassed_model/{model.feature.name}/kernel"  # Keras' path: layer names
    assert [paths[id(w)] for w in model.weights[:2]] == ["feature/kernel", "feature/bias"]
    assert sorted(paths.values())[:2] == ["blocks/0/bias", "blocks/0/kernel"]
    # A functional model holding the subclassed one: its weights keep the subclassed model's attribute paths.
    inputs = keras.Input((16,))
    functional = keras.Model(inputs, keras.layers.Dense(3, name="head")(model(inputs)))
    outer = attributes.attribute_paths(functional)
    assert sorted(outer.values()) == sorted(paths.values())  # the head, a functional model's layer, has none


def test_the_keras_path_decides_first_then_the_attribute_path():
    rules = layouts.LayoutRules([(r"feature.*kernel", ("batch", None)), (r"dense_1/kernel$", (None, "model"))])
    # Only the attribute path matches: its rule decides, and says so.
    rule, matched = rules.match("subclassed_model/dense/kernel", "feature/kernel")
    assert rule.pattern == "feature.*kernel" and matched == "feature/kernel"
    assert report_lib.chosen_by_rule(rule, "subclassed_model/dense/kernel", "feature/kernel") == (
        "rule 'feature.*kernel' -> ('batch', None) on attribute path 'feature/kernel'")
    # Both match, different rules: the Keras path's rule wins.
    rule, matched = rules.match("subclassed_model/dense_1/kernel", "feature_2/kernel")
    assert rule.pattern == r"dense_1/kernel$" and matched == "subclassed_model/dense_1/kernel"
    assert rules.resolve("subclassed_model/dense_1/kernel", (16, 24), {"batch": 2, "model": 4},
                         attribute_path="feature_2/kernel") == ((None, "model"), rule)
    # Two rules matching the attribute path (none the Keras path) stay an error, naming both paths.
    twice = layouts.LayoutRules([(r"feature", ("batch", None)), (r"kernel$", (None, "model"))])
    with pytest.raises(ValueError, match=r"Variable 'm/dense/bias' \(attribute path 'feature/kernel'\) matches 2"):
        twice.rule_for("m/dense/bias", "feature/kernel")
    # A LayoutMap key keeps Keras' whole-path match on the attribute path too.
    mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"], devices=["cpu:0"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["feature.*kernel"] = ("batch", None)
    assert layouts.LayoutRules(layout_map).rule_for("m/dense/kernel", "feature_2/kernel") is not None
    assert layouts.LayoutRules(layout_map).rule_for("m/dense/kernel", "x/feature/kernel") is None


# ------------------------------------------------------------------------------------------ rules and validation
def test_auto_makes_one_role_rule_per_role_and_path_rules_win():
    rules = layouts.auto()
    assert [r.role for r in rules] == list(roles.ROLES) and rules.axes == {"model"}
    combined = rules + layouts.LayoutRules([(r"query/kernel$", (None, None, "model"))])
    assert combined.rule_for("block/attention/query/kernel").pattern == r"query/kernel$"
    assert combined.rule_for("block/mlp_in/kernel") is None  # role rules match no path
    assert combined.unmatched(["block/mlp_in/kernel"])[0][0].pattern == r"query/kernel$"
    assert [str(r) for r in layouts.auto(axis="tensor", roles=["embedding"])] == ["role 'embedding' -> 'tensor'"]


def test_a_role_the_axis_does_not_divide_stays_whole_with_a_note():
    rules = layouts.auto()
    role = roles.Role("embedding", 0, "token embedding", "vocabulary entries")
    assert roles.resolve(rules, role, (50257, 16), {"batch": 2, "model": 4}) == (
        (None, None),
        rules.rules[4],
        "kept whole: 50257 vocabulary entries are not divisible by mesh axis 'model' (4)",
    )
    assert roles.resolve(layouts.auto(roles=["lm_head"]), role, (64, 16), {"model": 4})[:2] == ((None, None), None)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"roles": "mlp_in"}, r"`roles` must be a list of role names from \['attention_in'"),
        ({"roles": ["mlp_in", "mlp"]}, r"Unknown role 'mlp' in `roles` of auto\(\). Valid roles: \['attention_in'"),
        ({"roles": ["mlp_in", "mlp_in"]}, r"Role 'mlp_in' is given twice"),
        ({"axis": ""}, r"axis must be a mesh axis name; got ''"),
        ({"axis": 4}, r"axis must be a mesh axis name; got 4"),
    ],
)
def test_auto_rejects_bad_input_naming_it(kwargs, message):
    with pytest.raises(ValueError, match=message):
        layouts.auto(**kwargs)


def test_strategy_rejects_a_role_axis_the_mesh_lacks():
    with pytest.raises(ValueError, match=r"role 'attention_in' -> 'tensor'.*Valid axes: \['batch', 'model'\]"):
        tfdist.ModelParallelStrategy(mesh={"batch": 2, "model": 4}, rules=layouts.auto(axis="tensor"))


# ------------------------------------------------------------------------------------------ on 8 devices
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("roles")
    return run_child(CHILD, out, timeout=900)


@pytest.mark.parametrize("kind", KINDS)
def test_fit_equals_one_device(run, kind):
    r = run[kind]
    assert all(math.isclose(a, b, rel_tol=LOSS_RTOL) for a, b in zip(r["loss"], r["ref_loss"])), r
    assert r["weights_diff"] < WEIGHTS_ATOL and r["slots_diff"] < WEIGHTS_ATOL, r
    assert len(r["loss"]) == 2 and r["loss"][-1] < r["loss"][0]
    # The deferred creation keeps Keras' order of initializers: seeded weights are one device's.
    assert r["seeded_init_diff"] == 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_every_attention_and_feed_forward_kernel_is_split(run, kind):
    layout = run[kind]["layouts"]
    for pattern, (_, dim) in KERNELS[kind].items():
        matching = [p for p in layout if re.search(pattern, p)]
        assert matching, (pattern, sorted(layout))
        for path in matching:
            assert layout[path][dim] == "model" and layout[path].count("model") == 1, (path, layout[path])
    for path, dim in EMBEDDINGS[kind].items():
        assert layout[path][dim] == "model", (path, layout[path])


@pytest.mark.parametrize("kind", KINDS)
def test_bytes_per_device_are_the_split_bytes_over_four_plus_the_replicated(run, kind):
    r = run[kind]
    ideal = r["bytes_sharded"] / 4 + r["bytes_replicated"]
    print(
        f"{kind}: {r['bytes_device']:,} bytes on a device (weights and Adam state) of {r['bytes_total']:,}; "
        f"split {r['bytes_sharded']:,} / 4 + replicated {r['bytes_replicated']:,} = {ideal:,.0f}; "
        f"weights {r['bytes_device_weights'] / r['weights_bytes_total']:.3f} of the model on a device"
    )
    assert r["bytes_device"] <= BYTES_SLACK * ideal
    assert r["report_bytes_device"] == [r["bytes_device"]]  # the report's arithmetic is the shards'


@pytest.mark.parametrize("kind", KINDS)
def test_report_names_the_role_of_each_split_weight_and_nothing_is_unmatched(run, kind):
    r = run[kind]
    assert r["unmatched"] == [] and r["misplaced"] == []
    for path, spec in r["layouts"].items():
        if any(spec):
            assert r["chosen_by"][path], path
    header = r["table"].splitlines()[0].split()
    assert header[-2:] == ["chosen", "by"]
    query = next(p for p in r["chosen_by"] if p.endswith("/query/kernel"))
    attention = {"gpt2": "CachedMultiHeadAttention", "llama": "LlamaAttention", "gemma": "CachedGemmaAttention",
                 "bert": "MultiHeadAttention", "transformer_lm": "MultiHeadAttention"}[kind]
    assert r["chosen_by"][query] == f"attention query (EinsumDense in {attention})"
    notes = {p: n for p, n in r["notes"].items() if "/" in p and not p.startswith("adam")}
    # BERT's 2-entry segment embedding is the one role the model axis does not divide.
    assert notes == ({"segment_embedding/embeddings": "kept whole: 2 vocabulary entries are not divisible by mesh "
                      "axis 'model' (4)"} if kind == "bert" else {})


def test_weights_saved_from_the_mesh_reload_into_a_fresh_model_placed_alike(run):
    assert run["gpt2_reload_diff"] == 0.0 and run["gpt2_reload_layouts_equal"]


def test_auto_splits_what_the_name_preset_misses_on_gpt2(run):
    by_name, auto = run["gpt2_transformer_preset"], run["gpt2"]
    fraction = auto["bytes_device_weights"] / auto["weights_bytes_total"]
    print(f"gpt2 weights on a device: transformer() {by_name['device_fraction']:.3f} "
          f"({by_name['split']} of {by_name['variables']} split), auto() {fraction:.3f}")
    split = sum(1 for spec in auto["layouts"].values() if any(spec))
    assert split > by_name["split"] and fraction < by_name["device_fraction"]


def test_a_subclassed_model_built_by_tracing_its_call_gets_its_roles(run):
    r = run["subclassed"]
    assert all(math.isclose(a, b, rel_tol=LOSS_RTOL) for a, b in zip(r["loss"], r["ref_loss"])), r
    assert r["weights_diff"] < WEIGHTS_ATOL
    specs = [r["layouts"][p] for p in sorted(r["layouts"])]
    # up 16 -> 64 (column), down 64 -> 16 (row), head 16 -> 4 (no role)
    assert specs == [["model"], [None, "model"], [None], ["model", None], [None], [None, None]]


def test_variables_wait_for_the_end_of_the_build_and_a_read_before_creates_them(run):
    r = run["read_in_build"]
    assert run["pending_inside_build"] == 2  # the first sublayer's kernel and bias waited for the build's end
    assert r["read_equals_weight"] and r["pending_after_build"] == 0
    # The read created the first dense layer before the second existed; the second is still placed by role.
    kernels = [r["layouts"][p] for p in sorted(r["layouts"]) if p.endswith("kernel")]
    assert kernels == ["['unsharded', 'unsharded']", "['model', 'unsharded']"]


def test_a_model_without_roles_reports_the_role_rules_as_unmatched(run):
    assert run["no_roles_unmatched"] == [str(rule) for rule in layouts.auto()]
    assert run["no_roles_unmatched"][-1] == "role 'conv' -> 'model' gathered for use"


def test_key_value_heads_the_axis_does_not_divide_stay_whole_with_a_note(run):
    r = run["indivisible"]
    assert r["transformer_layer_0/self_attention/query/kernel"][0] == [None, "model", None]
    for name in ("key", "value"):
        spec, note, chosen_by = r[f"transformer_layer_0/self_attention/{name}/kernel"]
        assert spec == [None, None, None]
        assert note == "kept whole: 2 heads are not divisible by mesh axis 'model' (4)"
        assert chosen_by == f"attention {name} (EinsumDense in LlamaAttention)"


def test_every_mixtral_expert_kernel_is_split_four_ways_within_the_byte_budget(run):
    r = run["mixtral_placed"]
    assert len(r["experts"]) == 6  # 3 banks in each of 2 layers
    for path, (shape, shard) in r["experts"].items():
        assert shard == [shape[0] // 4] + shape[1:] and r["layouts"][path] == ["model", None, None], path
        assert r["chosen_by"][path].startswith("experts' feed-forward ") and "4 experts in MixtralMoeExperts" in (
            r["chosen_by"][path])
    ideal = r["bytes_sharded"] / 4 + r["bytes_replicated"]
    print(f"mixtral on {{batch: 2, model: 4}}: {r['bytes_device']:,} weight bytes on a device, report "
          f"{r['report_bytes_device'][0]:,}, ideal {ideal:,.0f} (split {r['bytes_sharded']:,} / 4 + replicated "
          f"{r['bytes_replicated']:,})")
    assert r["bytes_device"] <= BYTES_SLACK * ideal and r["report_bytes_device"][0] <= BYTES_SLACK * ideal
    assert r["unmatched"] == [] and "experts' feed-forward out" in r["table"]


def test_mixtral_with_split_experts_trains_as_on_one_device(run):
    r = run["mixtral_trained"]
    assert set(map(tuple, r["expert_layouts"].values())) == {("model", None, None)}
    assert r["weights_diff"] < WEIGHTS_ATOL and r["moved"] > 100 * WEIGHTS_ATOL, r
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(r["loss"], r["ref_loss"])), r


def test_the_tutorials_subclassed_model_shards_feature_over_the_batch_axis_by_attribute_path(run):
    r = run["tutorial"]
    for name in ("feature", "feature_2"):
        kernel, bias = (next(p for p, c in r["chosen_by"].items() if c.endswith(f"attribute path '{name}/{w}'"))
                        for w in ("kernel", "bias"))
        assert r["layouts"][kernel] == ["batch", None] and r["layouts"][bias] == ["batch"]
    assert r["warnings"] == [] and r["table"].splitlines()[0].split()[-2:] == ["chosen", "by"]
    assert r["weights_diff"] < WEIGHTS_ATOL, r  # SGD, against one device
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(r["loss"], r["ref_loss"])), r
    # The same cells through Keras' own API.
    assert sorted(map(tuple, run["tutorial_keras_distribution"].values())) == [("batch",)] * 2 + [("batch", None)] * 2


def test_a_rule_matching_neither_path_still_warns_with_attribute_paths_as_near_misses(run):
    (warning,) = run["tutorial_typo_warnings"]
    assert "rule '^featur/kernel$' -> (None, 'model') matched no variable; similar paths: " in warning
    assert "feature/kernel" in warning.split("similar paths: ")[1].split(".")[0].split(", ")


def test_auto_splits_a_resnets_convolutions_over_output_channels_gathered_for_use(run):
    kernels = run["resnet"]
    assert len(kernels) == 6
    assert all(v == [[None, None, None, "model"], True, "convolution filters (Conv2D)"] for v in kernels.values())
