"""PipelineStrategy inside nested models (a backbone used as a layer) and with weights tied across stages.

The training scenarios run in one process of their own (tests/scenarios/pipeline_nested_and_tied.py, 4 simulated CPUs):
each model is trained once on one device and once pipelined from the same seed on the same examples in
the same order. Tolerances: per-step losses rtol 1e-5; weights after SGD atol 1e-5, after Adam atol 1e-4
(micro-batch gradients summed in another order than one device's differ by float32 rounding only). The
planning and bad-input checks run here, on models that are only built.
"""

import os

import keras
import numpy as np
import pytest
from _procs import REPO
from _procs import run_child

import tfdist
from tfdist.placement import pipeline as pipeline_lib

CHILD = os.path.join(REPO, "tests", "scenarios", "pipeline_nested_and_tied.py")
SGD_ATOL, ADAM_ATOL, RTOL = 1e-5, 1e-4, 1e-5
VOCAB, SEQ, WIDTH, BATCH, MICROBATCHES = 96, 16, 32, 8, 4  # as in the child


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("pipe_nested")
    return run_child(CHILD, out, timeout=600)


def assert_equal_to_one_device(run, atol):
    assert run["paths_match"]
    assert run["weight_diff"] <= atol, run["weight_diff"]
    np.testing.assert_allclose(run["losses"], run["ref_losses"], rtol=RTOL)


# ------------------------------------------------------------------------------ KerasHub GPT-2
def test_gpt2_trains_equal_to_one_device(runs):
    run = runs["gpt2"]
    assert len(run["losses"]) == 4  # 32 sequences in batches of 8, one epoch
    assert_equal_to_one_device(run, ADAM_ATOL)


def test_gpt2_is_cut_between_its_transformer_layers(runs):
    run = runs["gpt2"]
    stage_0, stage_1 = run["plan"]["layers"]
    assert "gpt2_backbone/transformer_layer_0" in stage_0 and "gpt2_backbone/transformer_layer_1" in stage_1
    assert stage_1[-1] == "token_embedding"  # the output projection: the top-level call of the tied embedding
    report = run["plan"]["report"]
    assert "| 0 | gpt2_backbone/position_embedding .. gpt2_backbone/transformer_layer_0 (4) |" in report
    # The two stages hold different layers' weights, with their Adam slots.
    devices = run["devices"]
    assert {p for p, d in devices.items() if d == ["CPU:0"]} >= {
        "position_embedding/embeddings",
        "transformer_layer_0/self_attention/query/kernel",
        "transformer_layer_0/feedforward_output_dense/kernel",
    }
    assert {p for p, d in devices.items() if d == ["CPU:1"]} >= {
        "token_embedding/embeddings",
        "transformer_layer_1/self_attention/query/kernel",
        "layer_norm/gamma",
    }
    assert set(map(tuple, devices.values())) == {("CPU:0",), ("CPU:1",)}
    for path, where in run["optimizer_devices"].items():  # Adam's slots next to their variables
        assert where == (["CPU:1"] if "token_embedding" in path else ["CPU:0"]), path
    assert sum(run["plan"]["params"]) == run["count_params"]  # the tied weight counted once


def test_gpt2_tied_embedding_lives_once_on_the_last_stage(runs):
    run = runs["gpt2"]
    (shared,) = run["plan"]["shared"]
    assert shared == {
        "weights": ["token_embedding/embeddings"],
        "calls": ["gpt2_backbone/token_embedding", "token_embedding"],
        "placed": [0, 1],
        "stage": 1,
    }
    assert "Shared weights token_embedding/embeddings" in run["plan"]["report"]
    # One variable, one optimizer state (Adam: a momentum and a velocity, not two of each).
    slots = [p for p in run["optimizer_variables"] if "token_embedding" in p]
    assert len(slots) == 2, slots
    # The lookup runs where the embedding lives, so no tensor of the weight's size crosses stages. Per
    # direction and micro-batch, two activations cross: forward the cut's and the lookup's output, backward
    # their gradients; everything else is at most a micro-batch of token ids (ids, padding mask, labels,
    # sample weights; scalars; a bias gradient at the cut).
    assert run["gather_devices"] == ["CPU:1"]
    activation = BATCH // MICROBATCHES * SEQ * WIDTH * 4
    ids = BATCH // MICROBATCHES * SEQ * 4
    assert not [c for c in run["crossing"] if VOCAB in c["shape"]]
    for direction in (("CPU:0", "CPU:1"), ("CPU:1", "CPU:0")):
        crossing = [c for c in run["crossing"] if (c["from"], c["to"]) == direction]
        assert [c["bytes"] for c in crossing].count(activation) == 2 * MICROBATCHES, crossing
        assert all(c["bytes"] == activation or c["bytes"] <= ids for c in crossing), crossing
    # Both uses' gradients reach the one variable: it equals one device's after training (the test above),
    # and neither use's part of its gradient is small enough to go missing unnoticed (on one device, the
    # first batch: each part's norm / the whole gradient's).
    shares = run["tied_gradient_shares"]
    assert shares["lookup"] > 0.1 and shares["projection"] > 0.1, shares


def test_gpt2_saved_pipelined_loads_on_one_device(runs):
    run = runs["gpt2"]
    assert run["restored_weight_diff"] == 0.0
    assert run["restored_output_diff"] <= 1e-4


def test_gpt2_explicit_path_rules(runs):
    run = runs["gpt2"]
    assert run["explicit_layers"] == run["plan"]["layers"]
    error = run["bad_rule_error"]
    assert "'gpt2_backbone/transformer_layer_7' matches no layer of model 'gpt2_causal_lm'" in error
    assert "Valid names: ['gpt2_backbone', 'gpt2_backbone/token_embedding'," in error
    assert "Did you mean ['gpt2_backbone/transformer_layer_1', 'gpt2_backbone/transformer_layer_0'" in error


# ------------------------------------------------------------------------------ plain Keras, nested
def test_nested_functional_balanced_over_three_stages(runs):
    run = runs["nested_auto"]
    assert_equal_to_one_device(run, SGD_ATOL)
    # Cut inside the nested Sequential, itself inside the backbone.
    assert run["plan"]["layers"] == [
        ["backbone/stem", "backbone/block/b0"],
        ["backbone/block/b1"],
        ["backbone/residual", "backbone/neck", "head"],
    ]
    assert run["devices"]["block/b0/kernel"] == ["CPU:0"] and run["devices"]["block/b1/kernel"] == ["CPU:1"]
    assert run["devices"]["head/kernel"] == ["CPU:2"]


def test_nested_functional_placed_by_path_rules(runs):
    run = runs["nested_rules"]
    assert_equal_to_one_device(run, ADAM_ATOL)
    # "backbone" -> 0 covers stem; "backbone/block" -> 1 covers b1; "backbone/block/b0" -> 0 is more specific.
    assert run["plan"]["layers"] == [
        ["backbone/stem", "backbone/block/b0"],
        ["backbone/block/b1", "backbone/residual", "backbone/neck", "head"],
    ]
    assert run["devices"]["block/b0/kernel"] == ["CPU:0"] and run["devices"]["block/b1/kernel"] == ["CPU:1"]


def test_a_layer_reading_another_layers_kernel_on_a_later_stage_with_two_replicas(runs):
    run = runs["tied"]
    assert_equal_to_one_device(run, ADAM_ATOL)
    assert run["stage_devices"] == [["CPU:0", "CPU:2"], ["CPU:1", "CPU:3"]]
    assert run["plan"]["layers"] == [["middle"], ["first", "tied", "head"]]
    assert run["plan"]["shared"][0]["calls"] == ["first", "tied"]
    # Each replica's copy of the shared weights on its stage-1 device.
    assert run["devices"]["first/kernel"] == ["CPU:1", "CPU:3"]
    assert run["devices"]["middle/kernel"] == ["CPU:0", "CPU:2"]


# ------------------------------------------------------------------------------ planning, in this process
def nested():
    keras.utils.set_random_seed(3)
    block = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8, name="b0"), keras.layers.Dense(8, name="b1")], name="block"
    )
    features = keras.Input((8,))
    stem = keras.layers.Dense(8, name="stem")(features)
    backbone = keras.Model(features, keras.layers.Add(name="residual")([stem, block(stem)]), name="backbone")
    inputs = keras.Input((8,))
    shared = keras.layers.Dense(8, name="shared")
    x = shared(backbone(inputs))
    x = shared(x)  # a second call of one layer in one graph: "shared:1"
    model = keras.Model(inputs, keras.layers.Dense(3, name="head")(x), name="nested")
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_units_are_the_calls_of_nested_models():
    model = nested()
    units = pipeline_lib.stage_units(model)
    assert [u.name for u in units] == [
        "backbone/stem",
        "backbone/block/b0",
        "backbone/block/b1",
        "backbone/residual",
        "shared",
        "shared:1",
        "head",
    ]
    assert units[2].containers == ("backbone/block", "backbone") and units[5].base_name == "shared"
    assert [sorted(u.parents) for u in units] == [[], [0], [1], [0, 2], [3], [4], [5]]
    # The two calls of `shared` are linked by their weights: cut as one, at the second, counted once.
    plan = pipeline_lib.balance(model, 3, cost="params")
    assert sum(plan.params) == model.count_params()
    assert plan.stage_of("shared") == plan.stage_of("shared:1")
    assert pipeline_lib.plan_explicit(model, plan.placement, 3).layers == plan.layers
    assert pipeline_lib.layer_flops(model, "backbone/block/b0", batch_size=4) == 2 * 4 * 8 * 8 + 4 * 8


def test_rules_name_calls_by_path_most_specific_first():
    rules = {
        "backbone": 0,  # stem
        "backbone/block": 1,  # b1
        "backbone/block/b0": 0,  # more specific than the rule of its block
        "backbone/residual": 1,
        "shared": 1,  # the first call; the second has a rule of its own
        "shared:1": 2,
        "head": 2,
    }
    plan = pipeline_lib.plan_explicit(nested(), rules, 3)
    assert plan.layers == (
        ("backbone/stem", "backbone/block/b0"),
        ("backbone/block/b1", "backbone/residual"),
        ("shared", "shared:1", "head"),  # both calls of `shared` where it lives: the later of their stages
    )
    assert plan.shared[0].calls == ("shared", "shared:1") and plan.shared[0].moved == ("shared",)
    assert "Shared weights shared/kernel, shared/bias: used by shared (stage 1), shared:1 (stage 2)" in plan.report()
    assert plan.placement["shared"] == 1  # pinning the plan keeps the rules' stage, not where it runs


# ------------------------------------------------------------------------------ bad input
def test_rule_naming_an_inner_layer_that_does_not_exist():
    strategy = tfdist.PipelineStrategy(
        stages=2, microbatches=2, placement={"backbone/stem|backbone/block/b0": 0, "backbone/block/b2": 1}
    )
    with strategy.scope():
        model = nested()
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError) as e:
        model.fit(rng.normal(size=(8, 8)), rng.integers(0, 3, size=(8,)), batch_size=8, verbose=0)
    message = str(e.value)
    assert "Placement rule 'backbone/block/b2' matches no layer of model 'nested'" in message
    assert (
        "Valid names: ['backbone', 'backbone/stem', 'backbone/block', 'backbone/block/b0', 'backbone/block/b1', "
        "'backbone/residual', 'shared', 'shared:1', 'head']" in message
    )
    assert "Did you mean ['backbone/block/b1', 'backbone/block/b0'" in message


def test_rules_of_two_stages_for_one_call():
    with pytest.raises(ValueError, match=r"Layer 'backbone/block/b0' is matched by placement rules of stages \[0, 1\]"):
        pipeline_lib.plan_explicit(nested(), {".*": 0, "backbone/block/b.": 1}, 2)
    rules = {"backbone/stem": 0, "backbone/block": 0, "backbone/bloc[k]": 1}
    with pytest.raises(ValueError, match=r"'backbone/block/b0' is matched \(as 'backbone/block'\) by placement rules"):
        pipeline_lib.plan_explicit(nested(), rules, 2)


def test_a_stage_left_with_only_calls_that_moved():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    shared = keras.layers.Dense(8, name="shared")
    x = shared(keras.layers.Dense(8, name="middle")(shared(inputs)))
    model = keras.Model(inputs, x)
    # Stage 0 gets only the first call of `shared`, which runs on stage 1 with the second.
    with pytest.raises(ValueError, match=r"stages \[0\] of 2 run no layer.*\['shared'\] run on the stage holding"):
        pipeline_lib.plan_explicit(model, {"shared": 0, "middle|shared:1": 1}, 2)
