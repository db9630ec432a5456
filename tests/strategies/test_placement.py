"""Placement: meshes, layout rules and presets (pure, no DTensor program runs), and the
ModelParallelStrategy constructor's validation."""

import re

import pytest

from tfdist import layouts
from tfdist.placement import make_mesh
from tfdist.strategies import model_parallel
from tfdist.strategies.model_parallel import ModelParallelStrategy

MESH = {"batch": 2, "model": 4}


# ------------------------------------------------------------------------------------------ rules
def test_first_and_only_matching_rule_decides_and_unmatched_is_replicated():
    rules = layouts.LayoutRules([(r"mlp_in/kernel$", (None, "model")), (r"mlp_in/bias$", ("model",))])
    assert rules.spec_for("block_0/mlp_in/kernel", (16, 64), MESH) == (None, "model")
    assert rules.spec_for("block_0/mlp_in/bias", (64,), MESH) == ("model",)
    assert rules.spec_for("block_0/mlp_norm/gamma", (16,), MESH) == (None,)
    assert rules.spec_for("adam/iteration", (), MESH) == ()


def test_two_matching_rules_is_an_error_naming_both_and_the_path():
    rules = layouts.LayoutRules([(r"kernel$", (None, "model")), (r"mlp_in/", ("model", None))])
    with pytest.raises(ValueError, match=r"'block_0/mlp_in/kernel' matches 2 layout rules: 'kernel\$'.*'mlp_in/'"):
        rules.spec_for("block_0/mlp_in/kernel", (16, 64), MESH)


def test_rank_mismatch_names_rule_path_and_shape():
    rules = layouts.LayoutRules([(r"kernel$", (None, "model"))])
    with pytest.raises(ValueError, match=r"has 2 entries but variable 'attention/query/kernel' has shape \(16, 4, 4\)"):
        rules.spec_for("attention/query/kernel", (16, 4, 4), MESH)


def test_ellipsis_leaves_leading_dimensions_whole():
    rules = layouts.LayoutRules([(r"kernel$", (..., "model"))])
    assert rules.spec_for("conv/kernel", (3, 3, 8, 16), MESH) == (None, None, None, "model")
    assert rules.spec_for("dense/kernel", (8, 16), MESH) == (None, "model")
    with pytest.raises(ValueError, match="rank 0"):
        rules.spec_for("scalar/kernel", (), MESH)


def test_unknown_axis_is_an_error_naming_the_axis_and_the_valid_ones():
    rules = layouts.LayoutRules([(r"kernel$", (None, "tensor"))])
    with pytest.raises(ValueError, match=r"uses mesh axis 'tensor'.*Valid axes: \['batch', 'model'\]"):
        rules.check_axes(MESH)
    with pytest.raises(ValueError, match=r"matching 'dense/kernel'.*mesh axis 'tensor'"):
        rules.spec_for("dense/kernel", (8, 8), MESH)


def test_indivisible_dimension_names_variable_dimension_and_sizes():
    rules = layouts.LayoutRules([(r"kernel$", (None, "model"))])
    with pytest.raises(
        ValueError, match=r"'dense/kernel' of shape \(8, 6\): dimension 1 \(size 6\).*mesh axis 'model' \(size 4\)"
    ):
        rules.spec_for("dense/kernel", (8, 6), MESH)


@pytest.mark.parametrize(
    "rule, message",
    [
        (("(", (None,)), "not a valid regular expression"),
        (("kernel", "model"), "must be a tuple"),
        (("kernel", ("model", "model")), "'model' appears twice"),
        (("kernel", (None, 3)), "got 3"),
        (("", (None,)), "non-empty regex"),
        (("kernel",), "Expected a \\(regex, spec\\) pair"),
    ],
)
def test_malformed_rules_are_rejected(rule, message):
    with pytest.raises(ValueError, match=message):
        layouts.LayoutRules([rule])


def test_repeated_pattern_is_rejected_and_rules_combine_with_plus():
    with pytest.raises(ValueError, match="given twice"):
        layouts.LayoutRules([("a$", (None,)), ("a$", ("model",))])
    combined = layouts.data_parallel() + [("head/kernel$", (None, "model"))]
    assert combined.patterns == ["head/kernel$"]
    assert layouts.LayoutRules({"x$": ("model",)}).rules[0] == layouts.Rule("x$", ("model",))


def test_unmatched_rules_are_reported_with_near_misses():
    rules = layouts.LayoutRules([(r"mlp_in/kernel$", (None, "model")), (r"mlp_inp/kernel$", (None, "model"))])
    paths = ["block_0/mlp_in/kernel", "block_0/mlp_in/bias", "block_0/mlp_out/kernel"]
    unmatched = rules.unmatched(paths)
    assert [str(r.pattern) for r, _ in unmatched] == ["mlp_inp/kernel$"]
    assert "block_0/mlp_in/kernel" in unmatched[0][1]


# ------------------------------------------------------------------------------------------ presets
# Paths as tfdist.models.transformer_lm names them.
TRANSFORMER_EXPECTED = {
    ("token_embedding/embeddings", (256, 64)): ("model", None),
    ("position_embedding/embeddings", (128, 64)): (None, None),
    ("block_0/attention_norm/gamma", (64,)): (None,),
    ("block_0/attention/query/kernel", (64, 8, 8)): (None, "model", None),
    ("block_0/attention/key/bias", (8, 8)): ("model", None),
    ("block_0/attention/value/kernel", (64, 8, 8)): (None, "model", None),
    ("block_0/attention/attention_output/kernel", (8, 8, 64)): ("model", None, None),
    ("block_0/attention/attention_output/bias", (64,)): (None,),
    ("block_0/mlp_in/kernel", (64, 256)): (None, "model"),
    ("block_0/mlp_in/bias", (256,)): ("model",),
    ("block_0/mlp_out/kernel", (256, 64)): ("model", None),
    ("block_0/mlp_out/bias", (64,)): (None,),
    ("final_norm/gamma", (64,)): (None,),
    ("logits/kernel", (64, 256)): (None, "model"),
    ("logits/bias", (256,)): ("model",),
}


def test_transformer_preset_column_row_heads_and_vocabulary():
    rules = layouts.transformer()
    got = {key: rules.spec_for(*key, MESH) for key in TRANSFORMER_EXPECTED}
    assert got == TRANSFORMER_EXPECTED
    assert rules.unmatched(path for path, _ in TRANSFORMER_EXPECTED) == []


def test_transformer_preset_takes_other_names_and_axis():
    rules = layouts.transformer(axis="tp", mlp_in="fc1", mlp_out="fc2", lm_head="head")
    mesh = {"dp": 2, "tp": 4}
    assert rules.spec_for("enc/fc1/kernel", (8, 16), mesh) == (None, "tp")
    assert rules.spec_for("enc/fc2/kernel", (16, 8), mesh) == ("tp", None)
    assert rules.spec_for("head/kernel", (8, 16), mesh) == (None, "tp")
    assert rules.spec_for("enc/mlp_in/kernel", (8, 16), mesh) == (None, None)


def test_conv_preset_splits_output_channels_and_gathers_for_use():
    rules = layouts.conv()
    assert rules.spec_for("cnn/conv2d_1/kernel", (3, 3, 16, 32), MESH) == (None, None, None, "model")
    assert rules.spec_for("conv1d/bias", (32,), MESH) == ("model",)
    assert rules.spec_for("depthwise_conv2d/kernel", (3, 3, 16, 1), MESH) == (None, None, None, None)
    assert rules.spec_for("conv2d_transpose/kernel", (3, 3, 16, 32), MESH) == (None, None, None, None)
    assert all(rule.gather for rule in rules)


def test_data_parallel_preset_replicates_everything():
    assert layouts.data_parallel().spec_for("dense/kernel", (8, 8), MESH) == (None, None)


# ------------------------------------------------------------------------------------------ meshes
def test_make_mesh_orders_axes_and_devices():
    mesh = make_mesh(MESH)
    assert mesh.dim_names == ["batch", "model"]
    assert mesh.shape() == [2, 4]
    assert len(mesh.local_devices()) == 8
    assert make_mesh({"model": 2}, devices=["CPU:6", "cpu:7"]).local_devices()[-1].endswith("CPU:7")


@pytest.mark.parametrize(
    "axes, devices, message",
    [
        ({"batch": 2, "model": 2}, None, r"needs 4 devices, but 8 are given"),
        ({"batch": 4, "model": 4}, None, r"simulate_devices\(16\)"),
        ({}, None, "non-empty dict"),
        ({"model": 0}, None, "mesh axis 'model': 0"),
        ({"model": 2.0}, None, "mesh axis 'model': 2.0"),
        ({"my axis": 8}, None, "Invalid mesh axis name 'my axis'"),
        ({"model": 2}, ["CPU:0", "CPU:0"], "repeated"),
        ({"model": 2}, ["CPU:0", "CPU:99"], "'CPU:99' does not exist"),
        ({"model": 2}, "CPU:0", "Expected a non-empty list"),
    ],
)
def test_make_mesh_rejects_bad_input_naming_it(axes, devices, message):
    with pytest.raises(ValueError, match=message):
        make_mesh(axes, devices)


# ------------------------------------------------------------------------------------------ strategy
@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mesh": {"batch": 2, "model": 2}}, r"needs 4 devices, but 8"),
        ({"rules": [("kernel$", (None, "tensor"))]}, r"mesh axis 'tensor'.*Valid axes: \['batch', 'model'\]"),
        ({"batch_axis": "data"}, r"batch_axis='data' is not an axis.*\['batch', 'model'\] or None"),
        ({"batch_axis": 3}, "mesh axis name or None"),
        ({"mesh": {"model": -1}}, "Expected an integer >= 1"),
    ],
)
def test_strategy_rejects_bad_input_before_building_anything(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ModelParallelStrategy(**kwargs)


def test_strategy_refuses_dtensor_all_reduce_combining(monkeypatch):
    monkeypatch.setenv(model_parallel.COMBINE_ALL_REDUCES_ENV, "1")
    with pytest.raises(RuntimeError, match="DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION='1'.*corrupts"):
        ModelParallelStrategy()


def test_constructor_is_keyword_only():
    with pytest.raises(TypeError):
        ModelParallelStrategy({"batch": 2, "model": 4})


def test_strategy_builds_its_mesh_and_installs_its_hooks():
    from tfdist import _compat

    strategy = ModelParallelStrategy(mesh={"batch": 2, "model": 4}, rules=layouts.transformer())
    assert strategy.mesh_shape == {"batch": 2, "model": 4}
    assert strategy.mesh.dim_names == ["batch", "model"]
    assert strategy.batch_axis == "batch"
    assert strategy.num_replicas_in_sync == 1  # one global program: Keras must not rescale the loss
    assert strategy.rules == layouts.transformer()
    assert repr(strategy).startswith("ModelParallelStrategy(mesh={'batch': 2, 'model': 4}")
    assert _compat.installed("model_parallel")
    assert ModelParallelStrategy(mesh={"model": 8}).batch_axis is None  # every device sees the whole batch
    assert ModelParallelStrategy(mesh={"data": 2, "model": 4}, batch_axis="data").batch_axis == "data"


def test_near_misses_of_a_pattern_with_wildcards_come_from_its_literal_pieces():
    # The dtensor_keras tutorial's rule on a subclassed model's paths (too unlike any path for difflib).
    rules = layouts.LayoutRules([("feature.*kernel", (None, "model"))])
    prefix = "subclassed_model_1"
    paths = [f"{prefix}/dense_2/kernel", f"{prefix}/dense_2/bias", f"{prefix}/dense_3/kernel"]
    ((rule, near),) = rules.unmatched(paths)
    assert rule.pattern == "feature.*kernel"
    assert sorted(near) == [f"{prefix}/dense_2/kernel", f"{prefix}/dense_3/kernel"]  # the kernels, not the bias


@pytest.mark.parametrize("pattern", ["d2/output", "d2/output$", "output", r"block_\d+/mlp/output$"])
def test_activation_layouts_are_refused_naming_the_rule(pattern):
    with pytest.raises(ValueError, match=r"names a layer's output \(an activation layout.*place weights only"):
        layouts.LayoutRules({pattern: (None, "model")})
    with pytest.raises(ValueError, match=re.escape(repr(pattern))):
        ModelParallelStrategy(mesh={"batch": 2, "model": 4}, rules=[(pattern, ("batch", "model"))])


def test_weights_of_a_layer_named_output_are_not_activations():
    rules = layouts.LayoutRules([("output/kernel$", (None, "model")), ("output_proj/bias", ("model",))])
    assert rules.spec_for("lm/output/kernel", (8, 16), MESH) == (None, "model")


# ------------------------------------------------------------------------------- keras LayoutMap
def _layout_map(shape=(2, 4), names=("batch", "model")):
    from keras import distribution

    devices = [f"cpu:{i}" for i in range(shape[0] * shape[1])]
    return distribution.LayoutMap(distribution.DeviceMesh(shape=shape, axis_names=names, devices=devices))


def test_layout_map_keeps_keras_matching_fullmatch_and_exact_key_first():
    layout_map = _layout_map()
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d.*/kernel"] = ("model", None)
    layout_map["dense/bias"] = ("model",)
    layout_map["d2/output"] = ("batch", None)
    rules = layouts.LayoutRules(layout_map)
    assert rules.mesh == MESH
    assert rules.activation_keys == ("d2/output",)
    # The exact key wins over the regex key that also matches it, as in Keras.
    assert rules.spec_for("d1/kernel", (8, 16), MESH) == (None, "model")
    assert rules.spec_for("d2/kernel", (16, 4), MESH) == ("model", None)
    # Keys must match the whole path (re.fullmatch), where tfdist's own patterns are searched.
    assert rules.spec_for("block/dense/bias", (16,), MESH) == (None,)
    assert rules.spec_for("dense/bias", (16,), MESH) == ("model",)
    assert "LayoutMap key 'd1/kernel'" in str(rules.rule_for("d1/kernel"))
    # Combined with tfdist rules, the map's mesh stays.
    assert (rules + [(r"head/kernel$", (None, "model"))]).mesh == MESH


def test_layout_map_errors_name_the_path_and_the_meshes():
    from keras import distribution

    layout_map = _layout_map()
    layout_map["d1/kernel"] = ("model",)
    rules = layouts.LayoutRules(layout_map)
    rank = r"LayoutMap key 'd1/kernel'.*variable 'd1/kernel' has shape \(8, 16\) \(rank 2\)"
    with pytest.raises(ValueError, match=rank):
        rules.spec_for("d1/kernel", (8, 16), MESH)
    other = distribution.DeviceMesh(shape=(4, 2), axis_names=("batch", "model"), devices=[f"cpu:{i}" for i in range(8)])
    layout_map = _layout_map()
    layout_map["d1/kernel"] = distribution.TensorLayout((None, "model"), other)
    wide, tall = r"\{'batch': 2, 'model': 4\}", r"\{'batch': 4, 'model': 2\}"
    with pytest.raises(ValueError, match=f"LayoutMap key 'd1/kernel'.*{tall}.*{wide}"):
        layouts.LayoutRules(layout_map)
    devices = [f"CPU:{i}" for i in range(8)]
    with pytest.raises(ValueError, match=f"LayoutMap's DeviceMesh {wide}.*{tall}"):
        ModelParallelStrategy(mesh={"batch": 4, "model": 2}, rules=_layout_map(), devices=devices)
