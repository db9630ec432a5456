"""The private TF/Keras hooks: installed, still matching the code they replace, and still needed."""

import dataclasses
import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist import _compat

DEVICES = [f"CPU:{i}" for i in range(4)]
_KEY_BASES = itertools.count(1)


def plain_mirrored(devices):
    """A plain tf.distribute.MirroredStrategy with collective keys of its own.

    TensorFlow gives every MirroredStrategy the same key base, so two in one process mix their
    all-reduces; TensorFlow's own tests bump the base per strategy, as this does.
    """
    base = {"_collective_key_base": next(_KEY_BASES) * 100_000}
    return type("PlainMirroredStrategy", (tf.distribute.MirroredStrategy,), base)(devices)


def test_installed_versions_are_the_checked_ones():
    # Fails loudly the day the pins move: re-check every hook, then update CHECKED_ON.
    assert _compat.versions_match(), (tf.__version__, keras.__version__, _compat.CHECKED_ON)


def test_every_hook_still_matches_the_code_it_replaces():
    _compat.check_hooks()


def test_strategy_installs_the_hooks():
    tfdist.DataParallelStrategy(devices=DEVICES)
    assert _compat.installed("data_parallel")


def test_a_changed_internal_raises_compat_error_naming_the_hook(monkeypatch):
    def scale_loss_for_distribution(value):
        return value

    hooks = list(_compat.HOOKS)
    assert hooks[0].name == "loss_scaling"
    hooks[0] = dataclasses.replace(hooks[0], probe=scale_loss_for_distribution, needles=("num_replicas_in_sync",))
    monkeypatch.setattr(_compat, "HOOKS", tuple(hooks))
    with pytest.raises(_compat.CompatError, match=r"'loss_scaling' no longer applies.*num_replicas_in_sync"):
        _compat.check_hooks()


def test_every_hook_belongs_to_a_feature_and_names_are_unique():
    names = [h.name for h in _compat.HOOKS]
    assert len(names) == len(set(names)), names
    assert all(h.features and h.features <= set(_compat.FEATURES) for h in _compat.HOOKS)
    assert tfdist.CompatError is _compat.CompatError


def test_installing_a_feature_probes_only_its_hooks(python_subprocess):
    # In a fresh process: which hooks are installed is process-wide state.
    done = python_subprocess(
        """
        import dataclasses
        import tfdist
        tfdist.simulate_devices(2)
        from tfdist import _compat
        assert "layer_call" in {h.name for h in _compat.hooks_for("pipeline")}
        assert "layer_call" not in {h.name for h in _compat.hooks_for("data_parallel")}
        _compat.HOOKS = tuple(
            dataclasses.replace(h, needles=h.needles + ("a line Keras never had",)) if h.name == "layer_call" else h
            for h in _compat.HOOKS
        )
        strategy = tfdist.DataParallelStrategy(devices=["CPU:0", "CPU:1"])
        print("data parallel constructed:", strategy.num_replicas_in_sync, _compat.installed("data_parallel"))
        try:
            tfdist.PipelineStrategy(stages=2, microbatches=2, devices=["CPU:0", "CPU:1"])
        except tfdist.CompatError as e:
            print("pipeline refused:", e)
        print("pipeline installed:", _compat.installed("pipeline"))
        """,
        timeout=180,
    )
    out = done.stdout + done.stderr[-3000:]
    assert "data parallel constructed: 2 True" in done.stdout, out
    assert "pipeline refused: tfdist hook 'layer_call' no longer applies" in done.stdout, out
    assert "a line Keras never had" in done.stdout, out
    assert "pipeline installed: False" in done.stdout, out


def test_hooks_act_under_a_users_subclass_and_not_under_other_strategies():
    from tfdist.strategies import _extended

    class MyStrategy(tfdist.DataParallelStrategy):  # defined outside tfdist, as a user would
        pass

    assert _extended.extended_of(MyStrategy(devices=DEVICES[:2])) is not None
    assert _extended.extended_of(plain_mirrored(DEVICES[:2])) is None
    assert _extended.extended_of(tf.distribute.get_strategy()) is None


def _mlp(optimizer):
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _data():
    rng = np.random.default_rng(1)
    return rng.normal(size=(10, 5)).astype("float32"), rng.normal(size=(10, 1)).astype("float32")


def test_hooks_leave_plain_mirrored_strategy_as_keras_has_it():
    """Plain MirroredStrategy keeps Keras' per-replica weighting (the bias tfdist fixes).

    If this starts failing, Keras fixed the bias upstream and the loss-scaling hook may go.
    """
    tfdist.DataParallelStrategy(devices=DEVICES)  # hooks installed
    x, y = _data()
    ref = _mlp(keras.optimizers.SGD(0.1))
    ref.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)  # batches of 8 then 2: uneven
    with plain_mirrored(DEVICES).scope():
        plain = _mlp(keras.optimizers.SGD(0.1))
    plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    diff = max(np.abs(a - b).max() for a, b in zip(ref.get_weights(), plain.get_weights()))
    assert diff > 1e-3


def test_gradient_accumulation_still_fails_under_plain_mirrored_strategy():
    """If this starts failing, Keras fixed merge_call-in-cond upstream; revisit the apply hook."""
    x, y = _data()
    with plain_mirrored(DEVICES).scope():
        plain = _mlp(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2))
    with pytest.raises(RuntimeError, match="merge_call"):
        plain.fit(x, y, batch_size=8, epochs=1, verbose=0)


def test_steps_per_execution_still_fails_under_plain_mirrored_strategy():
    """If this starts failing, Keras/TF fixed the nested step function in the while loop; drop the hook."""
    x, y = _data()
    with plain_mirrored(DEVICES).scope():
        plain = _mlp(keras.optimizers.SGD(0.1))
        plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="must feed a value for placeholder"):
        plain.fit(x, y, batch_size=4, epochs=1, verbose=0)


def test_reshuffling_dataset_order_still_differs_under_plain_mirrored_strategy():
    """If this starts failing, Keras stopped drawing a batch for its symbolic build; revisit hook 3."""
    x, y = _data()

    def dataset():
        return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(10, seed=5).batch(2)

    ref = _mlp(keras.optimizers.SGD(0.1))
    ref.fit(dataset(), epochs=1, verbose=0)
    with plain_mirrored(DEVICES[:2]).scope():
        plain = _mlp(keras.optimizers.SGD(0.1))
    plain.fit(dataset(), epochs=1, verbose=0)
    diff = max(np.abs(a - b).max() for a, b in zip(ref.get_weights(), plain.get_weights()))
    assert diff > 1e-3, diff


def _passes(strategy, passes):
    """Every element of `passes` iterations over `strategy`'s distribution of a dataset, per replica, as lists.

    The dataset is reshuffled every pass (from seed 3: a new one starts from the same order), has a dict of
    labels, and its last batch of 6 splits over 4 replicas.
    """
    x = np.arange(70 * 3, dtype="float32").reshape(70, 3)
    y = np.arange(70, dtype="int64")
    dataset = tf.data.Dataset.from_tensor_slices((x, {"a": y, "b": 2 * y})).shuffle(70, seed=3).batch(16)
    distributed = strategy.experimental_distribute_dataset(dataset)
    values = lambda v: [r.numpy().tolist() for r in strategy.experimental_local_results(v)]  # noqa: E731
    return [[tf.nest.map_structure(values, e) for e in distributed] for _ in range(passes)]


def test_multi_device_reader_functions_are_traced_once_and_read_what_tensorflows_own_read(monkeypatch):
    from tfdist._compat import multi_device_iterator as mdi

    strategy = tfdist.DataParallelStrategy(devices=DEVICES)
    monkeypatch.setattr(mdi, "_cache", type(mdi._cache)())
    cached = _passes(strategy, 3)
    assert len(mdi._cache) == len(DEVICES)  # one prototype per device, made by the first pass
    assert cached[0] != cached[1]  # the pass reshuffled: each pass read its own iterator, not a stale one
    monkeypatch.setattr(mdi, "CACHE_SIZE", 0)  # TensorFlow's own path every time
    monkeypatch.setattr(mdi, "_cache", type(mdi._cache)())
    assert _passes(strategy, 3) == cached
    assert len(mdi._cache) == 0
    monkeypatch.setattr(mdi, "CACHE_SIZE", 256)
    _passes(plain_mirrored(DEVICES), 2)
    assert len(mdi._cache) == 0  # under a strategy not tfdist's, TensorFlow's path
