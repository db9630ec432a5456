"""Keras' distribution API (`keras.distribution`) on TensorFlow through `tfdist.use_keras_distribution()`.

The scenarios run in processes of their own (tests/scenarios/keras_distribution_api.py), on 8 simulated CPUs (Keras'
distribution guide; KerasHub's Llama and Gemma) and on 4 (`DataParallel()` set before tfdist is asked).
Every distributed run is checked against the same model trained on one device from the same seed on the
same data: losses and `evaluate` rtol 1e-4, weights rtol 1e-4 / atol 1e-5 (the guide's MLP; RMSprop and
SGD) or atol 1e-4 (the KerasHub models under Adam). The guide's Dropout(0.4) runs as written (finite
losses only: a distributed step draws other random numbers than one device, by design); the comparisons
use Dropout(0). Placement is read from the variables' DTensor layouts and tfdist's placement report.
"""

import json
import math
import sys

import _procs
import pytest
from keras.src.backend.tensorflow import distribution_lib as backend_distribution_lib
from keras.src.distribution import distribution_lib

from tfdist import _compat
from tfdist._compat import keras_distribution as hooks

CHILD = f"{_procs.REPO}/tests/scenarios/keras_distribution_api.py"
SCENARIOS = ("guide", "hub", "data_parallel")  # started in this order, two at a time
LOSS_RTOL = 1e-4
TIMEOUT_S = 900  # the whole file takes ~2 minutes on 2 idle cores; a shared machine may take several times that


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Scenario -> the numbers its child process measured."""
    queue = _procs.Queue(tmp_path_factory.mktemp("kdist_logs"), parallel=2, timeout=TIMEOUT_S)
    outs = {name: tmp_path_factory.mktemp(f"kdist_{name}") for name in SCENARIOS}
    try:
        for name in SCENARIOS:
            queue.add(name, [sys.executable, CHILD, name, str(outs[name])], _procs.clean_env(TF_CPP_MIN_LOG_LEVEL="3"))
        results = {}
        for name in SCENARIOS:
            code, log = queue.result(name)
            status = f"killed after {TIMEOUT_S} s" if code is None else f"exit status {code}"
            assert code == 0, f"the {name!r} scenario ended with {status}:\n{log[-8000:]}"
            results[name] = json.loads((outs[name] / "result.json").read_text())
        return results
    finally:
        queue.kill_all()


def assert_equals_one_device(run):
    assert run["distributed"], run
    assert run["losses"] == pytest.approx(run["ref_losses"], rel=LOSS_RTOL), run
    assert run["evaluate"] == pytest.approx(run["ref_evaluate"], rel=LOSS_RTOL), run
    assert run["weights_close"], run["weights_diff"]


# ---------------------------------------------------------------------------------------------------- guide
@pytest.mark.parametrize("way", ["dp_mesh", "dp_devices"])
def test_guide_data_parallel_equals_one_device(runs, way):
    # DataParallel(device_mesh=DeviceMesh((8,), ["data"])) by set_distribution; DataParallel(devices=...) by scope().
    run = runs["guide"][way]
    assert (run["strategy"], run["replicas"]) == ("DataParallelStrategy", 8)
    assert_equals_one_device(run)


def test_guide_model_parallel_equals_one_device_with_d1_split(runs):
    run = runs["guide"]["mp"]
    assert (run["strategy"], run["replicas"]) == ("ModelParallelStrategy", 1)  # one global program
    assert run["mesh"] == {"data": 2, "model": 4} and run["batch_axis"] == "data"
    assert run["mesh_devices"] == [f"device:CPU:{i}" for i in range(8)]  # the DeviceMesh's devices, in order
    assert_equals_one_device(run)
    layouts = run["layouts"]
    assert layouts.pop("d1/kernel") == ["unsharded", "model"]
    assert layouts.pop("d2/kernel") == ["unsharded", "unsharded"]  # no key: replicated
    ((slot, slot_layout),) = layouts.items()  # d1/kernel's RMSprop slot follows it
    assert slot.endswith("/d1_kernel_velocity") and slot_layout == ["unsharded", "model"]


def test_guide_runs_as_written_with_dropout(runs):
    for name in ("dp_guide", "mp_guide"):
        run = runs["guide"][name]
        assert all(math.isfinite(v) for v in run["losses"] + [run["evaluate"]]), run
        assert run["losses"][1] < run["losses"][0], run


def test_activation_layout_relayouts_the_layer_output(runs):
    """"d2/output": ("data", None) relayouts d2's output in each traced step; a batch dimension that is unknown
    when traced, or that "data" does not divide (the last batch of 5), keeps DTensor's layout (MATCH)."""
    relayouts = runs["guide"]["mp"]["relayouts"]
    assert {r["key"] for r in relayouts} == {"d2/output"}
    full = [r for r in relayouts if r["shape"] == [16, 10]]
    other = [r for r in relayouts if r["shape"] != [16, 10]]
    assert full and all(r["specs"] == ["data", "unsharded"] for r in full), relayouts
    assert other and all(r["shape"][0] in (None, 5) and r["specs"] == ["match", "unsharded"] for r in other), relayouts


def test_one_strategy_per_distribution_and_switching_back(runs):
    guide = runs["guide"]
    assert guide["hooks"] == {"installed": True, "unpatched": []}
    assert guide["reference"] == {"distributed": False, "has_strategy": False}
    # The distribution's strategy is current in its scope, and the same object each time it is set.
    assert guide["mp_scope_current"] and guide["mp"]["same_strategy"]
    assert guide["dp_devices"]["other_strategy"]  # another distribution object: another strategy
    # set_distribution(None) and leaving scope(): nothing current, a model built then is not distributed.
    back = {
        "distribution": "None",
        "has_strategy": False,
        "distributed": False,
        "model_strategy": "_DefaultDistributionStrategy",
    }
    assert guide["after_none"] == back
    assert guide["after_scope"] == back
    # Leaving a scope entered while another distribution was set restores that one (and its strategy).
    assert guide["dp_after_scope"] == {"distribution_is_outer": True, "strategy_is_outer": True}
    assert guide["nested"] == {"inner_is_mp": True, "outer_back": True, "distribution_back": True}


def test_default_data_parallel_set_before_use_is_taken_up(runs):
    run = runs["data_parallel"]
    assert run["inert_before"] is False  # Keras alone: set_distribution changed nothing on TensorFlow
    dp = run["dp_default"]
    assert dp["devices"] == [f"device:CPU:{i}" for i in range(4)]
    assert (dp["strategy"], dp["replicas"]) == ("DataParallelStrategy", 4)
    assert_equals_one_device(dp)  # numpy input (Keras' array adapter), 50 examples: batches 16/16/16/2


# ------------------------------------------------------------------------------------------------------ hub
@pytest.mark.parametrize("entry", ["strategy", "distribution"])
@pytest.mark.parametrize("model", ["llama", "gemma"])
def test_keras_hub_layout_map_trains_as_one_device(runs, model, entry):
    """`{Llama,Gemma}Backbone.get_layout_map(mesh)` through ModelParallelStrategy(rules=...) and ModelParallel.

    Their maps split weights over "model" and over "batch" (FSDP-style): those are gathered over "batch" for
    each use. Bytes per device at most 1.15 x (split bytes / 4 + replicated bytes).
    """
    hub = runs["hub"][model]
    run = hub[entry]
    assert hub["strategy_mesh"] == {"batch": 2, "model": 4}  # the LayoutMap's mesh, adopted
    assert run["strategy"] == "ModelParallelStrategy"
    assert run["losses"] == pytest.approx(hub["ref_losses"], rel=LOSS_RTOL), (run["losses"], hub["ref_losses"])
    assert run["weights_close"], run["weights_diff"]
    assert run["unmatched"] == [] and len(run["split"]) == 45  # 15 kernels and embeddings + 2 Adam slots each
    assert run["sharded_bytes"] + run["replicated_bytes"] == run["bytes_total"]
    assert run["bytes_per_device"] <= 1.15 * (run["sharded_bytes"] / 4 + run["replicated_bytes"]), run


# ------------------------------------------------------------------------------------------------ bad input
BAD = {
    "strategy_mesh": ("ValueError", "LayoutMap's DeviceMesh {'data': 2, 'model': 4}", "mesh {'data': 4, 'model': 2}"),
    "distribution_mesh": ("ValueError", "key 'd1/kernel'", "{'data': 4, 'model': 2}", "{'data': 2, 'model': 4}"),
    "strategy_rank": ("ValueError", "variable 'd1/kernel' has shape (784, 200) (rank 2)", "LayoutMap key 'd1/kernel'"),
    "distribution_rank": ("ValueError", "variable 'd1/kernel' has shape (784, 200) (rank 2)"),
    "kind": ("ValueError", "got AutoTPDistribution", "DataParallel and keras.distribution.ModelParallel"),
    "devices": ("ValueError", "'/job:worker/replica:0/task:1/device:CPU:0' does not exist", "list_devices(): ['cpu:0'"),
    "processes": ("ValueError", "one of 2 (worker 1 of the cluster", "tfdist.ModelParallelStrategy(rules=layout_map)"),
    "other_scope": ("RuntimeError", "called inside the scope of DataParallelStrategy(devices=["),
    "activation_rank": ("ValueError", "activation layout of 'd2/output'", "has 1 entries ('data',)", "rank 2"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_named(runs, case):
    kind, *fragments = BAD[case]
    message = runs["guide"]["bad"][case]
    assert message is not None and message.startswith(f"{kind}: "), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_a_refused_distribution_changes_nothing(runs):
    bad = runs["guide"]["bad"]
    assert bad["distribution_mesh_left"] == "None"
    assert bad["distribution_rank_left"] == ["None", False]  # the failed scope() was left
    assert bad["left"] == ["None", False]


# ---------------------------------------------------------------------------------------- Keras' private code
def test_every_binding_of_set_distribution_is_one_tfdist_replaces():
    # If Keras binds set_distribution in another module at import, tfdist would miss calls through it.
    ours = (hooks._original_set_distribution, hooks._set_distribution)  # Keras' own, or tfdist's in its place
    assert distribution_lib.set_distribution in ours
    bound = {name for name, module in list(sys.modules.items()) if getattr(module, "set_distribution", None) in ours}
    assert bound == {module.__name__ for module in hooks._BINDINGS}


def test_a_keras_distribute_tensor_on_tensorflow_is_a_compat_error(monkeypatch):
    (hook,) = [h for h in _compat.HOOKS if h.name == "distribute_tensor"]
    hook.check()
    monkeypatch.setattr(backend_distribution_lib, "distribute_tensor", lambda tensor, layout: tensor, raising=False)
    with pytest.raises(_compat.CompatError, match=r"'distribute_tensor' no longer applies: .*distribute_tensor exists"):
        hook.check()
