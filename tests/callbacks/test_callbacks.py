"""tfdist.callbacks in the test process (8 simulated CPUs) and, for ModelParallelStrategy, in a child.

Crashes, SIGTERM, kill -9 and multi-worker runs are in tests/callbacks/test_callbacks_fault.py.
"""

import json
import os
import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf
from _procs import REPO
from _procs import run_child

import tfdist
import tfdist.callbacks as cb
from tfdist.callbacks import _files

X = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")


@pytest.fixture(scope="module")
def strategy():
    return tfdist.DataParallelStrategy(devices=["CPU:0", "CPU:1"])


def make_model(strategy=None, units=3, lr=0.01, steps_per_execution=1):
    keras.utils.set_random_seed(1)
    with (strategy or tf.distribute.get_strategy()).scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units), keras.layers.Dense(1)])
        model.compile(
            optimizer=keras.optimizers.SGD(lr, momentum=0.9),
            loss="mse",
            metrics=["mae"],
            steps_per_execution=steps_per_execution,
        )
    return model


def fit(model, callbacks, epochs=2, **kwargs):
    return model.fit(X, Y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks, **kwargs)


# ------------------------------------------------------------------ Checkpoint
def test_checkpoint_every_n_steps_keeps_last_k_and_the_best(strategy, tmp_path):
    model = make_model(strategy)  # the loss falls, so with mode="max" the first checkpoint is the best
    ckpt = cb.Checkpoint(tmp_path, every_n_steps=3, every_n_epochs=None, keep=2, monitor="loss", mode="max")
    fit(model, [ckpt], epochs=3)  # 4 steps per epoch: saves at steps 3, 6, 9, 12
    losses = {s: _files.read_meta(p)["monitor_value"] for s, p in _files.list_checkpoints(str(tmp_path), "ckpt")}
    assert sorted(losses) == [3, 9, 12]
    assert ckpt.best == str(tmp_path / "ckpt-000000003.npz")
    assert losses[3] > max(losses[9], losses[12])
    assert cb.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-000000012.npz")
    # The latest checkpoint holds the final weights and optimizer state; it restores into a new model.
    other = make_model(strategy)
    meta = cb.restore_checkpoint(other, tmp_path)
    assert meta["step"] == 12
    for a, b in zip(
        other.get_weights() + [v.numpy() for v in other.optimizer.variables],
        model.get_weights() + [v.numpy() for v in model.optimizer.variables],
    ):
        np.testing.assert_array_equal(a, b)


def test_checkpoint_every_epoch_and_max_mode(tmp_path):
    model = make_model()
    ckpt = cb.Checkpoint(tmp_path, keep=1, monitor="neg", mode="max")

    class Neg(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            logs["neg"] = -float(epoch)  # epoch 0 is best

    fit(model, [Neg(), ckpt], epochs=3)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000004.npz", "ckpt-000000012.npz"]
    assert ckpt.best.endswith("ckpt-000000004.npz")
    assert _files.read_meta(ckpt.best)["epoch"] == 1


def test_truncated_and_corrupt_checkpoints_are_skipped_with_a_warning(tmp_path):
    model = make_model()
    fit(model, [cb.Checkpoint(tmp_path, every_n_epochs=1, keep=3)], epochs=3)
    newest, middle = tmp_path / "ckpt-000000012.npz", tmp_path / "ckpt-000000008.npz"
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])  # truncated
    raw = bytearray(middle.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte in the middle of the weights
    middle.write_bytes(bytes(raw))
    with pytest.warns(cb.CheckpointCorruptWarning) as record:
        assert cb.latest_checkpoint(tmp_path) == str(tmp_path / "ckpt-000000004.npz")
    messages = [str(w.message) for w in record]
    assert any(str(newest) in m for m in messages) and any(str(middle) in m and "CRC" in m for m in messages)
    with pytest.raises(ValueError, match="truncated or corrupt"):
        cb.restore_checkpoint(make_model(), newest)


def test_restoring_into_a_different_model_names_the_first_mismatching_variable(tmp_path):
    fit(make_model(), [cb.Checkpoint(tmp_path)], epochs=1)
    with pytest.raises(cb.CheckpointMismatchError, match=r"'sequential_\d+/dense_\d+/kernel' with shape \(4, 5\)"):
        cb.restore_checkpoint(make_model(units=5), tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cb.restore_checkpoint(make_model(), tmp_path / "empty_dir_that_is_missing")


def test_checkpoint_bad_input(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=r"`keep`.*keep=0.*integer >= 1"):
        cb.Checkpoint(tmp_path, keep=0)
    with pytest.raises(ValueError, match=r"every_n_steps=-1"):
        cb.Checkpoint(tmp_path, every_n_steps=-1)
    with pytest.raises(ValueError, match="both None"):
        cb.Checkpoint(tmp_path, every_n_epochs=None)
    with pytest.raises(ValueError, match=r"mode='best'.*\('auto', 'min', 'max'\)"):
        cb.Checkpoint(tmp_path, mode="best")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        cb.Checkpoint(a_file)
    with pytest.raises(ValueError, match="is a file, not a directory"):
        cb.BackupAndRestore(a_file / "sub")
    with pytest.raises(ValueError, match=r"save_freq='step'.*'epoch' or a positive integer"):
        cb.BackupAndRestore(tmp_path, save_freq="step")
    with pytest.raises(
        ValueError, match=r"monitor='val_loss' is not in the epoch-end logs; available: \['loss', 'mae'\]"
    ):
        fit(make_model(), [cb.Checkpoint(tmp_path / "m", monitor="val_loss")], epochs=1)


def test_unwritable_checkpoint_directory_is_refused(tmp_path, monkeypatch):
    # The tests run as root, for whom every directory is writable: the permission check is simulated.
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match=f"directory {str(tmp_path)!r} is not writable"):
        cb.Checkpoint(tmp_path / "new")


# ------------------------------------------------------------------ BackupAndRestore (in process)
class Crash(keras.callbacks.Callback):
    """Interrupts `fit` after optimizer step `step`, as a crash would (the backups stay)."""

    def __init__(self, step):
        super().__init__()
        self.step = step

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) == self.step:
            raise KeyboardInterrupt


def test_backup_and_restore_resumes_mid_epoch_with_steps_per_execution(strategy, tmp_path):
    reference = make_model(strategy, steps_per_execution=2)
    fit(reference, [], epochs=3)
    crashed = make_model(strategy, steps_per_execution=2)
    with pytest.raises(KeyboardInterrupt):
        fit(crashed, [cb.BackupAndRestore(tmp_path, save_freq=2), Crash(6)], epochs=3)
    resumed = make_model(strategy, steps_per_execution=2)
    backup = cb.BackupAndRestore(tmp_path, save_freq=2)
    fit(resumed, [backup], epochs=3)
    assert backup.restored_step == 6  # epoch 1 after its first 2 batches: one 2-step call skipped
    assert int(resumed.optimizer.iterations.numpy()) == 12
    for a, b in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert not tmp_path.exists()  # deleted at the end of training
    assert resumed._initial_epoch is None  # the next fit starts from its own initial_epoch


_UNINTERRUPTED = {}


def uninterrupted(strategy):
    """`make_model(strategy)` after 3 uninterrupted epochs, and its history: trained once per strategy."""
    if strategy not in _UNINTERRUPTED:
        reference = make_model(strategy)
        _UNINTERRUPTED[strategy] = reference, fit(reference, [], epochs=3).history
    return _UNINTERRUPTED[strategy]


@pytest.mark.parametrize("distributed", [False, True], ids=["no_strategy", "data_parallel"])
@pytest.mark.parametrize(
    "save_freq, crash_at, restored, epoch",
    [(4, 6, 4, 0), (2, 7, 6, 1)],  # 4 steps per epoch
    ids=["backup_at_the_epochs_last_batch", "backup_mid_epoch"],
)
def test_resume_ends_with_the_weights_and_history_of_an_uninterrupted_run(
    strategy, tmp_path, distributed, save_freq, crash_at, restored, epoch
):
    # At the epoch's last batch the resumed fit skips the whole epoch: no train step builds the compiled
    # metrics ("mae") without a strategy, yet the epoch end reads them.
    use = strategy if distributed else None
    reference, want = uninterrupted(use)
    with pytest.raises(KeyboardInterrupt):
        fit(make_model(use), [cb.BackupAndRestore(tmp_path, save_freq=save_freq), Crash(crash_at)], epochs=3)
    resumed = make_model(use)
    backup = cb.BackupAndRestore(tmp_path, save_freq=save_freq)
    got = fit(resumed, [backup], epochs=3).history
    assert backup.restored_step == restored
    assert int(resumed.optimizer.iterations.numpy()) == 12
    for a, b in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    # The resumed fit's epochs (from the backup's) log what the uninterrupted run logged for them.
    assert sorted(got) == ["loss", "mae"] and len(got["loss"]) == 3 - epoch
    for key in ("loss", "mae"):
        np.testing.assert_allclose(got[key], want[key][epoch:], rtol=1e-6)


def test_backup_from_another_model_is_an_error(tmp_path):
    fit(make_model(), [cb.BackupAndRestore(tmp_path, save_freq=2, delete_checkpoint=False)], epochs=1)
    with pytest.raises(cb.CheckpointMismatchError, match="dense_.*kernel"):
        fit(make_model(units=5), [cb.BackupAndRestore(tmp_path)], epochs=1)


# ------------------------------------------------------------------ SyncCheck / MetricAverage
def test_sync_check_passes_then_names_a_diverged_variable_and_replica(strategy):
    model = make_model(strategy)
    check = cb.SyncCheck(every_n_steps=3)
    fit(model, [check], epochs=2)  # 8 steps: checks at 3 and 6
    assert check.checks == 2
    kernel = model.layers[0].kernel
    copies = strategy.experimental_local_results(kernel.value)
    copies[1].assign(copies[1].numpy() + 1e-7)
    with pytest.raises(
        cb.SyncError, match=r"'sequential_\d+/dense_\d+/kernel' differs between replicas .*CPU:0 vs .*CPU:1"
    ):
        fit(model, [check], epochs=1)


def test_sync_check_stops_on_nan_weights_and_loss(strategy):
    model = make_model(strategy)
    model.layers[1].bias.assign(np.array([np.nan], "float32"))
    with pytest.raises(cb.SyncError, match=r"dense_\d+/bias' holds NaN/Inf.*the loss is NaN/Inf"):
        fit(model, [cb.SyncCheck(every_n_steps=1)], epochs=1)
    with pytest.raises(ValueError, match=r"every_n_steps=0"):
        cb.SyncCheck(every_n_steps=0)


def test_metric_average_on_one_host_leaves_logs_unchanged(strategy):
    model = make_model(strategy)
    plain = fit(model, [], epochs=1).history
    model = make_model(strategy)
    averaged = fit(model, [cb.MetricAverage(batch_logs=True)], epochs=1).history
    assert averaged == plain


# ------------------------------------------------------------------ LearningRateWarmup / WarmupSchedule
def test_warmup_scales_by_replicas_linearly(strategy):
    model = make_model(strategy, lr=0.01)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate.numpy()))

    fit(model, [cb.LearningRateWarmup(warmup_steps=4), Record()], epochs=2)
    # 2 replicas: 1x at step 0, rising to 2x at step 4 (Goyal et al.: start at the single-device rate).
    np.testing.assert_allclose(seen, [0.01, 0.0125, 0.015, 0.0175, 0.02, 0.02, 0.02, 0.02], rtol=1e-6)


def test_warmup_schedule_composes_with_a_keras_schedule_and_serializes():
    decay = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    lr = cb.WarmupSchedule(decay, warmup_steps=4, scale=8, initial_scale=0.5)
    for step in (0, 2, 4, 9):
        factor = 0.5 + (8 - 0.5) * min(step / 4, 1.0)
        np.testing.assert_allclose(float(lr(step)), float(decay(step)) * factor, rtol=1e-6)
    again = cb.WarmupSchedule.from_config(json.loads(json.dumps(lr.get_config())))
    np.testing.assert_allclose(float(again(3)), float(lr(3)), rtol=1e-7)
    optimizer = keras.optimizers.SGD(learning_rate=decay)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=optimizer, loss="mse")
    with pytest.raises(ValueError, match="WarmupSchedule"):
        model.fit(X, Y, verbose=0, callbacks=[cb.LearningRateWarmup(warmup_steps=2)])
    with pytest.raises(ValueError, match=r"warmup_steps=0"):
        cb.WarmupSchedule(0.1, warmup_steps=0, scale=2)
    with pytest.raises(ValueError, match=r"scale=-1"):
        cb.LearningRateWarmup(warmup_steps=3, scale=-1)


# ------------------------------------------------------------------ Throughput
def test_throughput_in_logs_history_and_tensorboard(strategy, tmp_path):
    model = make_model(strategy)
    batch_logs = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batch_logs.append(dict(logs))

    speed = cb.Throughput(batch_size=8, tokens_per_example=4, baseline_examples_per_sec=100.0, log_dir=str(tmp_path))
    history = fit(model, [speed, Record()], epochs=2).history
    last = batch_logs[-1]
    assert last["examples_per_sec"] == pytest.approx(8000.0 / last["step_time_ms"])
    assert last["tokens_per_sec"] == pytest.approx(4 * last["examples_per_sec"])
    assert last["examples_per_sec_per_replica"] == pytest.approx(last["examples_per_sec"] / 2)
    assert last["scaling_efficiency"] == pytest.approx(last["examples_per_sec"] / 200.0)
    assert len(history["examples_per_sec"]) == 2 and all(v > 0 for v in history["examples_per_sec"])
    tags = set()
    for name in os.listdir(tmp_path):
        for event in tf.compat.v1.train.summary_iterator(str(tmp_path / name)):
            tags.update(v.tag for v in event.summary.value)
    assert {"throughput/epoch_examples_per_sec", "throughput/step_scaling_efficiency"} <= tags
    with pytest.raises(ValueError, match=r"batch_size=0"):
        cb.Throughput(batch_size=0)


def test_public_names():
    assert set(cb.__all__) >= {
        "Checkpoint",
        "BackupAndRestore",
        "SyncCheck",
        "MetricAverage",
        "LearningRateWarmup",
        "Throughput",
        "latest_checkpoint",
    }


# ------------------------------------------------------------------ ModelParallelStrategy (own process)
def test_callbacks_under_model_parallel_strategy(tmp_path):
    r = run_child(os.path.join(REPO, "tests", "scenarios", "callbacks_under_model_parallel.py"), tmp_path,
                  timeout=240)
    assert r["kernel_layout"] == r["restored_kernel_layout"] == "['unsharded', 'model']"
    assert r["sync_checks"] == 7 and r["replicas"] == 2
    assert r["topology"] == {"worker_index": 0, "num_workers": 1, "data_parallel_size": 2}  # the batch axis
    assert r["checkpoints"] == ["ckpt-000000010.npz", "ckpt-000000015.npz"]
    assert r["backups_after_crash"] == ["backup-000000004.npz", "backup-000000006.npz"]
    assert r["restored_step"] == 6 and r["resume_max_diff"] <= 1e-5
    assert r["restored_checkpoint_step"] == 15 and r["checkpoint_max_diff"] == 0.0
    assert "variable 'mlp_in/kernel' holds NaN/Inf" in r["sync_error"]
    assert r["warmup_final_lr"] == pytest.approx(0.1)
    shutil.rmtree(tmp_path / "ckpt")


@pytest.mark.parametrize("module", ["checkpoint", "schedules", "sync", "throughput"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"tfdist.callbacks.{module}"), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
