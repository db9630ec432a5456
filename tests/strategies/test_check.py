"""tfdist.check: equal on the five correct strategies, the right step and variable for five injected faults.

One child process of 8 logical CPUs (tests/scenarios/check_strategies_and_faults.py) runs every check and
`tfdist-check`'s main; the tests read its reports. A tiny transformer_lm trains with SGD (momentum 0.9), so the
tolerance is 1e-5 of each variable's largest entry: the correct strategies agree to about 5e-7, the faults are off
by 1e-2 or more.
"""

import sys

import _procs
import keras
import numpy as np
import pytest

import tfdist

CORRECT = ("data_parallel", "model_parallel", "zero3", "zero1", "pipeline")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("check")
    return _procs.run_child(f"{_procs.REPO}/tests/scenarios/check_strategies_and_faults.py", out, timeout=400)


@pytest.mark.parametrize("name", CORRECT)
def test_correct_strategies_are_equal_within_tolerance(reports, name):
    report = reports[name]
    assert report["equal"], report["text"]
    assert report["steps"] == 3 and report["tolerance"]["value_rtol"] == 1e-5
    assert max(report["largest"].values()) < 2e-6, report["text"]  # float32 rounding, far below the tolerance
    assert "EQUAL within tolerance" in report["text"]


def _first(report):
    return report["step"], report["kind"], report["variable"]


def test_a_gradient_scaled_by_1_01_is_named_at_step_1(reports):
    report = reports["fault_scaled_gradient"]  # ModelParallelStrategy, one layer's gradient x 1.01 before apply
    assert _first(report) == (1, "gradient", "block_0/mlp_out/kernel"), report["text"]
    assert {b[2] for b in report["beyond"] if b[0] == 1} == {"block_0/mlp_out/kernel"}
    assert not report["loss_differs"]
    assert "DIFFERENT from step 1: the gradient of block_0/mlp_out/kernel is" in report["text"]


def test_a_skipped_all_reduce_is_named_at_step_1(reports):
    report = reports["fault_skipped_all_reduce"]  # DataParallelStrategy, one variable's gradient stays per replica
    assert _first(report) == (1, "gradient", "block_0/mlp_in/kernel"), report["text"]
    assert {b[2] for b in report["beyond"] if b[0] == 1} == {"block_0/mlp_in/kernel"}


def test_a_stale_copy_is_named_with_its_device(reports):
    report = reports["fault_stale_copy"]  # DataParallelStrategy, CPU:1's copy of one variable never updated
    assert _first(report) == (1, "value", "block_0/mlp_in/bias"), report["text"]
    assert report["device"].endswith("CPU:1")
    assert [b for b in report["beyond"] if b[0] == 1] == [[1, "value", "block_0/mlp_in/bias"]]
    assert "Its gradient agreed at this step" in report["text"]


def test_a_batch_dependent_loss_is_named_at_step_1(reports):
    report = reports["fault_batch_loss"]  # DataParallelStrategy, an add_loss from each replica's batch mean
    assert report["loss_differs"] and report["step"] == 1, report["text"]
    # The loss term is computed from the logits. Their bias's gradient is linear in each replica's batch mean, so
    # the replicas' weighted sum is still one device's; the kernel's is not: the backward pass's first to differ.
    assert (report["kind"], report["variable"]) == ("gradient", "logits/kernel")
    assert "logits/bias" not in {b[2] for b in report["beyond"] if b[0] == 1}


def test_a_wrong_mesh_axis_changes_placement_not_numbers(reports):
    # mlp_in split on its input and mlp_out on its output dimension (the transpose of Megatron's split): DTensor
    # inserts other collectives and computes the same numbers, so the check says equal (a placement choice, which
    # costs communication, not a fault of what is learned).
    report = reports["fault_wrong_axis"]
    assert report["equal"], report["text"]
    assert max(report["largest"].values()) < 2e-6


def test_binary_runs_the_check_under_the_flags_strategy(reports):
    binary = reports["binary"]
    assert binary["status"] == 0, binary["stdout"]
    assert "PipelineStrategy(stages=2, microbatches=2" in binary["stdout"]
    assert "tolerance: |a - b| <= 1e-07 + rtol * scale" in binary["stdout"]
    assert "EQUAL within tolerance: 1 step(s)" in binary["stdout"]


def _model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="dense")])
    model.compile(optimizer="sgd", loss="mse")
    return model


DATA = (np.ones((8, 3), "float32"), np.ones((8, 1), "float32"))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"steps": 0}, ValueError, r"argument `steps`. Received: steps=0"),
        ({"strategy": "data"}, ValueError, r"argument `strategy`. Received: strategy='data'. Expected a tf.distribute"),
        ({"data": [1, 2]}, TypeError, r"Invalid `data`: list. Expected a tf.data.Dataset"),
        ({"batch_size": 4, "steps": 3}, ValueError, r"`data` has 8 examples; steps=3 batches of batch_size=4 need 12"),
        ({"rtol": -1.0}, ValueError, r"argument `rtol`. Received: rtol=-1.0. Expected a finite number >= 0"),
        ({"build_model": lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])}, ValueError,
         r"uncompiled model .* call model.compile"),
        ({"build_model": lambda: 3}, ValueError, r"build_model\(\) returned 3 \(with no strategy\)"),
    ],
)
def test_bad_input_is_named(kwargs, error, match):
    args = {"build_model": _model, "data": DATA, "strategy": tfdist.DataParallelStrategy(devices=["CPU:0"]),
            "batch_size": 4, "steps": 2, **kwargs}
    with pytest.raises(error, match=match):
        tfdist.check(args.pop("build_model"), args.pop("data"), args.pop("strategy"), **args)


def test_a_call_inside_a_strategy_scope_is_refused():
    strategy = tfdist.DataParallelStrategy(devices=["CPU:0"])
    with strategy.scope(), pytest.raises(ValueError, match=r"inside the scope of DataParallelStrategy"):
        tfdist.check(_model, DATA, strategy, batch_size=4)


def test_binary_refuses_training_only_flags_and_bad_tolerances():
    for flag, message in [
        ("--epochs=2", "tfdist-check: error: --epochs: tfdist-train flags that tfdist-check does not read"),
        ("--rtol=-1", "tfdist-check: error: flag --rtol=-1.0: expected a finite number >= 0"),
    ]:
        result = _procs.run([sys.executable, "-m", "tfdist.check_main", flag], timeout=60)
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines()[-1].startswith(message), result.stderr
    helpshort = _procs.run([sys.executable, "-m", "tfdist.check_main", "--helpshort"], timeout=60).stdout
    assert "--mesh" in helpshort and "--rtol" in helpshort and "--epochs" not in helpshort
