"""Callbacks that keep workers consistent: `SyncCheck` and `MetricAverage`."""

from __future__ import annotations

import hashlib
import zlib

import keras
import numpy as np

from tfdist import _validate
from tfdist.callbacks import _state
from tfdist.callbacks import _workers
from tfdist.strategies import topology

__all__ = ["MetricAverage", "SyncCheck", "SyncError"]


class SyncError(RuntimeError):
    """Replicas hold different weights, or a weight or the loss is NaN/Inf."""


def _fingerprint(array) -> float:
    """A 48-bit hash of the array's bytes (exact in float64, so it survives a float collective)."""
    digest = hashlib.blake2b(np.asarray(array, order="C").tobytes(), digest_size=6).digest()
    return float(int.from_bytes(digest, "little"))


def _components(strategy, variable):
    """[(where, numpy value)] of every copy of a Keras variable held by this process, grouped by shard.

    Returns a list of groups; the copies in one group must be identical.
    """
    value = variable.value
    layout = getattr(value, "layout", None)
    if layout is not None:  # a DTensor variable: copies are the devices holding the same shard
        from tensorflow.experimental import dtensor

        mesh = layout.mesh
        parts = dtensor.unpack(value.read_value() if hasattr(value, "read_value") else value)
        locations = mesh.local_device_locations()
        groups: dict[tuple, list] = {}
        for location, device, part in zip(locations, mesh.local_devices(), parts):
            key = tuple(location.get(spec, 0) for spec in layout.sharding_specs)
            groups.setdefault(key, []).append((f"device {device}", part.numpy()))
        return list(groups.values())
    local = strategy.experimental_local_results(value)
    return [
        [(getattr(c, "device", f"replica {i}") or f"replica {i}", np.asarray(c.numpy())) for i, c in enumerate(local)]
    ]


class SyncCheck(keras.callbacks.Callback):
    """Every N steps, checks that all replicas and workers hold identical weights and nothing is NaN/Inf.

    Each copy of every variable (model and optimizer) is hashed bit for bit;
    copies within this process are compared directly, and the workers exchange
    their hashes in one all-gather (a collective: every worker runs it at the
    same step, in the same order). On divergence, or a NaN/Inf weight or loss,
    every worker raises `SyncError` naming the variable and the replicas or
    workers involved, which stops `fit`.

    Args:
        every_n_steps: check after every this many optimizer steps (>= 1).
        check_finite: also fail on NaN/Inf weights and loss.

    Raises:
        ValueError: for a non-positive `every_n_steps`.

    Example:

    >>> import keras, numpy as np, tfdist
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> check = tfdist.callbacks.SyncCheck(every_n_steps=2)
    >>> _ = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, verbose=0, callbacks=[check])
    >>> check.checks
    2
    """

    def __init__(self, *, every_n_steps: int = 100, check_finite: bool = True):
        super().__init__()
        _validate.integer("every_n_steps", every_n_steps)
        self.every_n_steps = every_n_steps
        self.check_finite = check_finite
        self.checks = 0
        self._last = 0

    def on_train_begin(self, logs=None):
        self._last = int(self.model.optimizer.iterations.numpy())

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if step // self.every_n_steps > self._last // self.every_n_steps:
            self._last = step
            self.check(step, logs)

    def check(self, step: int | None = None, logs=None) -> None:
        """Runs the check now (on every worker). Raises SyncError on divergence or NaN/Inf."""
        strategy = self.model.distribute_strategy
        variables = list(self.model.variables)
        if self.model.optimizer is not None:
            variables += list(self.model.optimizer.variables)
        paths = _state.state_paths(variables)
        rank = topology.of(strategy).worker_index
        hashes, local_problems = [], []
        for path, variable in zip(paths, variables):
            groups = _components(strategy, variable)
            first_where, first = groups[0][0]
            hashes.append(_fingerprint(first))
            problem = 0.0
            for group in groups:
                base_where, base = group[0]
                differ = [where for where, value in group[1:] if _fingerprint(value) != _fingerprint(base)]
                if differ:
                    local_problems.append(
                        f"variable {path!r} differs between replicas on worker {rank}: {base_where} vs {differ}"
                    )
                    problem = 1.0
                if self.check_finite and np.issubdtype(base.dtype, np.floating) and not np.isfinite(base).all():
                    local_problems.append(f"variable {path!r} holds NaN/Inf on worker {rank} ({base_where})")
                    problem = 1.0
            hashes.append(problem)
        loss = (logs or {}).get("loss")
        bad_loss = self.check_finite and loss is not None and not np.isfinite(np.asarray(loss)).all()
        rows = _workers.all_gather_rows(strategy, [*hashes, float(bad_loss)])
        self.checks += 1
        problems = []
        where = f"at step {step}" if step is not None else "now"
        if rows[:, -1].any():
            problems.append(f"the loss is NaN/Inf on worker(s) {np.flatnonzero(rows[:, -1]).tolist()}")
        for i, path in enumerate(paths):
            column = rows[:, 2 * i]
            if (column != column[0]).any():
                differ = np.flatnonzero(column != column[0]).tolist()
                problems.append(f"variable {path!r} differs between workers: worker 0 vs worker(s) {differ}")
            if rows[:, 2 * i + 1].any() and not local_problems:
                problems.append(
                    f"variable {path!r} is inconsistent or NaN/Inf on worker(s) "
                    f"{np.flatnonzero(rows[:, 2 * i + 1]).tolist()}"
                )
        problems = local_problems + problems
        if problems:
            self.model.stop_training = True
            raise SyncError(f"tfdist SyncCheck {where}: " + "; ".join(problems[:10]))


class MetricAverage(keras.callbacks.Callback):
    """Replaces every numeric value in the epoch logs (and optionally batch logs) with its mean over workers.

    With it, callbacks after it in the list (EarlyStopping, ReduceLROnPlateau,
    Checkpoint's `monitor`) see the same numbers on every worker and decide the
    same thing. Place it BEFORE those callbacks: Keras hands one `logs` dict
    to the callbacks in list order, and this callback edits it in place. Every
    worker must run it (it is a collective); the workers' log keys must match,
    else every worker raises ValueError listing its keys. On one host it
    changes nothing.

    Args:
        batch_logs: also average the logs after every training batch (one
            collective per step).

    Example:

    >>> import keras, numpy as np, tfdist
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> stop = keras.callbacks.EarlyStopping(monitor="loss", patience=2)
    >>> _ = model.fit(np.ones((8, 3)), np.ones((8, 1)), verbose=0,
    ...               callbacks=[tfdist.callbacks.MetricAverage(), stop])
    """

    def __init__(self, *, batch_logs: bool = False):
        super().__init__()
        self.batch_logs = bool(batch_logs)

    def average(self, logs) -> None:
        """Averages the numeric entries of `logs` over workers, in place (a collective)."""
        if logs is None:
            return
        strategy = self.model.distribute_strategy
        if topology.of(strategy).num_workers == 1:
            return
        keys, values = [], []
        for key in sorted(logs):
            try:
                value = float(np.asarray(logs[key]))
            except (TypeError, ValueError):
                continue
            keys.append(key)
            values.append(value)
        signature = zlib.crc32("\0".join(keys).encode()) & 0xFFFFFF
        shape = _workers.all_gather_rows(strategy, [len(keys), signature])
        if (shape != shape[0]).any():
            raise ValueError(
                f"MetricAverage: the workers' logs have different keys (this worker's: {keys}); every worker must "
                "log the same metrics, with the same callbacks before MetricAverage."
            )
        if not keys:
            return
        means = _workers.all_gather_rows(strategy, values).mean(axis=0)
        for key, mean in zip(keys, means):
            logs[key] = float(mean)

    def on_train_batch_end(self, batch, logs=None):
        if self.batch_logs:
            self.average(logs)

    def on_epoch_end(self, epoch, logs=None):
        self.average(logs)
