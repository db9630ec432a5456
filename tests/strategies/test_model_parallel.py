"""ModelParallelStrategy: Keras 3 models split over a DTensor mesh train as on one device.

Each scenario runs in a process of its own (tests/scenarios/model_parallel_vs_one_device.py; a DTensor runtime error
poisons its process) on 8 simulated CPUs, two processes at a time (`SCENARIOS`, in order; "reshard" once "hybrid"
has written its checkpoints), trains the same model unsharded and sharded from the same seed on the same batches,
and reports numbers checked here. Tolerances: losses rtol 1e-4, weights after Adam atol 1e-4 (float32 sums over
shards associate differently than on one device).
"""

import json
import math
import os
import sys

import _procs
import pytest
from _procs import REPO
from _procs import clean_env

CHILD = os.path.join(REPO, "tests", "scenarios", "model_parallel_vs_one_device.py")
LOSS_RTOL = 1e-4
ADAM_ATOL = 1e-4
TIMEOUT_S = 240


# Scenario -> the scenario whose output it reads (its directory is passed as the third argument).
SCENARIOS = {"hybrid": None, "reshard": "hybrid", "subclassed": None, "data_and_conv": None, "unsafe_env": None,
             "dtensor_loop": None, "unmatched_rules": None}
SCENARIO_ENV = {"unsafe_env": {"DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION": "1"}}


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    """Every scenario queued (`_procs.Queue`, each killed `TIMEOUT_S` after it starts); scenario -> its directory."""
    queue = _procs.Queue(tmp_path_factory.mktemp("scenario_logs"), parallel=2, timeout=TIMEOUT_S)
    dirs = {name: tmp_path_factory.mktemp(name) for name in SCENARIOS}
    for name, needs in SCENARIOS.items():
        args = [sys.executable, CHILD, name, str(dirs[name]), *([str(dirs[needs])] if needs else [])]
        queue.add(name, args, clean_env(TF_CPP_MIN_LOG_LEVEL="3", **SCENARIO_ENV.get(name, {})), after=needs)
    yield queue, dirs
    queue.kill_all()


def run_scenario(scenarios, name):
    queue, dirs = scenarios
    code, output = queue.result(name)
    status = f"killed after {TIMEOUT_S}s" if code is None else f"exit status {code}"
    assert code == 0, f"scenario {name!r} failed ({status}):\n{output[-9000:]}"
    with open(os.path.join(dirs[name], "result.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def hybrid(scenarios):
    return scenarios[1]["hybrid"], run_scenario(scenarios, "hybrid")


def test_transformer_block_on_2x4_mesh_matches_one_device(hybrid):
    _, r = hybrid
    # Adam, 2 epochs of 4 steps, numpy input with validation_data.
    assert r["fit_loss_rel"] < LOSS_RTOL
    assert r["fit_val_loss_rel"] < LOSS_RTOL
    assert r["fit_accuracy_rel"] < LOSS_RTOL
    assert r["fit_weights_diff"] < ADAM_ATOL
    assert r["evaluate_diff"] < 1e-5
    assert r["predict_diff"] < 1e-4
    # tf.data that reshuffles every pass: Keras' own symbolic build would start an extra pass.
    assert r["reshuffled_weights_diff"] < ADAM_ATOL


def test_tensorflow_imported_first_still_gets_the_safe_dtensor_setting(hybrid):
    # The child imported TensorFlow before tfdist with the variable unset; the Adam numbers above
    # prove the setting took effect (the unsafe_env scenario shows what they look like otherwise).
    assert hybrid[1]["env_after_construction"] == "0"


def test_attention_and_ffn_kernels_hold_exactly_a_quarter_per_device(hybrid):
    placements = hybrid[1]["placements"]
    quarter = {
        "token_embedding/embeddings": ["model", None],
        "attention/query/kernel": [None, "model", None],
        "attention/key/kernel": [None, "model", None],
        "attention/value/kernel": [None, "model", None],
        "attention/attention_output/kernel": ["model", None, None],
        "mlp_in/kernel": [None, "model"],
        "mlp_out/kernel": ["model", None],
        "logits/kernel": [None, "model"],
    }
    for path, spec in quarter.items():
        got_spec, total, per_device = placements[path]
        assert got_spec == spec, path
        assert per_device * 4 == total, path
    for path in ("attention_norm/gamma", "mlp_out/bias", "attention/attention_output/bias"):
        spec, total, per_device = placements[path]
        assert set(spec) == {None} and per_device == total, path
    # The real shards: mlp_in/kernel (32, 64) split on its output dimension over 4 devices.
    assert hybrid[1]["mlp_in_shard_shapes"] == [[32, 16]] * 8


def test_optimizer_slots_follow_their_variable_and_scalars_are_replicated(hybrid):
    r = hybrid[1]
    slots = r["slot_layouts"]
    placements = r["placements"]
    assert slots["adam/iteration"] == "[]" and slots["adam/learning_rate"] == "[]"
    for moment in ("momentum", "velocity"):
        assert slots[f"adam/mlp_in_kernel_{moment}"] == "['unsharded', 'model']"
        assert slots[f"adam/attention_query_kernel_{moment}"] == "['unsharded', 'model', 'unsharded']"
        assert slots[f"adam/mlp_norm_gamma_{moment}"] == "['unsharded']"
        assert placements[f"adam/mlp_out_kernel_{moment}"][0] == ["model", None]


def test_placement_report_totals_and_table(hybrid):
    r = hybrid[1]
    per_device = sum(entry[2] for entry in r["placements"].values())
    assert r["bytes_per_device"] == [per_device] * 8
    assert r["bytes_total"] == sum(entry[1] for entry in r["placements"].values())
    # Sharded parameters and Adam state: each device holds well under the replicated total.
    assert per_device < 0.3 * r["bytes_total"]
    assert r["unmatched"] == []
    table = r["table"]
    assert table.splitlines()[0].split() == ["path", "shape", "layout", "bytes", "total", "bytes/device"]
    assert "mlp_in/kernel" in table and "(-, model)" in table
    assert f"{per_device:,} bytes on each of 8 devices" in table


def test_get_set_weights_and_on_batch_methods_with_numpy(hybrid):
    r = hybrid[1]
    assert r["set_weights_diff"] == 0.0
    assert r["set_weights_evaluate_diff"] < 1e-5
    assert math.isclose(r["next_losses"][0], r["ref_next_losses"][0], rel_tol=LOSS_RTOL)
    assert math.isclose(r["test_on_batch"], r["ref_test_on_batch"], rel_tol=LOSS_RTOL)
    assert r["predict_on_batch_diff"] < 1e-4


def test_checkpoints_saved_on_2x4_restore_onto_4x2_1x8_and_one_device(hybrid, scenarios):
    _, saved = hybrid
    r = run_scenario(scenarios, "reshard")
    for target, mesh in (("4x2", [4, 2]), ("1x8", [1, 8]), ("one_device", None)):
        for fmt in ("keras", "weights_h5", "checkpoint"):
            key = f"{target}_{fmt}"
            count, expected = r[f"{key}_state_count"]
            assert count == expected == saved["num_weights"] + 40, key  # weights + Adam's 2 + 2 * 19 slots
            assert r[f"{key}_state_diff"] == 0.0, key
            for loss, ref in zip(r[f"{key}_next_losses"], saved["next_losses"]):
                assert math.isclose(loss, ref, rel_tol=LOSS_RTOL), (key, loss, ref)
            if mesh is not None:
                assert r[f"{key}_mesh_shape"] == mesh, key
                assert r[f"{key}_mlp_in_layout"] == ["unsharded", "model"], key


@pytest.fixture(scope="module")
def subclassed(scenarios):
    return run_scenario(scenarios, "subclassed")


def test_subclassed_model_on_model_only_mesh_with_tf_data(subclassed):
    r = subclassed
    assert r["batch_axis"] is None  # {"model": 8}: every device sees the whole batch
    assert r["fit_loss_rel"] < LOSS_RTOL
    assert r["fit_val_loss_rel"] < LOSS_RTOL
    assert r["fit_weights_diff"] < ADAM_ATOL
    # Every rule that should match a variable created after its name scope was gone did.
    placements = r["placements"]
    assert placements["sub/mlp_in/kernel"][0] == [None, "model"]
    assert placements["sub/attention/query/kernel"][0] == [None, "model", None]
    assert placements["sub/token_embedding/embeddings"][0] == ["model", None]
    assert placements["sub/logits/bias"][0] == ["model"]
    assert placements["sub/mlp_in/kernel"][2] * 8 == placements["sub/mlp_in/kernel"][1]
    assert r["unmatched"] == [] and r["misplaced"] == []
    # Without tfdist's variable-path hook every sharded variable would be missed: the report says so.
    assert "sub/mlp_in/kernel" in r["late_misplaced"]
    assert len(r["late_misplaced"]) == 13  # every variable a rule shards
    assert any("'sub/mlp_in/kernel' has layout (None, None) but the rules give" in p for p in r["late_problems"])
    assert len(r["late_warnings"]) == 1 and "'sub/mlp_in/kernel' has layout" in r["late_warnings"][0]


def test_transformer_preset_covers_tfdist_models_transformer_lm(subclassed):
    r = subclassed
    assert math.isfinite(r["lm_loss"])
    assert r["lm_problems"] == []  # every rule matched, every variable placed as its rule says
    lm = r["lm_placements"]
    assert lm["block_0/mlp_in/kernel"] == [None, "model"]
    assert lm["block_0/mlp_out/kernel"] == ["model", None]
    assert lm["block_0/attention/attention_output/kernel"] == ["model", None, None]
    assert lm["token_embedding/embeddings"] == ["model", None]
    assert lm["position_embedding/embeddings"] == [None, None]
    assert lm["logits/kernel"] == [None, "model"]


def test_batch_only_mesh_and_conv_preset_match_one_device(scenarios):
    r = run_scenario(scenarios, "data_and_conv")
    for name in ("batch_only", "conv"):
        assert r[f"{name}_loss_rel"] < LOSS_RTOL, name
        assert r[f"{name}_weights_diff"] < ADAM_ATOL, name
    assert all(set(entry[0]) <= {None} for entry in r["batch_only_placements"].values())
    conv = {path: entry for path, entry in r["conv_placements"].items() if "conv2d" in path}
    assert len(conv) == 12  # 2 kernels, 2 biases, and Adam's 2 slots of each
    for path, (spec, total, per_device) in conv.items():
        assert spec[-1] == "model" and set(spec[:-1]) <= {None}, path
        assert per_device * 4 == total, path
    assert r["uneven_weights_diff"] < ADAM_ATOL  # a batch of 9 over the batch axis of 2, as on one device
    # shard_value: every device's shard is its slice of the host value, over one axis, both, or two dimensions.
    assert r["shard_value_exact"] == dict.fromkeys(r["shard_value_exact"], True) and len(r["shard_value_exact"]) == 4
    assert r["shard_value_uneven"] == (
        "shard_value: dimension 0 (size 6) of a value of shape (6, 12, 4) is not divisible by mesh axis 'model' (4). "
        "Expected a size divisible by 4, or a layout that keeps dimension 0 whole."
    )


def test_all_reduce_combining_is_refused_and_would_corrupt_adam(scenarios):
    r = run_scenario(scenarios, "unsafe_env")  # DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION=1
    assert "refuses to run" in r["refused"]
    # What the guard prevents. If these start passing the tolerances, TensorFlow fixed the pass.
    assert r["unsafe_weights_diff"] > 10 * ADAM_ATOL
    assert r["unsafe_loss_rel"] > 10 * LOSS_RTOL


# ------------------------------------------------------------------ custom loops without strategy.run
# The dtensor_keras tutorial's loop (tf.GradientTape, optimizer.apply_gradients) on a 2x4 mesh, against
# the same loop on one device without a strategy. A small MLP over 5 Adam steps: losses and weights
# agree to 1e-5 (measured: weights within 3e-8).
LOOP_TOL = 1e-5


@pytest.fixture(scope="module")
def dtensor_loop(scenarios):
    return run_scenario(scenarios, "dtensor_loop")


LOOP_CASES = [
    ("sequential", "inside"),
    ("sequential", "outside"),
    ("subclassed", "inside"),
    ("subclassed", "outside"),
    ("subclassed", "eager"),
]


@pytest.mark.parametrize("kind,where", LOOP_CASES)
def test_dtensor_style_loop_without_run_trains_as_on_one_device(dtensor_loop, kind, where):
    r = dtensor_loop
    key = f"{kind}_{where}"
    losses, ref_losses = r[f"{key}_losses"], r[f"{kind}_ref_losses"]
    assert len(losses) == len(ref_losses) == 5
    for loss, ref in zip(losses, ref_losses):
        assert math.isclose(loss, ref, rel_tol=LOOP_TOL), (key, losses, ref_losses)
    assert r[f"{key}_num_weights"] == r[f"{kind}_num_weights"] == 4
    assert r[f"{key}_weights_diff"] < LOOP_TOL
    assert r[f"{key}_warnings"] == []  # every rule matched a weight


@pytest.mark.parametrize("kind,where", LOOP_CASES)
def test_dtensor_style_loop_variables_and_slots_are_sharded(dtensor_loop, kind, where):
    # Including the subclassed model first called outside the scope: its variables are still split.
    r = dtensor_loop
    key = f"{kind}_{where}"
    assert r[f"{key}_kernel_layout"] == ["unsharded", "model"]
    assert r[f"{key}_kernel_shards"] == [[12, 4]] * 8  # dense_in/kernel (12, 16): a quarter on each device
    slots = r[f"{key}_slot_layouts"]
    assert slots["dense_in_kernel_momentum"] == slots["dense_in_kernel_velocity"] == ["unsharded", "model"]
    assert slots["dense_in_bias_momentum"] == ["model"]
    assert slots["dense_out_kernel_velocity"] == ["model", "unsharded"]
    assert slots["dense_out_bias_velocity"] == ["unsharded"]


def test_eager_call_on_numpy_outside_the_scope_builds_sharded_and_reads_on_the_host(dtensor_loop):
    r = dtensor_loop
    assert r["subclassed_eager_first_call_diff"] < 1e-6
    assert r["subclassed_eager_first_call_layout"] == ["unsharded", "unsharded"]  # replicated: host-readable


# ------------------------------------------------------------------ rules that match nothing
@pytest.fixture(scope="module")
def unmatched(scenarios):
    return run_scenario(scenarios, "unmatched_rules")


def test_a_rule_that_matches_nothing_warns_once_at_fit_naming_it_and_near_paths(unmatched):
    r = unmatched
    assert r["fit_built_before"] is False  # subclassed: built by fit
    assert len(r["fit_warnings"]) == 1  # 2 epochs of 5 steps
    message = r["fit_warnings"][0]
    assert "rule 'feature.*kernel' -> (None, 'model') matched no variable" in message
    assert "similar paths: tutorial_subclassed/dense_in/kernel" in message
    assert "dense_in/kernel$" not in message  # the rule that matched is not named
    assert r["after_evaluate_predict_warnings"] == r["fit_warnings"]  # no second warning


def test_a_rule_that_matches_nothing_warns_once_in_a_custom_loop(unmatched):
    warnings_ = unmatched["loop_warnings"]
    assert len(warnings_) == 1  # 3 steps
    assert "'tutorial_subclassed_1'" in warnings_[0] and "'feature.*kernel'" in warnings_[0]


def test_a_model_inside_another_is_checked_with_the_outer_model(unmatched):
    # "head/kernel$" matches the outer model's weight only: no warning for the inner model.
    assert unmatched["nested_warnings"] == []
    assert unmatched["nested_head_layout"] == ["model", "unsharded"]


# ------------------------------------------------------------------ log noise
QUIET_STEPS = """
import os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"  # errors still show
import tfdist
tfdist.simulate_devices(8)
import keras, numpy as np
strategy = tfdist.ModelParallelStrategy(mesh={"batch": 2, "model": 4}, rules=tfdist.layouts.transformer())
with strategy.scope():
    model = tfdist.models.transformer_lm(seq_len=16, d_model=32, num_heads=4, num_layers=1)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = np.random.default_rng(0).integers(0, 256, (32, 16)).astype("int32")
model.fit(x, np.roll(x, -1, 1), batch_size=16, validation_data=(x, np.roll(x, -1, 1)), verbose=0)
model.predict(x, batch_size=16, verbose=0)
print("DONE")
"""


def test_steps_log_no_cost_estimate_errors(python_subprocess):
    # Grappler's memory optimizer logs 3 "op_level_cost_estimator ... Incompatible Matrix dimensions" errors per
    # device and traced step on SPMD-expanded graphs; the strategy runs Keras' steps without that pass.
    result = python_subprocess(QUIET_STEPS, timeout=300)
    assert result.returncode == 0 and "DONE" in result.stdout, result.stderr[-3000:]
    assert "op_level_cost_estimator" not in result.stderr, result.stderr[-3000:]
