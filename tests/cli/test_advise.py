"""tfdist.advise: the right recommendation for a tiny, a wide, a large and a sharded model.

The predicted speed-up against `model.fit` timed side by side is measured by `python -m benchmarks.advise`
(benchmarks/RESULTS.md), not asserted here: timings belong to benchmarks.
"""

import dataclasses
import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist import advice as advice_lib
from tfdist import advisor

GiB = 2**30


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
    assert "Recommendation: one device" in report and "not worth distributing" in report
    # The report names the cause it measured: communication when the all-reduce took at least as long as
    # the parallel compute (on a loaded host the compute share can grow past it; the rule itself is
    # checked on fixed measurements in test_recommend_data_parallel_or_one_device_when_the_model_fits).
    dominated = advice.all_reduce_time >= advice.parallel_compute_time
    assert ("communication would dominate" in report) == dominated, report
    for a, b in zip(before, model.get_weights()):  # the user's model is left alone
        np.testing.assert_array_equal(a, b)


def test_wide_model_advice_is_the_rule_applied_to_what_it_measured():
    """The report a user reads is `advice.recommend` of the measurements advise() took, whatever the timings.

    Whether the predicted speed-up matches a timed `fit` is a benchmark (`python -m benchmarks.advise`,
    benchmarks/RESULTS.md): on a shared 2-core host a slow spell can outlast one advise() call.
    """
    devices = ["CPU:0", "CPU:1"]
    measured = tfdist.advise(mlp(512, 2), batch(4096, 512), devices=devices, rounds=2, min_speedup=1.0)
    fields = {f.name: getattr(measured, f.name) for f in dataclasses.fields(advice_lib.Measurements)}
    times = {k: v for k, v in fields.items() if k.endswith("_time")}
    assert all(v > 0 for k, v in times.items() if k != "overhead_time") and times["overhead_time"] >= 0, times
    assert times["step_time"] >= times["compute_time"], times
    rule = advice_lib.recommend(advice_lib.Measurements(**fields), min_speedup=1.0)
    assert (measured.recommendation, measured.mesh) == (rule.recommendation, rule.mesh)
    assert measured.predicted_speedup == pytest.approx(rule.predicted_speedup, rel=1e-12)
    assert f"Recommendation: {rule.recommendation}" in str(measured)


def test_weights_that_do_not_fit_one_device_get_a_model_axis():
    devices = [f"CPU:{i}" for i in range(4)]
    # 30 x 30 kernels: 900 elements, fewer than ShardedDataParallelStrategy's min_size (1,024), so sharded data
    # parallelism would keep every weight whole; 3 layers are too few for 2 pipeline stages of 2.
    model = mlp(30, 2, optimizer="adam")
    data = batch(8, 30)
    base = tfdist.advise(model, data, devices=devices, rounds=1)
    state, act = base.parameter_bytes + base.optimizer_bytes, base.activation_bytes
    assert state == (2 * (30 * 30 + 30) + 30 * 10 + 10) * 4 * 3  # weights + Adam's two moments
    assert 0 < act < state / 2
    assert (base.unsharded_parameter_bytes, base.unsharded_optimizer_bytes) == (
        base.parameter_bytes, base.optimizer_bytes
    )

    def per_device(m):  # a (4/m) x m mesh: weights split m ways, the batch 4/m ways
        return state / m + act / (4 // m)

    memory = int(per_device(2) / advisor.MEMORY_HEADROOM) + 1  # fits a model axis of 2, not 1
    hybrid = advice_lib.recommend(dataclasses.replace(base, device_memory=memory))
    assert hybrid.recommendation == "hybrid" and hybrid.mesh == {"batch": 2, "model": 2}
    assert hybrid.reasons[0].startswith("sharded data parallelism does not fit: even ZeRO-3 (shard='weights') keeps")
    memory = int((per_device(4) + per_device(2)) / 2 / advisor.MEMORY_HEADROOM)  # needs all 4
    sharded = tfdist.advise(model, data, devices=devices, rounds=1, device_memory=memory)
    assert sharded.recommendation == "model parallel" and sharded.mesh == {"batch": 1, "model": 4}
    assert "ModelParallelStrategy(mesh={'batch': 1, 'model': 4}" in str(sharded)


SHARDED = """
import dataclasses, json
import tfdist
tfdist.simulate_devices(4)
from tfdist import advice, advisor
from tests.cli.test_advise import batch, mlp

devices = [f"CPU:{i}" for i in range(4)]
base = tfdist.advise(mlp(64, 2, optimizer="adam"), batch(8, 64), devices=devices, rounds=1)
share = base.activation_bytes / 4
out = {"measured": {f.name: getattr(base, f.name) for f in dataclasses.fields(advice.Measurements)
                    if f.name.endswith("bytes")}}
for shard in ("optimizer", "weights"):
    strategy = tfdist.ShardedDataParallelStrategy(shard=shard, devices=devices)
    with strategy.scope():
        model = mlp(64, 2, optimizer="adam")
        model.optimizer.build(model.trainable_variables)
    report = strategy.placement_report(model, print_fn=None)
    # A device just large enough for this mode's state + 1/4 of the activations, and one 2 bytes smaller
    fits = int((base.sharded_bytes(shard) + share) / advisor.MEMORY_HEADROOM) + 1
    got = {}
    for name, memory in (("fits", fits), ("short", fits - 2)):
        r = advice.recommend(dataclasses.replace(base, device_memory=memory))
        got[name] = {"strategy": r.strategy, "shard": r.shard, "bytes_per_device": r.bytes_per_device,
                     "mesh": r.mesh, "reasons": list(r.reasons)}
    out[shard] = {"report": sorted(set(report.bytes_per_device.values())),
                  "scalars": sum(v.bytes_per_device for v in report.variables if not v.shape), **got}
print(json.dumps(out))
"""


def test_sharded_data_parallel_for_state_that_does_not_fit_one_device_as_placement_report_counts(python_subprocess):
    """The advisor's bytes per device under each shard mode are what ShardedDataParallelStrategy really holds."""
    proc = python_subprocess(SHARDED, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    measured = out["measured"]
    weights = (2 * (64 * 64 + 64) + 64 * 10 + 10) * 4
    # Whole on each device: the biases (64 and 10 elements) and the 64 x 10 kernel, fewer than min_size
    # (1,024) elements, and their Adam moments; the 64 x 64 kernels and theirs split 4 ways.
    whole = (2 * 64 + 64 * 10 + 10) * 4
    assert (measured["parameter_bytes"], measured["optimizer_bytes"]) == (weights, 2 * weights)
    assert (measured["unsharded_parameter_bytes"], measured["unsharded_optimizer_bytes"]) == (whole, 2 * whole)
    predicted = {
        "optimizer": weights + 2 * whole + 2 * (weights - whole) // 4,  # ZeRO-1: 4 + 8/N bytes per split parameter
        "weights": 3 * whole + 3 * (weights - whole) // 4,  # ZeRO-3: 12/N
    }
    assert predicted == {"optimizer": 58_488, "weights": 33_912}
    for shard in ("optimizer", "weights"):
        fits, short = out[shard]["fits"], out[shard]["short"]
        assert (fits["strategy"], fits["shard"], fits["mesh"]) == (
            "ShardedDataParallelStrategy", shard, {"batch": 4}
        ), fits
        assert fits["bytes_per_device"] == predicted[shard]
        # placement_report counts also the optimizer's scalars (its iteration and learning rate: 12 bytes),
        # which the advisor leaves out of the optimizer's bytes.
        assert out[shard]["report"] == [predicted[shard] + out[shard]["scalars"]] and out[shard]["scalars"] == 12
        # 2 bytes less: ZeRO-1 gives way to ZeRO-3, and ZeRO-3 to splitting the model
        assert short["shard"] == ("weights" if shard == "optimizer" else None), short
    assert out["weights"]["short"]["strategy"] == "ModelParallelStrategy"
    assert out["weights"]["short"]["reasons"][0].startswith("sharded data parallelism does not fit")


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
    # 86.8 KiB per device: the 105.1 KiB of weights and Adam moments do not fit, ZeRO-1's 57.1 KiB do (the test
    # above counts them for this model and batch).
    proc = python_subprocess(
        "import sys; from tfdist import advisor; "
        "sys.exit(advisor.run(['--width=64', '--depth=2', '--batch_size=8', '--num_devices=4', '--rounds=1', "
        "'--device_memory_gib=0.0000828']))",
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Recommendation: data parallel with tfdist.ShardedDataParallelStrategy, mesh {'batch': 4}, " \
        "shard='optimizer': 57.12 KiB per device" in proc.stdout, proc.stdout
    assert "  - use tfdist.ShardedDataParallelStrategy(shard='optimizer')" in proc.stdout
    bad = python_subprocess("from tfdist import advisor; advisor.run(['--batch_size=0'])", timeout=60)
    assert bad.returncode == 2 and "--batch_size: 0 is not a positive integer" in bad.stderr


def test_every_optimizer_choice_of_the_binary_is_a_keras_optimizer():
    for name in advisor.OPTIMIZERS:
        assert isinstance(keras.optimizers.get(name), keras.optimizers.Optimizer), name


def test_recommendations_are_the_documented_ones():
    from tfdist import flags
    from tfdist.strategies.model_parallel import auto_shard

    assert advisor.RECOMMENDATIONS == ("one device", "data parallel", "model parallel", "hybrid")
    # The shard modes advice recommends and tfdist-train's --shard accepts are the strategy's.
    assert sorted(advice_lib.SHARD_MODES) == sorted(flags.SHARDS) == sorted(auto_shard.MODES)
    assert set(advice_lib.STRATEGIES) <= set(tfdist.__all__)


# ------------------------------------------------------------------ recommend(): the rules, without TensorFlow
RULES = """
import json, sys
from tfdist.advice import Measurements, recommend

GiB = 2**30


def measured(n=4, *, layers=(), parameters=None, optimizer=0.0, activations=1.0, memory=None, batch=64,
             step=0.040, compute=0.032, parallel=0.0085, all_reduce=0.001, overhead=0.0005, whole=(0.0, 0.0)):
    # whole: GiB of the weights and of the optimizer slots that sharded data parallelism keeps whole;
    # "all": every one (each has fewer than min_size elements or no dimension the device count divides).
    parameters = sum(layers) if parameters is None else parameters
    whole = (parameters, optimizer) if whole == "all" else whole
    return Measurements(
        devices=tuple(f"GPU:{i}" for i in range(n)), batch_size=batch, step_time=step, compute_time=compute,
        parallel_compute_time=parallel, gradient_bytes=int(parameters * GiB), all_reduce_time=all_reduce,
        overhead_time=overhead, parameter_bytes=int(parameters * GiB), optimizer_bytes=int(optimizer * GiB),
        activation_bytes=int(activations * GiB), device_memory=None if memory is None else int(memory * GiB),
        layer_bytes=tuple(int(b * GiB) for b in layers), unsharded_parameter_bytes=int(whole[0] * GiB),
        unsharded_optimizer_bytes=int(whole[1] * GiB))


def usable(gib):  # a device whose usable share (MEMORY_HEADROOM) is `gib`
    return gib / 0.9


CASES = {
    # fits one device; 4 devices compute 3.76x faster and the all-reduce is small
    "fast": measured(layers=(0.1,), memory=16),
    # fits one device; the all-reduce costs more than the whole step
    "communication": measured(layers=(0.001,), step=0.001, compute=0.0008, parallel=0.0003, all_reduce=0.002),
    # state 1 GiB + activations 8 GiB > 3.6 usable, but 1 + 8/4 fits
    "fit_by_data": measured(layers=(0.5, 0.5), activations=8, memory=4),
    # 2 GiB of float32 weights (2**29 parameters) with Adam's 4 GiB of moments, 1 GiB of activations, 4 devices:
    # data parallel needs 6 + 1/4 GiB; ZeRO-1 2 + 4/4 (4 + 8/4 bytes per parameter) + 1/4; ZeRO-3 6/4 + 1/4
    "zero1": measured(parameters=2, optimizer=4, memory=usable(3.5)),
    "zero3": measured(parameters=2, optimizer=4, memory=usable(2.5)),
    "zero_none": measured(parameters=2, optimizer=4, memory=usable(1.5)),  # 1.5 + 1/4 does not fit
    # 8 devices, and 0.5 GiB of weights (with their 1 GiB of slots) kept whole: ZeRO-1 2 + 1 + 3/8 + 1/8
    "zero1_whole": measured(8, parameters=2, optimizer=4, memory=usable(3.6), whole=(0.5, 1)),
    # ZeRO-3: 0.5 + 1 + 4.5/8 + 1/8 (ZeRO-1's 3.5 do not fit 3)
    "zero3_whole": measured(8, parameters=2, optimizer=4, memory=usable(3), whole=(0.5, 1)),
    # deep_stack's model below, its weights split by the data axis: 8/4 + 1/4, no stages needed
    "deep_stack_sharded": measured(layers=(0.5,) * 16, activations=1, memory=usable(4.6)),
    # The model-splitting rules: in each case below sharded data parallelism keeps every weight whole.
    # 16 equal layers, 8 GiB: 2 stages of 4 GiB + 1/4 of the activations fit 4.6 GiB; a model axis needs 2 too
    "deep_stack": measured(layers=(0.5,) * 16, activations=1, memory=usable(4.6), whole="all"),
    # the same with Adam's two moments (state 3x the weights) on 8 devices
    "deep_stack_adam": measured(8, layers=(0.25,) * 16, optimizer=8, activations=1, memory=usable(3.5),
                                whole="all"),
    # one 6 GiB layer and three small ones: no balanced stages, so a model axis
    "unbalanced": measured(layers=(6, 0.5, 0.5, 0.5), activations=1, memory=usable(4.6), whole="all"),
    # 3 layers: too shallow for 2 stages of 2 layers
    "shallow": measured(layers=(3, 3, 2), activations=1, memory=usable(4.6), whole="all"),
    # big activations: no model axis fits (6/2 + 8/2 > 5.4, 6/4 + 8 > 5.4), 2 stages do (3 + 8/4)
    "activations": measured(layers=(0.5,) * 12, activations=8, memory=usable(5.4), whole="all"),
    # 2 stages would not fit (5.5 + 0.25 > 5.6), 4 would, but a model axis of 2 fits (5 + 0.5): that one
    "model_axis_smaller": measured(layers=(1.5,) * 4 + (1,) * 4, activations=1, memory=usable(5.6), whole="all"),
    # 16 GiB needs 4 stages, and a batch of 4 gives 4 micro-batches: a bubble of 3/7 (> 1/3), so a model axis
    "small_batch": measured(layers=(1,) * 16, activations=0.01, memory=usable(4.5), batch=4, whole="all"),
}
out = {}
for name, m in CASES.items():
    r = recommend(m)
    out[name] = {"recommendation": r.recommendation, "strategy": r.strategy, "mesh": r.mesh,
                 "microbatches": r.microbatches, "speedup": r.predicted_speedup, "reasons": list(r.reasons),
                 "shard": r.shard, "bytes_per_device": r.bytes_per_device,
                 "sharded_bytes": {s: m.sharded_bytes(s) for s in ("optimizer", "weights")}}
errors = {}
for name, kwargs in {"no_devices": {"n": 0}, "negative_time": {"all_reduce": -1.0}, "nan": {"step": float("nan")},
                     "batch": {"batch": 2}, "whole": {"parameters": 1, "whole": (2, 0)}}.items():
    try:
        measured(**kwargs)
    except ValueError as e:
        errors[name] = str(e)
for name, call in {"min_speedup": lambda: recommend(CASES["fast"], min_speedup=0),
                   "shard": lambda: CASES["zero1"].sharded_bytes("zero3")}.items():
    try:
        call()
    except ValueError as e:
        errors[name] = str(e)
print(json.dumps({"cases": out, "errors": errors, "tensorflow": "tensorflow" in sys.modules,
                  "keras": "keras" in sys.modules}))
"""


@pytest.fixture(scope="module")
def rules():
    from _procs import run_python  # (a local import: WIDE's subprocess imports this module as tests.cli.test_advise)

    proc = run_python(RULES, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_recommend_is_pure_python(rules):
    assert rules["tensorflow"] is False and rules["keras"] is False


def test_recommend_data_parallel_or_one_device_when_the_model_fits(rules):
    fast, slow = rules["cases"]["fast"], rules["cases"]["communication"]
    # predicted step 8.5 compute + 1 all-reduce + 8 x 4 / 3.76 updates + 0.5 overhead = 18.5 ms: 40 / 18.5
    assert fast["speedup"] == pytest.approx(0.040 / (0.0085 + 0.001 + 0.008 * 4 / (0.032 / 0.0085) + 0.0005))
    assert (fast["recommendation"], fast["strategy"], fast["mesh"]) == (
        "data parallel", "DataParallelStrategy", {"batch": 4}
    )
    assert (slow["recommendation"], slow["strategy"], slow["mesh"]) == ("one device", None, None)
    assert any("communication would dominate" in r for r in slow["reasons"])
    fit = rules["cases"]["fit_by_data"]
    assert (fit["recommendation"], fit["mesh"]) == ("data parallel", {"batch": 4})
    assert "1/4 of it does" in fit["reasons"][0]
    for case in (fast, slow, fit):  # the state fits one device: no sharding
        assert (case["shard"], case["bytes_per_device"]) == (None, None)
        assert not any("ZeRO" in r or "Sharded" in r for r in case["reasons"])


def test_recommend_sharded_data_parallel_when_the_state_does_not_fit_one_device(rules):
    cases, parameters = rules["cases"], 2**29  # 2 GiB of float32 weights, Adam's two float32 moments each
    zero1, zero3 = cases["zero1"], cases["zero3"]
    assert (zero1["recommendation"], zero1["strategy"], zero1["mesh"], zero1["shard"]) == (
        "data parallel", "ShardedDataParallelStrategy", {"batch": 4}, "optimizer"
    )
    assert zero1["bytes_per_device"] == parameters * (4 + 8 / 4) == 3 * GiB
    assert zero1["reasons"][-1] == "use tfdist.ShardedDataParallelStrategy(shard='optimizer')"
    assert "ZeRO-1 (shard='optimizer'): the weights whole (2.00 GiB) and 1/4 of the optimizer slots, 3.00 GiB" in (
        zero1["reasons"][1]
    )
    assert "no layout rules to write, and the same math as data parallel" in zero1["reasons"][2]
    assert (zero3["recommendation"], zero3["strategy"], zero3["mesh"], zero3["shard"]) == (
        "data parallel", "ShardedDataParallelStrategy", {"batch": 4}, "weights"
    )
    assert zero3["bytes_per_device"] == parameters * 12 / 4 == 1.5 * GiB
    assert "ZeRO-1 would keep 3.00 GiB per device" in zero3["reasons"][1]
    assert zero3["reasons"][-1] == "use tfdist.ShardedDataParallelStrategy(shard='weights')"
    for name in ("zero1", "zero3", "zero_none"):  # the formula: 4 + 8/N and 12/N bytes per parameter
        assert cases[name]["sharded_bytes"] == {"optimizer": parameters * 6, "weights": parameters * 3}, name
    # What the strategy keeps whole counts in full: 0.5 GiB of weights and their 1 GiB of slots, 8 devices.
    kept, whole = cases["zero1_whole"], cases["zero3_whole"]
    assert kept["sharded_bytes"] == {"optimizer": int((2 + 1 + 3 / 8) * GiB), "weights": int((1.5 + 4.5 / 8) * GiB)}
    assert (kept["shard"], kept["bytes_per_device"]) == ("optimizer", int((2 + 1 + 3 / 8) * GiB))
    assert (whole["shard"], whole["bytes_per_device"]) == ("weights", int((1.5 + 4.5 / 8) * GiB))
    assert "1.50 GiB of the state stays whole on every device" in whole["reasons"][1]
    # A model that split stages or a model axis would fit is sharded instead (less memory, no rules).
    assert (cases["deep_stack_sharded"]["strategy"], cases["deep_stack_sharded"]["shard"]) == (
        "ShardedDataParallelStrategy", "weights"
    )


def test_recommend_falls_back_to_splitting_the_model_when_not_even_zero3_fits(rules):
    none = rules["cases"]["zero_none"]
    assert (none["strategy"], none["shard"], none["bytes_per_device"]) == ("ModelParallelStrategy", None, None)
    assert none["reasons"][0] == (
        "sharded data parallelism does not fit: even ZeRO-3 (shard='weights') keeps 1.50 GiB per device + 1/4 of "
        "the activations (256.00 MiB) > 1.50 GiB usable"
    )
    assert "does not fit even split over 4 device(s)" in none["reasons"][1]
    deep = rules["cases"]["deep_stack"]  # everything kept whole: ZeRO-3 holds all 8 GiB
    assert deep["reasons"][0].startswith("sharded data parallelism does not fit: even ZeRO-3 (shard='weights') "
                                         "keeps 8.00 GiB per device")


def test_recommend_pipeline_for_a_deep_balanced_stack(rules):
    deep = rules["cases"]["deep_stack"]
    assert (deep["recommendation"], deep["strategy"], deep["mesh"], deep["microbatches"]) == (
        "hybrid", "PipelineStrategy", {"batch": 2, "stage": 2}, 8  # 32 examples per replica, 4 per stage
    )
    assert "tfdist.PipelineStrategy(stages=2, microbatches=8, replicas=2)" in deep["reasons"][-1]
    assert "bubble is 11%" in deep["reasons"][-2]  # (2 - 1) / (8 + 2 - 1)
    adam = rules["cases"]["deep_stack_adam"]  # 12 GiB of state: 4 stages of 3 GiB on 8 devices
    assert (adam["strategy"], adam["mesh"], adam["microbatches"]) == ("PipelineStrategy", {"batch": 2, "stage": 4}, 16)
    wide = rules["cases"]["activations"]  # no model axis fits at all
    assert (wide["recommendation"], wide["strategy"], wide["mesh"]) == (
        "hybrid", "PipelineStrategy", {"batch": 2, "stage": 2}
    )


def test_recommend_a_model_axis_when_stages_do_not_pay(rules):
    for name in ("unbalanced", "shallow", "model_axis_smaller"):
        case = rules["cases"][name]
        assert (case["recommendation"], case["strategy"], case["mesh"]) == (
            "hybrid", "ModelParallelStrategy", {"batch": 2, "model": 2}
        ), name
        assert "tfdist.ModelParallelStrategy(mesh={'batch': 2, 'model': 2}" in case["reasons"][-1], name
    small = rules["cases"]["small_batch"]
    assert (small["strategy"], small["mesh"]) == ("ModelParallelStrategy", {"batch": 1, "model": 4})


def test_bad_measurements_name_the_field(rules):
    errors = rules["errors"]
    assert "Measurements.devices" in errors["no_devices"]
    assert "all_reduce_time=-1.0" in errors["negative_time"]
    assert "step_time=nan" in errors["nan"]
    assert "2 example(s) cannot be split over 4 devices" in errors["batch"]
    assert "min_speedup=0" in errors["min_speedup"]
    assert "unsharded_parameter_bytes=2147483648, more than parameter_bytes=1073741824" in errors["whole"]
    assert "shard='zero3'. Expected one of ('optimizer', 'weights')" in errors["shard"]


def test_advice_holds_the_measurements_and_the_recommendation():
    from tfdist import advice

    names = {f.name for f in dataclasses.fields(advisor.Advice)}
    assert names == {f.name for f in dataclasses.fields(advice.Measurements)} | {
        f.name for f in dataclasses.fields(advice.Recommendation)
    }
    assert advisor.Advice is advice.Advice and advisor.RECOMMENDATIONS is advice.RECOMMENDATIONS


def test_a_deep_stack_that_does_not_fit_one_device_gets_pipeline_stages():
    devices = [f"CPU:{i}" for i in range(4)]
    model = mlp(30, 8, optimizer="adam")  # 30 x 30 kernels: below min_size, sharded data parallelism keeps them whole
    data = batch(8, 30)
    base = tfdist.advise(model, data, devices=devices, rounds=1)
    assert base.layer_bytes == (4 * (30 * 30 + 30),) * 8 + (4 * (30 * 10 + 10),)  # each Dense layer's weights
    state, act = base.parameter_bytes + base.optimizer_bytes, base.activation_bytes
    # 2 stages: layers 0-3 | 4-8, the heavier 4,030 of the 7,750 weights (52%) with its Adam moments.
    memory = int((0.55 * state + act / 4) / advisor.MEMORY_HEADROOM)
    piped = advice_lib.recommend(dataclasses.replace(base, device_memory=memory))
    assert (piped.recommendation, piped.strategy, piped.mesh, piped.microbatches) == (
        "hybrid", "PipelineStrategy", {"batch": 2, "stage": 2}, 4  # 4 examples per replica
    )
    assert "tfdist.PipelineStrategy(stages=2, microbatches=4, replicas=2)" in piped.reasons[-1]


def test_the_advisor_and_benchmarks_all_reduce_through_the_public_function():
    from _procs import REPO as root  # (a local import: WIDE's subprocess imports this module as tests.cli.test_advise)

    from tfdist.strategies import collectives

    for path in ["tfdist/advisor.py", *(f"benchmarks/{n}" for n in os.listdir(os.path.join(root, "benchmarks"))
                                         if n.endswith(".py"))]:
        with open(os.path.join(root, path)) as f:
            assert "extended._tfdist" not in f.read(), path
    strategy = tfdist.DataParallelStrategy(devices=["CPU:0", "CPU:1"])
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: [tf.fill([3], float(ctx.replica_id_in_sync_group + 1))]
    )
    summed = strategy.run(lambda g: collectives.all_reduce_gradients(strategy, g), args=(values,))
    for part in strategy.experimental_local_results(summed[0]):
        np.testing.assert_array_equal(part.numpy(), [3.0, 3.0, 3.0])  # 1 + 2 on every replica
    # Any other strategy: its replica context's all-reduce (here the default strategy's one replica).
    default = tf.distribute.get_strategy()
    alone = default.run(lambda: collectives.all_reduce_gradients(default, [tf.fill([3], 2.0)]))
    np.testing.assert_array_equal(alone[0].numpy(), [2.0, 2.0, 2.0])
    with pytest.raises(RuntimeError, match=r"inside strategy.run"):
        collectives.all_reduce_gradients(strategy, [tf.ones([3])])
