"""Keras' own BackupAndRestore and ModelCheckpoint on one shared directory, with 2 real workers on 127.0.0.1.

Without tfdist's hooks (tfdist/_compat/keras_callbacks.py) both workers write the same files at the
same moment: HDF5 "unable to lock file" or FileExistsError on the backup directory. With them the
chief writes the shared files, the other worker writes a private directory it deletes, and a resumed
job restores the chief's backup on every worker.
"""

import sys

import _procs
import numpy as np

import tfdist
from tfdist import _compat

WORKER = str(_procs.REPO + "/tests/scenarios/keras_file_callbacks_two_workers.py")


def _start(procs, tmp_path, out, *, single=False, **opts):
    """Starts one job (2 workers, or one process with `single`); every process gets its own TMPDIR."""
    addresses = ("127.0.0.1:1",) if single else _procs.workers(2)
    args = [f"{k}={v}" for k, v in {**opts, **({"single": 1} if single else {})}.items()]
    started = []
    for i in range(len(addresses)):
        tmpdir = tmp_path / f"tmp{len(procs.procs)}"
        tmpdir.mkdir()
        env = {"TMPDIR": str(tmpdir)}
        if not single:
            env["TF_CONFIG"] = tfdist.cluster.Cluster(workers=addresses, task_index=i).to_tf_config()
        started.append(procs.start([sys.executable, WORKER, f"{out}{i}.npz", *args], _procs.clean_env(**env)))
    return started


def _wait(procs, started, expected, timeout=90):
    codes = procs.wait(started, timeout=timeout)
    assert codes == expected, [procs.log(i)[-3000:] for i in started]


def _weights(path):
    result = np.load(path)
    return [result[f"arr_{i}"] for i in range(sum(k.startswith("arr_") for k in result))]


def _private_dirs_left(tmp_path):
    return sorted(str(p) for p in tmp_path.glob("tmp*/tfdist-worker*"))


def test_keras_backup_and_restore_on_a_shared_dir_resumes_like_an_uninterrupted_run(procs, tmp_path):
    # Uninterrupted, with ModelCheckpoint on the same shared directory tree.
    shared = tmp_path / "shared"
    started = _start(procs, tmp_path, tmp_path / "full", backup=shared / "backup", checkpoint=shared / "ckpt")
    _wait(procs, started, [0, 0])
    full = _weights(tmp_path / "full0.npz")
    for a, b in zip(full, _weights(tmp_path / "full1.npz")):
        np.testing.assert_array_equal(a, b)
    assert not (shared / "backup").exists()  # deleted at the end (delete_checkpoint=True)

    # Interrupted: worker 1 exits when epoch 2 begins; the chief's backup of epochs 0-1 stays.
    started = _start(procs, tmp_path, tmp_path / "cut", backup=shared / "again", die_epoch=2)
    codes = procs.wait(started, timeout=90)
    assert codes[1] == 17 and codes[0] not in (None, 0), [procs.log(i)[-3000:] for i in started]
    assert sorted(p.name for p in (shared / "again").iterdir()) == ["latest.weights.h5", "training_metadata.json"]

    # Relaunched: both workers restore the chief's backup, train epochs 2-4, and end where the full run did.
    _wait(procs, _start(procs, tmp_path, tmp_path / "resumed", backup=shared / "again"), [0, 0])
    for i in range(2):
        result = np.load(tmp_path / f"resumed{i}.npz")
        assert result["epochs"].tolist() == [2, 3, 4]
        for a, b in zip(full, _weights(tmp_path / f"resumed{i}.npz")):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    assert not (shared / "again").exists()
    assert _private_dirs_left(tmp_path) == []


def test_keras_model_checkpoint_on_a_shared_dir_is_written_once_by_the_chief(procs, tmp_path):
    import keras

    shared, own = tmp_path / "ckpt", tmp_path / "own"
    _wait(procs, _start(procs, tmp_path, tmp_path / "w", checkpoint=shared, own=own, epochs=3), [0, 0])
    files = sorted(p.name for p in shared.iterdir())
    assert files == ["e01.weights.h5", "e02.weights.h5", "e03.weights.h5", "model.keras"]  # no marker left
    chief = _weights(tmp_path / "w0.npz")
    model = keras.saving.load_model(shared / "model.keras")
    for a, b in zip(chief, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    model.load_weights(shared / "e03.weights.h5")
    for a, b in zip(chief, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    # A directory per worker (not shared): each worker writes its own, as Keras alone does.
    for i in range(2):
        assert sorted(p.name for p in (own / f"w{i}").iterdir()) == ["model.keras"]
        for a, b in zip(chief, keras.saving.load_model(own / f"w{i}" / "model.keras").get_weights(), strict=True):
            np.testing.assert_array_equal(a, b)
    assert _private_dirs_left(tmp_path) == []


def test_workers_that_find_different_backups_refuse_to_train(procs, tmp_path):
    # A backup of epoch 0 that only worker 0 sees: e.g. a backup_dir on each machine's local disk.
    _wait(procs, _start(procs, tmp_path, tmp_path / "one", single=True, backup=tmp_path / "a", keep=1, epochs=1), [0])
    started = _start(procs, tmp_path, tmp_path / "w", backup0=tmp_path / "a", backup1=tmp_path / "b")
    _wait(procs, started, [1, 1])
    for i in started:
        log = procs.log(i)
        assert "different backups to resume from (worker 0: epoch 1, worker 1: none (no weights))" in log
        assert "use tfdist.callbacks.BackupAndRestore" in log
    assert list((tmp_path / "b").iterdir()) == []  # worker 1 wrote its own directory, and found nothing there


def test_keras_callback_hooks_are_registered_for_multi_worker():
    names = {h.name for h in _compat.hooks_for("multi_worker")}
    assert {"keras_backup_restore", "keras_backup_save", "keras_backup_delete", "keras_checkpoint_save"} <= names
    assert not any(h.name.startswith("keras_") for h in _compat.hooks_for("data_parallel"))


def test_one_worker_keeps_keras_behaviour(tmp_path):
    import keras

    from tfdist._compat import keras_callbacks

    strategy = tfdist.DataParallelStrategy(devices=["CPU:0", "CPU:1"])
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
    backup = keras.callbacks.BackupAndRestore(tmp_path / "backup")
    backup.set_model(model)
    assert keras_callbacks._other_worker(backup) is None
    model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, epochs=2, verbose=0, callbacks=[backup])
    assert not (tmp_path / "backup").exists()
