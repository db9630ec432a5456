"""Checkpoints that survive crashes and multi-worker training: `Checkpoint`, `BackupAndRestore`.

Their parts, one module each: `_files` (the checkpoint file format: write,
read, validate, list, clean up temporaries), `_state` (the model's variables
out and back in), `_resume` (which backup every worker holds, the data
position, the batches to skip, the metric state), `_preemption` (SIGTERM and
the workers' agreement on it) and `_workers` (the one all-gather they use).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil

import keras
import numpy as np

from tfdist import _compat
from tfdist import _validate
from tfdist import flight
from tfdist.callbacks import _files
from tfdist.callbacks import _preemption
from tfdist.callbacks import _resume
from tfdist.callbacks import _state
from tfdist.callbacks._files import CheckpointCorruptWarning
from tfdist.callbacks._files import CheckpointWriteError
from tfdist.callbacks._state import CheckpointMismatchError
from tfdist.strategies import topology

__all__ = [
    "BackupAndRestore",
    "Checkpoint",
    "CheckpointCorruptWarning",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "latest_checkpoint",
    "restore_checkpoint",
]

_MODES = ("auto", "min", "max")


def _floats(logs) -> dict:
    out = {}
    for key, value in (logs or {}).items():
        with contextlib.suppress(TypeError, ValueError):
            out[key] = float(np.asarray(value))
    return out


def _step(model) -> int:
    return int(np.asarray(model.optimizer.iterations.numpy()))


def latest_checkpoint(directory, *, prefix: str = "ckpt") -> str | None:
    """The newest complete checkpoint file in `directory`, or None.

    Truncated, corrupt or malformed files are skipped with a
    `CheckpointCorruptWarning` naming each one and the reason: a zip CRC
    mismatch, a missing member, metadata that is not what tfdist writes (keys,
    types, as many paths as arrays), an array whose `.npy` header disagrees
    with the metadata (dtype, shape) or with the bytes the file holds. All of
    it is checked before any array is allocated. Temporary files of an
    interrupted write are never candidates.

    Args:
        directory: a `Checkpoint` directory.
        prefix: the file name prefix the `Checkpoint` was created with.

    Returns:
        The path of the newest checkpoint that reads back intact, or None.

    Example:

    >>> import tempfile, tfdist
    >>> tfdist.callbacks.latest_checkpoint(tempfile.mkdtemp()) is None
    True
    """
    found = _files.newest_valid(os.fspath(directory), prefix)
    return None if found is None else found[1]


def restore_checkpoint(model, path) -> dict:
    """Loads a checkpoint file (or the latest one in a directory) into `model` and its optimizer.

    Args:
        model: a built Keras model, compiled when the checkpoint holds optimizer state.
        path: a checkpoint file, or a directory whose `latest_checkpoint` is used.

    Returns:
        The checkpoint's metadata: `step`, `epoch`, `logs`, `paths`, ...

    Raises:
        FileNotFoundError: when `path` holds no complete checkpoint.
        ValueError: when the file is truncated, corrupt or malformed, naming
            it and the reason (the checks of `latest_checkpoint`).
        CheckpointMismatchError: when the checkpoint was written by another
            model, naming the file and the first variable whose path, shape or
            dtype differs; nothing is assigned then.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"No complete checkpoint at {path!r}: it does not exist.")
    if os.path.isdir(path):
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"No complete checkpoint in directory {path!r}.")
        path = found
    meta, arrays = _files.read_file(path)
    include_optimizer = bool(meta.get("include_optimizer", True))
    _state.restore_state(model, meta, arrays, source=path, include_optimizer=include_optimizer)
    return meta


class Checkpoint(keras.callbacks.Callback):
    """Saves the model and optimizer every N steps and/or epochs; keeps the last K and the best.

    Multi-worker safe: every worker gathers the values (so any collective runs
    on all of them), the chief writes `directory/<prefix>-<step>.npz`, other
    workers write to a private temporary directory they delete. Each file is
    written under a new temporary name (created exclusively with a random part,
    so a symlink planted in a shared directory is never written through),
    fsync'ed and renamed once complete, so a crash (even kill -9) mid-write
    leaves the previous checkpoints intact; `latest_checkpoint` finds the
    newest complete one. A failed write (disk full) raises
    `CheckpointWriteError` naming the file, with the temporary file removed.
    Files are named by the optimizer's step (`optimizer.iterations`), so they
    stay ordered across restarts.

    Args:
        directory: where checkpoints go (created if missing); must not be a file.
        every_n_steps: save every this many optimizer steps; None: not by step.
        every_n_epochs: save every this many epochs; None: not by epoch.
        keep: how many of the most recent checkpoints to keep (>= 1).
        monitor: a `logs` key (e.g. "val_loss"); the checkpoint with its best
            value is kept besides the last `keep`. It must be in the epoch-end
            logs.
        mode: "min", "max", or "auto" (max for names containing "acc" or
            "auc", else min).
        include_optimizer: also save the optimizer state.
        prefix: file name prefix.

    Raises:
        ValueError: for a non-positive or non-integer frequency or `keep`, an
            unknown `mode`, or a `directory` that is a file or not writable;
            at the first epoch end, for a `monitor` missing from the logs.
        CheckpointWriteError: during `fit`, when a checkpoint cannot be
            written (disk full, directory not writable), naming the file.

    Example:

    >>> import keras, numpy as np, os, tempfile, tfdist
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> directory = tempfile.mkdtemp()
    >>> ckpt = tfdist.callbacks.Checkpoint(directory, every_n_steps=2, keep=2, monitor="loss")
    >>> _ = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, epochs=2, verbose=0, callbacks=[ckpt])
    >>> os.path.basename(tfdist.callbacks.latest_checkpoint(directory))
    'ckpt-000000008.npz'
    """

    def __init__(
        self,
        directory,
        *,
        every_n_steps: int | None = None,
        every_n_epochs: int | None = 1,
        keep: int = 3,
        monitor: str | None = None,
        mode: str = "auto",
        include_optimizer: bool = True,
        prefix: str = "ckpt",
    ):
        super().__init__()
        _validate.integer("every_n_steps", every_n_steps, allow_none=True)
        _validate.integer("every_n_epochs", every_n_epochs, allow_none=True)
        if every_n_steps is None and every_n_epochs is None:
            raise ValueError("`every_n_steps` and `every_n_epochs` are both None: pass at least one of them.")
        _validate.integer("keep", keep)
        _validate.one_of("mode", mode, _MODES)
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise _validate.invalid("monitor", monitor, "a logs key or None")
        if not isinstance(prefix, str) or not prefix or os.sep in prefix:
            raise _validate.invalid("prefix", prefix, "a file name")
        self.directory = _files.check_writable_dir("directory", directory)
        self.every_n_steps = every_n_steps
        self.every_n_epochs = every_n_epochs
        self.keep = keep
        self.monitor = monitor
        if mode == "auto":
            mode = "max" if monitor and ("acc" in monitor or "auc" in monitor) else "min"
        self.mode = mode
        self.include_optimizer = include_optimizer
        self.prefix = prefix
        self._best: tuple[float, int] | None = None
        self._last_saved_step = self._step_at_last_save = -1
        self._rank = 0  # this worker's index (the chief writes the files)
        self.last_saved: str | None = None

    def _better(self, value: float) -> bool:
        if self._best is None:
            return True
        return value < self._best[0] if self.mode == "min" else value > self._best[0]

    def on_train_begin(self, logs=None):
        self._rank = topology.of(self.model.distribute_strategy).worker_index
        self._step_at_last_save = _step(self.model)
        self._best = None
        if self._rank == 0:
            _files.remove_stale_temps(self.directory)
        if self._rank == 0 and self.monitor:
            for step, path in _files.list_checkpoints(self.directory, self.prefix):
                with contextlib.suppress(ValueError):  # a damaged file: latest_checkpoint warns about it
                    value = _files.read_meta(path).get("monitor_value")
                    if value is not None and self._better(value):
                        self._best = (value, step)

    def on_train_batch_end(self, batch, logs=None):
        if self.every_n_steps is None:
            return
        step = _step(self.model)
        if step // self.every_n_steps > self._step_at_last_save // self.every_n_steps:
            self._save(step, logs, epoch_end=False)

    def on_epoch_end(self, epoch, logs=None):
        if self.monitor and self.monitor not in (logs or {}):
            raise ValueError(
                f"Checkpoint: monitor={self.monitor!r} is not in the epoch-end logs; available: {sorted(logs or {})}."
            )
        if self.every_n_epochs is not None and (epoch + 1) % self.every_n_epochs == 0:
            self._save(_step(self.model), logs, epoch_end=True, epoch=epoch + 1)

    def _save(self, step, logs, *, epoch_end, epoch=None):
        if step == self._last_saved_step and not epoch_end:
            return
        logs = _floats(logs)
        value = logs.get(self.monitor) if self.monitor else None
        if value is not None and not math.isfinite(value):
            value = None
        meta = {
            "step": step,
            "epoch": epoch,
            "logs": logs,
            "monitor": self.monitor,
            "monitor_value": value,
            "include_optimizer": self.include_optimizer,
        }
        with flight.phase("checkpoint", f"step {step}"):
            paths, arrays = _state.collect_state(self.model, include_optimizer=self.include_optimizer)
            path = _files.save(self.directory, self.prefix, step, paths, arrays, meta, rank=self._rank)
        self._last_saved_step = self._step_at_last_save = step
        if path is None:
            return
        self.last_saved = path
        if value is not None and self._better(value):
            self._best = (value, step)
        self._prune()

    def _prune(self):
        files = _files.list_checkpoints(self.directory, self.prefix)
        keep = {step for step, _ in files[-self.keep :]}
        if self._best is not None:
            keep.add(self._best[1])
        for step, path in files:
            if step not in keep:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)

    @property
    def best(self) -> str | None:
        """Path of the checkpoint with the best `monitor` value so far (None without `monitor`)."""
        if self._best is None:
            return None
        return os.path.join(self.directory, _files.checkpoint_name(self.prefix, self._best[1]))


class BackupAndRestore(keras.callbacks.Callback):
    """Drop-in for `keras.callbacks.BackupAndRestore` that resumes at the exact step, on every worker.

    Each worker keeps its own backups in `backup_dir/worker-<rank>/` (no
    shared-file locks), written atomically, the last two kept. At the start of
    `fit` the newest complete backup is restored: weights, optimizer state
    (momentum, step count), the epoch, and the position in the epoch. The
    batches of the interrupted epoch that were already trained on are drawn
    from the input and skipped (not trained on), so training continues with
    the very next batch and ends with the same weights as an uninterrupted
    run. Under a multi-worker strategy the workers first agree (a collective)
    on the newest step all of them hold. Repeated crashes resume each time from
    the latest backup.

    Preemption: with `save_on_preemption`, SIGTERM makes training stop after
    the current step, save a backup and exit the process with status 0
    (`SystemExit(0)`; code after `fit` does not run). Under a multi-worker
    strategy the workers agree on the signal every `preemption_check_steps`
    steps and at epoch ends (one small all-gather, ~5 ms on loopback), so all
    of them save at the same step and exit.

    The data position is recreated, not guessed: the backup records which
    iterator of the dataset Keras was using (Keras makes one per epoch, or one
    for a whole fit over a repeated dataset with `steps_per_epoch`) and how
    many batches were drawn from it; the resumed `fit` makes as many unused
    iterators first (so a `tf.data` pipeline that reshuffles each iteration
    draws the same order) and draws the trained batches again without
    training. Numpy input, `tf.data` with or without
    `reshuffle_each_iteration`, and repeated datasets resume exactly (tested).
    Not reproduced: reshuffling pipelines under ModelParallelStrategy (its
    batches start their tf.data iterator lazily), and inputs whose order
    depends on something else (a Python generator with its own state). The
    metric state of the interrupted epoch is restored too (the compiled
    metrics are built first where Keras has not built them yet, as without a
    strategy), so the resumed epoch's logs (loss, metrics) equal the
    uninterrupted run's, also when the backup was taken at the epoch's last
    batch and the whole epoch is skipped.

    Args:
        backup_dir: directory for the backups (one subdirectory per worker).
        save_freq: "epoch", or an integer N: back up every N optimizer steps.
        double_checkpoint: accepted for compatibility with
            `keras.callbacks.BackupAndRestore` and ignored: the last two
            backups are always kept (what Keras keeps with True), so a damaged
            newest one falls back to the one before.
        delete_checkpoint: delete this worker's backups when training ends
            normally.
        save_on_preemption: save and exit 0 on SIGTERM (handler installed
            during `fit` when `fit` runs in the main thread).
        preemption_check_steps: under a multi-worker strategy, how often (in
            steps) the workers exchange the SIGTERM flag.

    Raises:
        ValueError: for an invalid `save_freq` or `preemption_check_steps`, or a
            `backup_dir` that is a file or not writable.
        CheckpointMismatchError: at the start of `fit`, when the backup was
            written by a different model.

    Example:

    >>> import keras, numpy as np, tempfile, tfdist
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> backup = tfdist.callbacks.BackupAndRestore(tempfile.mkdtemp(), save_freq=2)
    >>> _ = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, epochs=2, verbose=0, callbacks=[backup])
    """


    _PREFIX = "backup"
    _REQUIRED = ("epoch", "batch", "logs")  # metadata keys a backup must hold

    def __init__(
        self,
        backup_dir,
        save_freq="epoch",
        double_checkpoint=False,  # Keras' signature: accepted, ignored (see Args)
        delete_checkpoint=True,
        *,
        save_on_preemption: bool = True,
        preemption_check_steps: int = 1,
    ):
        super().__init__()
        if not backup_dir:
            raise ValueError("Empty `backup_dir` argument passed")
        if save_freq != "epoch" and not _validate.is_integer(save_freq, minimum=1):
            raise _validate.invalid("save_freq", save_freq, "either 'epoch' or a positive integer value")
        if not _validate.is_integer(preemption_check_steps, minimum=1):
            raise _validate.invalid("preemption_check_steps", preemption_check_steps, "a positive integer")
        _compat.install("callbacks")
        self.backup_dir = _files.check_writable_dir("backup_dir", backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.save_on_preemption = save_on_preemption
        self.preemption_check_steps = preemption_check_steps
        self.restored_step: int | None = None
        # Set at the start of each fit:
        self._dir = None  # this worker's backups: backup_dir/worker-<rank>
        self._position: _resume.Position | None = None
        self._preemption: _preemption.Preemption | None = None

    # ------------------------------------------------------------------ start of fit: restore
    def on_train_begin(self, logs=None):
        model = self.model
        if not model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, your model must be built before you call `fit()`. "
                f"Model {model} is unbuilt."
            )
        strategy = model.distribute_strategy
        where = topology.of(strategy)
        self._dir = os.path.join(self.backup_dir, f"worker-{where.worker_index}")
        self._preemption = _preemption.Preemption(
            strategy, enabled=self.save_on_preemption, check_steps=self.preemption_check_steps
        )
        self.restored_step = None
        _files.remove_stale_temps(self._dir)
        found = _resume.agreed_backup(
            strategy, where, self._dir, self._PREFIX, required=self._REQUIRED, hint=self.backup_dir
        )
        self._position = _resume.Position(model)
        if found is not None:
            step, path, meta, arrays = found
            _state.restore_state(model, meta, arrays, source=path)
            self._position.resume(meta)
            self.restored_step = step
        self._position.wrap_train_function()
        self._preemption.start()

    # ------------------------------------------------------------------ during fit: back up, watch for SIGTERM
    def on_epoch_begin(self, epoch, logs=None):
        self._position.epoch_begin(epoch)

    def on_train_batch_end(self, batch, logs=None):
        if not self._position.batch_end(batch):  # the end of a skipped (already trained) batch
            return
        step = _step(self.model)
        if self._preemption.check(step):
            self._save(logs)
            self._exit()
        if self.save_freq != "epoch" and step % self.save_freq == 0:
            self._save(logs)

    def on_epoch_end(self, epoch, logs=None):
        self._position.epoch_end(epoch)
        if self._preemption.check(_step(self.model), epoch_end=True) or self.save_freq == "epoch":
            self._save(logs)
        if self._preemption.requested:
            self._exit()

    # ------------------------------------------------------------------ end of fit
    def on_train_end(self, logs=None):
        self._position.unwrap()
        self._preemption.stop()
        if self.delete_checkpoint:
            shutil.rmtree(self._dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(self.backup_dir)

    # ------------------------------------------------------------------ backups
    def _save(self, logs):
        """Writes this worker's backup of the current step (the last two are kept)."""
        step = _step(self.model)
        with flight.phase("checkpoint", f"backup step {step}"):
            paths, arrays = _state.collect_state(self.model)
            meta = {"step": step, "logs": _floats(logs), **self._position.meta()}
            path = os.path.join(self._dir, _files.checkpoint_name(self._PREFIX, step))
            _files.write_file(path, paths, arrays, meta)
        for _, old in _files.list_checkpoints(self._dir, self._PREFIX)[:-2]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(old)

    def _exit(self):
        position = self._position
        self._preemption.exit(
            f"step {_step(self.model)} (epoch {position.epoch}, batch {position.batches_in_epoch}) to {self._dir}"
        )
