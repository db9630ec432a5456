"""Keras' own `BackupAndRestore` and `ModelCheckpoint` on several workers: one writer per directory.

Keras 3 has no multi-worker file handling: under `tfdist.MultiWorkerStrategy`
every worker writes the same `backup_dir` / `filepath` at the same moment
(`FileExistsError` on the directory, HDF5 "unable to lock file", torn files).
Under a tfdist strategy with more than one worker these hooks do what
TensorFlow's `distributed_file_utils` did for Keras 2, for any file system:

* The workers elect one writer per directory: each writes a marker file
  into it, and a worker that sees the marker of a lower-numbered worker
  (the directory is shared with it) does not write there. A shared
  directory is written by its first worker only (the chief, when all share
  it); per-worker directories, or one path on each machine's local disk,
  keep Keras' behaviour.
* Every worker still saves at the same point (a save may read variables
  through collectives); a worker that is not its directory's writer saves
  into a private temporary directory, removed right after.
* `BackupAndRestore.on_train_begin`: the writers restore first (with Keras'
  repair from the `.bkp` copies), then the other workers read the writer's
  backup. Every worker must find the same backup, else a ValueError says so.
  Only the writer deletes the backup at the end of `fit`.

With one worker, or under any other strategy, Keras keeps its behaviour.
Installed with the "multi_worker" and "model_parallel" features (ModelParallelStrategy
across processes). Checked on Keras 3.15.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile

from keras.src.callbacks import backup_and_restore as keras_backup
from keras.src.callbacks import model_checkpoint as keras_checkpoint
from keras.src.utils import file_utils

from tfdist._compat._hook import hook
from tfdist.strategies import _extended
from tfdist.strategies import topology

_Backup = keras_backup.BackupAndRestore
_ModelCheckpoint = keras_checkpoint.ModelCheckpoint
# BackupAndRestore's file paths (set in __init__): a worker that does not write saves them in a private directory.
_BACKUP_PATHS = ("_weights_path", "_training_metadata_path", "_prev_weights_path", "_prev_training_metadata_path")


def _gather(strategy, row):
    from tfdist.callbacks import _workers  # deferred: tfdist.callbacks imports tfdist._compat

    return _workers.all_gather_rows(strategy, row)


def _other_worker(callback) -> topology.Topology | None:
    """This process' Topology when `callback`'s model trains under a tfdist strategy on several workers, else None."""
    strategy = getattr(callback.model, "distribute_strategy", None)
    if _extended.extended_of(strategy) is None:
        return None
    place = topology.of(strategy)
    return place if place.num_workers > 1 else None


def _makedirs(directory: str) -> None:
    if file_utils.is_remote_path(directory):
        file_utils.makedirs(directory)  # tf.io.gfile.makedirs: no error when it exists
    else:
        os.makedirs(directory, exist_ok=True)  # safe when several workers create it at once


def _elect_writer(strategy, place: topology.Topology, directory: str) -> bool:
    """Whether this worker writes `directory`: no lower-numbered worker sees the same directory.

    Every worker calls it at the same point (three collectives). Each creates `directory` and a
    marker file in it named by the chief's random token and its worker index, and removes the
    marker once every worker has looked for the others'.
    """
    token = int(_gather(strategy, [secrets.randbits(48) if place.is_chief else 0])[0][0])
    _makedirs(directory)

    def marker(index):
        return os.path.join(directory, f".tfdist-writer-{token:012x}-{index}")

    with file_utils.File(marker(place.worker_index), "w"):
        pass
    try:
        _gather(strategy, [0.0])  # every marker is written
        shared = any(file_utils.exists(marker(i)) for i in range(place.worker_index))
        _gather(strategy, [0.0])  # every worker has looked
    finally:
        file_utils.remove(marker(place.worker_index))
    return not shared


@contextlib.contextmanager
def _private_paths(callback, index: int, directory_attribute: str | None, file_attributes):
    """Points `callback`'s path attributes into a new private directory meanwhile, then deletes the directory.

    `directory_attribute` (if any) becomes the directory itself; each of `file_attributes` the
    directory joined with the path's last component.
    """
    private = tempfile.mkdtemp(prefix=f"tfdist-worker{index}-")
    names = ((directory_attribute,) if directory_attribute else ()) + tuple(file_attributes)
    saved = {name: getattr(callback, name) for name in names}
    try:
        for name in file_attributes:
            setattr(callback, name, os.path.join(private, os.path.basename(saved[name])))
        if directory_attribute:
            setattr(callback, directory_attribute, private)
        yield
    finally:
        for name, value in saved.items():
            setattr(callback, name, value)
        shutil.rmtree(private, ignore_errors=True)


# ------------------------------------------------------------------ BackupAndRestore
_original_backup_begin = _Backup.on_train_begin
_original_backup_save = _Backup._save_model
_original_backup_end = _Backup.on_train_end


def _backup_state(callback) -> list[float]:
    """What this worker restored: [the epoch `fit` resumes at (-1: none), whether the backup weights exist]."""
    epoch = callback.model._initial_epoch
    return [-1.0 if epoch is None else float(epoch), float(file_utils.exists(callback._weights_path))]


def _backup_writes(callback, place) -> bool:
    return getattr(callback, "_tfdist_writes", place.is_chief)


def _backup_on_train_begin(self, logs=None):
    place = _other_worker(self)
    if place is None:
        return _original_backup_begin(self, logs)
    strategy = self.model.distribute_strategy
    self._tfdist_writes = _elect_writer(strategy, place, self.backup_dir)
    if self._tfdist_writes:
        _original_backup_begin(self, logs)  # restores; may repair the backup from its `.bkp` copies
    _gather(strategy, [0.0])  # every writer's restore (and repair) is done
    if not self._tfdist_writes:
        self._load_model()  # the writer's backup; it writes again only after steps every worker takes part in
    found = _gather(strategy, _backup_state(self))
    if (found != found[0]).any():
        by_worker = ", ".join(
            f"worker {i}: " + (f"epoch {int(epoch)}" if epoch >= 0 else "none") + ("" if exists else " (no weights)")
            for i, (epoch, exists) in enumerate(found)
        )
        raise ValueError(
            f"keras.callbacks.BackupAndRestore(backup_dir={self.backup_dir!r}): the workers found different "
            f"backups to resume from ({by_worker}); every worker must resume from the same one. Give every worker "
            "the same directory, on a file system they all read (the chief then writes it), or use "
            "tfdist.callbacks.BackupAndRestore (multi-worker safe, atomic, resumes mid-epoch)."
        )


def _backup_save_model(self):
    place = _other_worker(self)
    if place is None or _backup_writes(self, place):
        return _original_backup_save(self)
    with _private_paths(self, place.worker_index, "backup_dir", _BACKUP_PATHS):
        return _original_backup_save(self)


def _backup_on_train_end(self, logs=None):
    place = _other_worker(self)
    if place is None or _backup_writes(self, place):
        return _original_backup_end(self, logs)
    return None  # the writer deletes the shared backup; this worker's own saves are gone already


# ------------------------------------------------------------------ ModelCheckpoint
_original_checkpoint_save = _ModelCheckpoint._save_model


def _checkpoint_save_model(self, epoch, batch, logs):
    place = _other_worker(self)
    if place is None:
        return _original_checkpoint_save(self, epoch, batch, logs)
    # Every worker formats the same path from the same (all-reduced) logs, so they elect together.
    directory = os.path.dirname(self._get_file_path(epoch, batch, logs)) or os.curdir
    writers = self.__dict__.setdefault("_tfdist_writers", {})
    if directory not in writers:
        writers[directory] = _elect_writer(self.model.distribute_strategy, place, directory)
    if writers[directory]:
        return _original_checkpoint_save(self, epoch, batch, logs)
    with _private_paths(self, place.worker_index, None, ("filepath",)):
        return _original_checkpoint_save(self, epoch, batch, logs)


HOOKS = (
    hook(
        "keras_backup_paths",
        _Backup.__init__,
        (
            "self.backup_dir = backup_dir",
            *(f"self.{name} = " for name in _BACKUP_PATHS),
        ),
        "multi_worker",
        "model_parallel",
    ),
    hook(
        "keras_backup_load",
        _Backup._load_model,
        ("file_utils.exists(self._weights_path)", "self.model._initial_epoch = epoch"),
        "multi_worker",
        "model_parallel",
    ),
    hook(
        "keras_backup_restore",
        _original_backup_begin,
        ("self._load_model()", "file_utils.copy(self._prev_weights_path, self._weights_path)"),
        "multi_worker",
        "model_parallel",
        patch=(_Backup, "on_train_begin", _backup_on_train_begin),
    ),
    hook(
        "keras_backup_save",
        _original_backup_save,
        (
            "file_utils.makedirs(self.backup_dir)",
            "self.model.save_weights(filepath=self._weights_path, overwrite=True)",
            "file_utils.File(self._training_metadata_path, ",
        ),
        "multi_worker",
        "model_parallel",
        patch=(_Backup, "_save_model", _backup_save_model),
    ),
    hook(
        "keras_backup_delete",
        _original_backup_end,
        ("file_utils.rmtree(self.backup_dir)",),
        "multi_worker",
        "model_parallel",
        patch=(_Backup, "on_train_end", _backup_on_train_end),
    ),
    hook(
        "keras_checkpoint_save",
        _original_checkpoint_save,
        (
            "filepath = self._get_file_path(epoch, batch, logs)",
            "self.model.save_weights(filepath, overwrite=True)",
            "self.model.save(filepath, overwrite=True)",
        ),
        "multi_worker",
        "model_parallel",
        patch=(_ModelCheckpoint, "_save_model", _checkpoint_save_model),
    ),
    hook(
        "keras_checkpoint_path",
        _ModelCheckpoint._get_file_path,
        ("self.filepath.format(",),
        "multi_worker",
        "model_parallel",
    ),
)
