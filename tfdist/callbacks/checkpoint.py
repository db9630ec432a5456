"""Checkpoints that survive crashes and multi-worker training: `Checkpoint`, `BackupAndRestore`."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import sys
import threading
import warnings

import keras
import numpy as np

from tfdist import _validate
from tfdist.callbacks import _state
from tfdist.callbacks._state import CheckpointCorruptWarning
from tfdist.callbacks._state import CheckpointMismatchError
from tfdist.callbacks._state import CheckpointWriteError
from tfdist.strategies import _keras_compat

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


def _strategy(model):
    return model.distribute_strategy


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
    found = _state.newest_valid(os.fspath(directory), prefix)
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
    meta, arrays = _state.read_file(path)
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
        if mode not in _MODES:
            raise ValueError(f"Invalid value for argument `mode`. Received: mode={mode!r}. Expected one of {_MODES}.")
        if monitor is not None and (not isinstance(monitor, str) or not monitor):
            raise ValueError(
                f"Invalid value for argument `monitor`. Received: monitor={monitor!r}. Expected a logs key or None."
            )
        if not isinstance(prefix, str) or not prefix or os.sep in prefix:
            raise ValueError(f"Invalid value for argument `prefix`. Received: prefix={prefix!r}. Expected a file name.")
        self.directory = _state.check_writable_dir("directory", directory)
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
        self._rank = 0
        self.last_saved: str | None = None

    def _better(self, value: float) -> bool:
        if self._best is None:
            return True
        return value < self._best[0] if self.mode == "min" else value > self._best[0]

    def on_train_begin(self, logs=None):
        self._rank, _ = _state.worker_of(_strategy(self.model))
        self._step_at_last_save = _step(self.model)
        self._best = None
        if self._rank == 0:
            _state.remove_stale_temps(self.directory)
        if self._rank == 0 and self.monitor:
            for step, path in _state.list_checkpoints(self.directory, self.prefix):
                with contextlib.suppress(ValueError):  # a damaged file: latest_checkpoint warns about it
                    value = _state.read_meta(path).get("monitor_value")
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
        paths, arrays = _state.collect_state(self.model, include_optimizer=self.include_optimizer)
        meta = {
            "step": step,
            "epoch": epoch,
            "logs": logs,
            "monitor": self.monitor,
            "monitor_value": value,
            "include_optimizer": self.include_optimizer,
        }
        path = _state.save(self.directory, self.prefix, step, paths, arrays, meta, rank=self._rank)
        self._last_saved_step = self._step_at_last_save = step
        if path is None:
            return
        self.last_saved = path
        if value is not None and self._better(value):
            self._best = (value, step)
        self._prune()

    def _prune(self):
        files = _state.list_checkpoints(self.directory, self.prefix)
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
        return os.path.join(self.directory, _state.checkpoint_name(self.prefix, self._best[1]))


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
        double_checkpoint: accepted for Keras compatibility; two backups are
            always kept.
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
        double_checkpoint=False,
        delete_checkpoint=True,
        *,
        save_on_preemption: bool = True,
        preemption_check_steps: int = 1,
    ):
        super().__init__()
        if not backup_dir:
            raise ValueError("Empty `backup_dir` argument passed")
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1):
            raise ValueError(
                f"Invalid value for argument `save_freq`. Received: save_freq={save_freq!r}. "
                "Expected either 'epoch' or a positive integer value."
            )
        if (
            isinstance(preemption_check_steps, bool)
            or not isinstance(preemption_check_steps, int)
            or preemption_check_steps < 1
        ):
            raise ValueError(
                "Invalid value for argument `preemption_check_steps`. Received: "
                f"preemption_check_steps={preemption_check_steps!r}. Expected a positive integer."
            )
        self.preemption_check_steps = preemption_check_steps
        _keras_compat.install_callbacks()
        self.backup_dir = _state.check_writable_dir("backup_dir", backup_dir)
        self.save_freq = save_freq
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        self.save_on_preemption = save_on_preemption
        self._preempted = False
        self._previous_handler = None
        self._epoch = 0
        self._batches_in_epoch = 0
        self._ignore_batch_ends = 0
        self.restored_step: int | None = None

    # ------------------------------------------------------------------ restore
    def on_train_begin(self, logs=None):
        model = self.model
        if not model.built:
            raise ValueError(
                "To use the BackupAndRestore callback, your model must be built before you call `fit()`. "
                f"Model {model} is unbuilt."
            )
        strategy = _strategy(model)
        self._rank, self._num_workers = _state.worker_of(strategy)
        self._dir = os.path.join(self.backup_dir, f"worker-{self._rank}")
        self._preempted = False
        self._epoch, self._batches_in_epoch, self._ignore_batch_ends = 0, 0, 0
        self.restored_step = None
        _state.remove_stale_temps(self._dir)
        found = _state.newest_valid(self._dir, self._PREFIX, required=self._REQUIRED)
        if self._num_workers > 1:
            mine = -1 if found is None else found[0]
            agreed = int(_state.all_gather_rows(strategy, [mine]).min())
            if agreed != mine:
                found = (
                    None
                    if agreed < 0
                    else _state.newest_valid(self._dir, self._PREFIX, max_step=agreed, required=self._REQUIRED)
                )
                if agreed >= 0 and (found is None or found[0] != agreed):
                    raise RuntimeError(
                        f"BackupAndRestore: worker {self._rank} has no intact backup of step {agreed}, the newest "
                        f"step every worker holds (see {self._dir!r}). Delete {self.backup_dir!r} to start over."
                    )
        self._epoch_iterator = _keras_compat.latest_epoch_iterator()
        self._metric_state = None
        self._ordinal, self._drawn, self._extra, self._noop_calls, self._saved_logs = 0, 0, 0, 0, {}
        if found is not None:
            step, path, meta, arrays = found
            _state.restore_state(model, meta, arrays, source=path)
            # The skipped batches never run a train step, which is where Keras builds the compiled
            # metrics without a strategy: build them now, so their state is restored and read back.
            _keras_compat.build_compiled_state(model, self._epoch_iterator)
            self.restored_step = step
            self._epoch, self._batches_in_epoch = meta["epoch"], meta["batch"]
            _keras_compat.set_initial_epoch(model, self._epoch)
            self._plan_data_position(meta)
            if self._batches_in_epoch:
                self._metric_state = meta.get("metrics")
        self._wrap_train_function()
        self._install_signal_handler()

    def _plan_data_position(self, meta):
        """Recreates the data position of the backup: which iterator of the dataset, how far into it.

        Keras makes a new iterator of the dataset per epoch (plus one at each
        epoch end), or one for the whole fit (a repeated dataset with
        `steps_per_epoch`); a reshuffling tf.data pipeline draws a new order
        for each. The backup records the ordinal of the iterator in use, the
        batches drawn from it and how many iterators existed; here as many
        unused iterators are made as came before that one, and the wrapped
        train function draws the trained batches again without training.
        """
        per_call = max(1, int(self.model.steps_per_execution))
        batch = meta["batch"]
        position = meta.get("iterator")
        self._noop_calls = batch // per_call
        self._saved_logs = dict(meta["logs"])
        if self._epoch_iterator is None or position is None:
            return
        if batch == 0 and position["created"] > position["ordinal"]:  # the next epoch gets a new iterator
            target, self._extra = position["created"] + 1, 0
        else:  # the epoch continues with the backup's iterator
            target, self._extra = position["ordinal"], position["drawn"] - batch
        unused = target - 1 - _keras_compat.iterators_created(self._epoch_iterator)
        if unused < 0:
            warnings.warn(
                f"BackupAndRestore: fit made {-unused} more iterators of the dataset than the run that wrote the "
                "backup; a dataset that reshuffles each iteration will give the resumed epoch another order.",
                stacklevel=3,
            )
        _keras_compat.make_unused_iterators(self._epoch_iterator, max(0, unused))

    def _wrap_train_function(self):
        """Counts the batches drawn from the current iterator; skips the ones a resumed run trained on."""
        model = self.model
        original = getattr(model.train_function, "_tfdist_original", model.train_function)
        per_call = max(1, int(model.steps_per_execution))

        def draw(iterator, count):
            for _ in range(count):
                next(iterator)
            self._drawn += count

        def train_function(iterator):
            created = _keras_compat.iterators_created(self._epoch_iterator)
            if created != self._ordinal:  # Keras started a new iterator of the dataset
                self._ordinal, self._drawn = created, 0
            if self._extra:
                draw(iterator, self._extra)
                self._extra = 0
            if self._noop_calls:
                self._noop_calls -= 1
                self._ignore_batch_ends += 1
                draw(iterator, per_call)
                return self._saved_logs
            logs = original(iterator)
            self._drawn += per_call
            return logs

        train_function._tfdist_original = original
        model.train_function = train_function

    # ------------------------------------------------------------------ save
    def on_epoch_begin(self, epoch, logs=None):
        if epoch != self._epoch:
            self._batches_in_epoch = 0
        self._epoch = epoch
        if self._metric_state is not None:  # Keras reset the metrics just before; the epoch continues
            _state.set_metric_state(self.model, self._metric_state)
            self._metric_state = None

    def on_train_batch_end(self, batch, logs=None):
        if self._ignore_batch_ends:  # the end of a skipped (already trained) batch
            self._ignore_batch_ends -= 1
            return
        self._batches_in_epoch = batch + 1
        if self._check_preempted():
            self._save(logs)
            self._exit()
        if self.save_freq != "epoch" and _step(self.model) % self.save_freq == 0:
            self._save(logs)

    def on_epoch_end(self, epoch, logs=None):
        self._epoch, self._batches_in_epoch = epoch + 1, 0
        if self._check_preempted(epoch_end=True) or self.save_freq == "epoch":
            self._save(logs)
        if self._preempted:
            self._exit()

    def on_train_end(self, logs=None):
        self.model.train_function = getattr(self.model.train_function, "_tfdist_original", self.model.train_function)
        self._restore_signal_handler()
        _keras_compat.set_initial_epoch(self.model, None)
        if self.delete_checkpoint:
            shutil.rmtree(self._dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(self.backup_dir)

    def _save(self, logs):
        step = _step(self.model)
        paths, arrays = _state.collect_state(self.model)
        meta = {
            "step": step,
            "epoch": self._epoch,
            "batch": self._batches_in_epoch,
            "logs": _floats(logs),
            "metrics": _state.metric_state(self.model) if self._batches_in_epoch else None,
        }
        if self._epoch_iterator is not None:
            meta["iterator"] = {
                "ordinal": self._ordinal,
                "drawn": self._drawn,
                "created": _keras_compat.iterators_created(self._epoch_iterator),
            }
        _state.write_file(os.path.join(self._dir, _state.checkpoint_name(self._PREFIX, step)), paths, arrays, meta)
        for _, old in _state.list_checkpoints(self._dir, self._PREFIX)[:-2]:
            with contextlib.suppress(FileNotFoundError):
                os.remove(old)

    # ------------------------------------------------------------------ preemption
    def _install_signal_handler(self):
        if not self.save_on_preemption or threading.current_thread() is not threading.main_thread():
            return

        def handler(signum, frame):
            self._preempted = True

        self._previous_handler = signal.signal(signal.SIGTERM, handler)

    def _restore_signal_handler(self):
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None

    def _check_preempted(self, *, epoch_end: bool = False) -> bool:
        if not self.save_on_preemption:
            return False
        due = epoch_end or _step(self.model) % self.preemption_check_steps == 0
        if self._num_workers > 1 and due:  # every worker learns of any worker's SIGTERM at the same step
            self._preempted = bool(_state.all_gather_rows(_strategy(self.model), [float(self._preempted)]).max())
        return self._preempted

    def _exit(self):
        self._restore_signal_handler()
        print(
            f"tfdist BackupAndRestore: SIGTERM received; saved step {_step(self.model)} "
            f"(epoch {self._epoch}, batch {self._batches_in_epoch}) to {self._dir}; exiting with status 0.",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(0)
