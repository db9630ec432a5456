"""Checkpoint files on disk: crafted or damaged files, planted symlinks, failed writes (disk full).

Every crafted file is a well-formed zip with valid CRCs, so only the structural checks of
`tfdist.callbacks` can catch it. Kill -9 at random moments is in tests/callbacks/test_callbacks_fault.py.
"""

import errno
import io
import json
import os
import re
import shutil
import stat
import tracemalloc
import zipfile

import keras
import numpy as np
import pytest

import tfdist.callbacks as cb
from tfdist.callbacks import _files

X = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
Y = (X @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")).astype("float32")
OLDER, NEWEST = "ckpt-000000004.npz", "ckpt-000000008.npz"


def make_model():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse", metrics=["mae"])
    return model


def fit(model, callbacks, epochs=2):
    return model.fit(X, Y, batch_size=8, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    """Two good checkpoints (steps 4 and 8) of `make_model()`, written by `Checkpoint` every epoch."""
    directory = tmp_path_factory.mktemp("good")
    fit(make_model(), [cb.Checkpoint(directory, every_n_epochs=1)])
    assert sorted(os.listdir(directory)) == [OLDER, NEWEST]
    return directory


@pytest.fixture
def ckpt_dir(good_dir, tmp_path):
    directory = tmp_path / "ckpt"
    shutil.copytree(good_dir, directory)
    return directory


def npy(array) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, np.asarray(array), allow_pickle=False)
    return buffer.getvalue()


def rewrite(path, edit):
    """Rewrites the zip at `path` after `edit(members)` (a dict name -> bytes); the new zip's CRCs are valid."""
    with zipfile.ZipFile(path) as z:
        members = {name: z.read(name) for name in z.namelist()}
    edit(members)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # every CRC matches: only the structural checks can reject the file


def edit_meta(change):
    def edit(members):
        meta = json.loads(members["__meta__"])
        members["__meta__"] = json.dumps(change(meta)).encode()

    return edit


def set_key(key, value):
    def change(meta):
        meta[key] = value
        return meta

    return change


def header_claims_4_tib(members):
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (2**40,)})
    members["000000.npy"] = header.getvalue() + bytes(48)
    edit_meta(lambda meta: {**meta, "shapes": [[2**40], *meta["shapes"][1:]]})(members)


def kernel_of_shape_3_4(members):
    members["000000.npy"] = npy(np.zeros((3, 4), "float32"))  # the metadata says (4, 3)


def int32_kernel(members):
    members["000000.npy"] = npy(np.ones((4, 3), "int32"))  # the metadata says float32


def without_member_1(members):
    del members["000001.npy"]


def nested_meta(members):
    members["__meta__"] = b"[" * 100_000 + b"]" * 100_000


CRAFTED = {
    "npy_header_claims_4_TiB": (
        header_claims_4_tib,
        r"member 000000\.npy holds 48 bytes of data, its header claims 4398046511104",
    ),
    "meta_is_a_json_list": (edit_meta(lambda meta: [meta]), r"its __meta__ member is a JSON list, not an object"),
    "paths_is_a_number": (edit_meta(set_key("paths", 5)), r"metadata 'paths' is 5, expected a list of strings"),
    "array_shape_differs_from_meta": (
        kernel_of_shape_3_4,
        r"member 000000\.npy holds shape \(3, 4\), the metadata says \(4, 3\)",
    ),
    "int32_array_where_meta_says_float32": (
        int32_kernel,
        r"member 000000\.npy holds dtype int32, the metadata says float32",
    ),
    "fewer_paths_than_arrays": (
        edit_meta(lambda meta: {**meta, "paths": meta["paths"][:-1]}),
        r"different numbers of paths, shapes and dtypes",
    ),
    "shape_of_strings": (edit_meta(set_key("shapes", [["4"]])), r"metadata 'shapes' is \[\['4'\]\], expected a list"),
    "object_dtype": (
        edit_meta(lambda meta: {**meta, "dtypes": ["object", *meta["dtypes"][1:]]}),
        r"metadata dtype #0 'object' is not a numeric dtype",
    ),
    "missing_member": (without_member_1, r"member 000001\.npy is missing"),
    "logs_of_strings": (edit_meta(set_key("logs", {"loss": "low"})), r"metadata 'logs' is .*expected an object of"),
    "meta_nested_100000_deep": (nested_meta, r"recursion"),
}


@pytest.mark.parametrize("case", CRAFTED, ids=list(CRAFTED))
def test_crafted_newest_checkpoint_is_skipped_for_the_older_one_and_refused_by_restore(ckpt_dir, case):
    craft, reason = CRAFTED[case]
    newest = ckpt_dir / NEWEST
    rewrite(newest, craft)
    tracemalloc.start()
    try:
        with pytest.warns(cb.CheckpointCorruptWarning, match=re.escape(str(newest)) + ".*" + reason):
            assert cb.latest_checkpoint(ckpt_dir) == str(ckpt_dir / OLDER)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20  # validated before anything the size of a claimed array is allocated
    with pytest.warns(cb.CheckpointCorruptWarning):
        step, path, meta, arrays = _files.newest_valid(str(ckpt_dir), "ckpt")
    assert (step, path, meta["step"]) == (4, str(ckpt_dir / OLDER), 4)
    with pytest.raises(ValueError, match=re.escape(str(newest)) + " is truncated or corrupt: .*" + reason):
        cb.restore_checkpoint(make_model(), newest)


def test_checkpoint_whose_step_differs_from_its_name_is_skipped(ckpt_dir):
    rewrite(ckpt_dir / NEWEST, edit_meta(set_key("step", 999)))
    with pytest.warns(cb.CheckpointCorruptWarning, match=r"its metadata says step 999, its name step 8"):
        assert cb.latest_checkpoint(ckpt_dir) == str(ckpt_dir / OLDER)


def test_restore_refuses_an_array_whose_dtype_differs_from_the_variable(ckpt_dir):
    # A consistent file (metadata and array both int32) is well formed, but does not fit the float32 kernel.
    newest = ckpt_dir / NEWEST
    rewrite(newest, int32_kernel)
    rewrite(newest, edit_meta(lambda meta: {**meta, "dtypes": ["int32", *meta["dtypes"][1:]]}))
    assert cb.latest_checkpoint(ckpt_dir) == str(newest)
    model = make_model()
    before = model.get_weights()
    with pytest.raises(
        cb.CheckpointMismatchError,
        match=re.escape(str(newest)) + r".*'sequential_\d+/dense_\d+/kernel' with shape \(4, 3\) and dtype float32 "
        r"in the model but .* dtype int32 in the checkpoint",
    ):
        cb.restore_checkpoint(model, newest)
    for a, b in zip(model.get_weights(), before):  # nothing was assigned
        np.testing.assert_array_equal(a, b)


def test_backup_and_restore_resumes_from_the_older_backup_when_the_newest_is_crafted(tmp_path):
    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == 5:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fit(make_model(), [cb.BackupAndRestore(tmp_path, save_freq=2), Crash()], epochs=3)
    newest = tmp_path / "worker-0" / "backup-000000004.npz"
    rewrite(newest, edit_meta(set_key("batch", "two")))
    backup = cb.BackupAndRestore(tmp_path, save_freq=2)
    with pytest.warns(cb.CheckpointCorruptWarning, match=re.escape(str(newest)) + r".*metadata 'batch' is 'two'"):
        fit(make_model(), [backup], epochs=3)
    assert backup.restored_step == 2


def test_bfloat16_variables_round_trip(tmp_path):
    # numpy writes ml_dtypes' bfloat16 as raw 2-byte values ("V2"); the metadata's dtype restores it.
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, dtype="bfloat16")])
    model.compile(optimizer="sgd", loss="mse")
    fit(model, [cb.Checkpoint(tmp_path)], epochs=1)
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, dtype="bfloat16")])
    other.compile(optimizer="sgd", loss="mse")
    cb.restore_checkpoint(other, tmp_path)
    assert str(other.layers[0].kernel.numpy().dtype) == "bfloat16"
    for a, b in zip(other.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ planted symlinks
def test_symlinks_planted_at_guessable_names_are_never_written_through(tmp_path):
    directory = tmp_path / "shared"
    directory.mkdir()
    victim, final_victim = tmp_path / "victim", tmp_path / "final_victim"
    victim.write_bytes(b"root-owned data")
    final_victim.write_bytes(b"other root-owned data")

    class Plant(keras.callbacks.Callback):
        """Runs before `Checkpoint` at the epoch end, after its start-up cleanup: as another user would."""

        def on_epoch_end(self, epoch, logs=None):
            name = f"ckpt-{4 * (epoch + 1):09d}.npz"
            for suffix in [os.getpid(), *range(1, 100), "0" * 8, "tmp"]:  # the old `-<pid>` name among them
                link = directory / f".{name}.tmp-{suffix}"
                if not link.is_symlink():
                    os.symlink(victim, link)
            if epoch == 0:
                os.symlink(final_victim, directory / name)  # at the final name itself

    umask = os.umask(0o022)
    os.umask(umask)
    model = make_model()
    fit(model, [Plant(), cb.Checkpoint(directory, every_n_epochs=1)])
    assert victim.read_bytes() == b"root-owned data"
    assert final_victim.read_bytes() == b"other root-owned data"
    first = directory / OLDER  # the link there was replaced by the checkpoint file, not written through
    assert not first.is_symlink() and stat.S_IMODE(first.stat().st_mode) == 0o666 & ~umask
    meta, _ = _files.read_file(str(first))
    assert meta["step"] == 4
    assert cb.latest_checkpoint(directory) == str(directory / NEWEST)


def test_other_workers_write_in_a_private_directory_not_a_planted_one(tmp_path):
    directory, victim_dir = tmp_path / "ckpt", tmp_path / "victim_dir"
    directory.mkdir()
    victim_dir.mkdir()
    (victim_dir / "kept").write_text("x")
    os.symlink(victim_dir, directory / ".worker-1-tmp")  # the old fixed name
    os.symlink(victim_dir, directory / ".worker-1-tmp-abcd1234")  # looks like a stale one of worker 1
    arrays = [np.arange(12, dtype="float32").reshape(3, 4)]
    assert _files.save(str(directory), "ckpt", 4, ["w"], arrays, {"step": 4}, rank=1) is None
    assert sorted(os.listdir(victim_dir)) == ["kept"] and (victim_dir / "kept").read_text() == "x"
    assert sorted(os.listdir(directory)) == [".worker-1-tmp"]  # only the link of the old name, left alone


def test_stale_temp_cleanup_matches_the_temp_names_and_follows_no_symlink(tmp_path):
    victim, victim_dir = tmp_path / "victim", tmp_path / "victim_dir"
    victim.write_text("v")
    victim_dir.mkdir()
    (victim_dir / "inside").write_text("i")
    directory = tmp_path / "ckpt"
    directory.mkdir()
    for name in [
        ".ckpt-000000004.npz.tmp-0f3a9c21d4e5b687",
        ".ckpt-000000002.npz.tmp-4242",
        OLDER,
        "notes.txt",
        ".keep",
        ".model.keras.tmp-ab12cd34",
    ]:
        (directory / name).write_bytes(b"partial")
    os.symlink(victim, directory / ".ckpt-000000006.npz.tmp-deadbeef")
    os.symlink(victim_dir, directory / ".ckpt-000000008.npz.tmp-feedface")
    _files.remove_stale_temps(str(directory))
    assert sorted(os.listdir(directory)) == [".keep", ".model.keras.tmp-ab12cd34", OLDER, "notes.txt"]
    assert victim.read_text() == "v" and os.listdir(victim_dir) == ["inside"]
    staging = directory / ".model.keras.tmp-0a1b2c3d"  # what an interrupted `write_keras_model` leaves
    staging.mkdir()
    (staging / "model.keras").write_bytes(b"partial")
    _files.remove_stale_temps(str(directory), ending=".keras")
    assert sorted(os.listdir(directory)) == [".keep", OLDER, "notes.txt"]


# ------------------------------------------------------------------ failed writes
ARRAYS = [np.full((128, 256), 1.5, "float32"), np.arange(4096, dtype="int64")]


def _disk_full_after(limit):
    """An `os.fdopen` whose files take `limit` bytes, then fail as a full disk does (the rest is lost)."""
    real_fdopen = os.fdopen

    class Full(io.FileIO):
        written = 0

        def write(self, data):
            room = limit - Full.written
            if len(data) > room:
                super().write(bytes(data)[: max(room, 0)])
                Full.written = limit
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            Full.written += len(data)
            return super().write(data)

    def fdopen(fd, mode="r", *args, **kwargs):
        if mode != "wb":
            return real_fdopen(fd, mode, *args, **kwargs)
        return io.BufferedWriter(Full(fd, "wb"))

    return fdopen


def _no_space(fd):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["mid_write", "at_fsync", "mid_write_over_the_same_name"])
def test_disk_full_during_a_write_keeps_the_previous_checkpoint_and_removes_the_temp(tmp_path, monkeypatch, where):
    first = str(tmp_path / "ckpt-000000002.npz")
    _files.write_file(first, ["a", "b"], ARRAYS, {"step": 2})
    target = first if where == "mid_write_over_the_same_name" else str(tmp_path / "ckpt-000000004.npz")
    if where == "at_fsync":
        monkeypatch.setattr(os, "fsync", _no_space)
    else:
        monkeypatch.setattr(os, "fdopen", _disk_full_after(100_000))  # of ~164 KB
    with pytest.raises(cb.CheckpointWriteError, match=re.escape(repr(target)) + ": No space left on device") as e:
        _files.write_file(target, ["a", "b"], [a + 1 for a in ARRAYS], {"step": 4})
    monkeypatch.undo()
    assert isinstance(e.value, OSError) and e.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == ["ckpt-000000002.npz"]  # the temporary file is gone
    meta, arrays = _files.read_file(first)
    assert meta["step"] == 2
    for a, b in zip(arrays, ARRAYS):
        np.testing.assert_array_equal(a, b)


def test_write_into_a_directory_that_cannot_exist_names_the_path(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    target = str(a_file / "ckpt-000000002.npz")
    with pytest.raises(cb.CheckpointWriteError, match=re.escape(repr(target))):
        _files.write_file(target, ["a"], ARRAYS[:1], {"step": 2})
    with pytest.raises(cb.CheckpointWriteError, match=re.escape(repr(str(a_file / "ckpt-000000002.npz")))):
        _files.save(str(a_file), "ckpt", 2, ["a"], ARRAYS[:1], {"step": 2}, rank=1)


def test_keras_model_is_written_atomically(tmp_path, monkeypatch):
    model = make_model()
    fit(model, [], epochs=1)
    path = str(tmp_path / "model.keras")
    _files.write_keras_model(model, path)
    first = model.get_weights()
    fit(model, [], epochs=1)
    monkeypatch.setattr(os, "fsync", _no_space)
    with pytest.raises(cb.CheckpointWriteError, match=re.escape(repr(path)) + ": No space left on device"):
        _files.write_keras_model(model, path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["model.keras"]  # no staging directory left
    for a, b in zip(keras.saving.load_model(path).get_weights(), first):  # the earlier model, intact
        np.testing.assert_array_equal(a, b)
    _files.write_keras_model(model, path)
    for a, b in zip(keras.saving.load_model(path).get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
