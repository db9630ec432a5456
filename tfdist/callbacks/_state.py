"""Training state on disk and between workers: the machinery behind tfdist's callbacks.

A checkpoint is ONE file, `<prefix>-<step>.npz`: an uncompressed zip of one
`.npy` member per variable plus a `__meta__` JSON member (variable paths and
shapes, step, epoch, logs). The writer follows TensorFlow's
`distributed_file_utils`: every worker gathers the values (so anything
collective runs everywhere), the chief writes into the real directory, other
workers into a temporary directory of their own that they delete. A file is
written under a hidden temporary name, flushed, fsync'ed and renamed
(`os.replace`), so a crash leaves either the previous set of checkpoints or the
new complete one, never a half file under a checkpoint name. Readers check the
zip's CRCs and skip damaged files with a warning naming them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
import zipfile

import numpy as np
import tensorflow as tf

_META = "__meta__"
FORMAT = "tfdist-checkpoint-1"


class CheckpointCorruptWarning(UserWarning):
    """A checkpoint file was skipped because it is truncated or corrupt."""


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model it is restored into."""


# ------------------------------------------------------------------ workers
def worker_of(strategy) -> tuple[int, int]:
    """(rank, number of workers) of this process under `strategy`; (0, 1) on one host."""
    cluster = getattr(strategy, "cluster", None)
    if cluster is not None and getattr(cluster, "num_workers", 1) > 1:
        return cluster.rank, cluster.num_workers
    resolver = getattr(strategy, "cluster_resolver", None)
    extended = getattr(strategy, "extended", None)
    if resolver is not None and getattr(extended, "_num_workers", 1) > 1:
        return int(resolver.task_id or 0), int(extended._num_workers)
    return 0, 1


def all_gather_rows(strategy, row) -> np.ndarray:
    """Every worker's `row` (a float64 vector of the same length on all workers), shape [workers, len].

    A collective under a multi-worker strategy: every worker must call it, in
    the same order. On one host it returns `row[None]` and communicates nothing.
    The all-gather is traced once per strategy and row length (an eager one
    costs ~50 ms; traced, ~1-2 ms on loopback).
    """
    row = np.asarray(row, np.float64).reshape(1, -1)
    _, num_workers = worker_of(strategy)
    if num_workers == 1:
        return row
    gathered = _gather_function(strategy, row.shape[1])(tf.constant(row)).numpy()
    per_worker = gathered.shape[0] // num_workers  # each worker's local replicas sent the same row
    return gathered[::per_worker]


_GATHER_FUNCTIONS: dict = {}


def _gather_function(strategy, length: int):
    key = (id(strategy), length)
    if key not in _GATHER_FUNCTIONS:

        @tf.function(input_signature=[tf.TensorSpec([1, length], tf.float64)])
        def gather(value):
            return strategy.gather(strategy.run(lambda: tf.identity(value)), axis=0)

        _GATHER_FUNCTIONS[key] = gather
    return _GATHER_FUNCTIONS[key]


# ------------------------------------------------------------------ variables
def _keras_variables(model, include_optimizer: bool):
    variables = list(model.variables)
    if include_optimizer and model.optimizer is not None:
        if not model.optimizer.built:
            with model.distribute_strategy.scope():
                model.optimizer.build(model.trainable_variables)
        variables += list(model.optimizer.variables)
    return variables


def state_paths(variables) -> list[str]:
    """The variables' Keras paths, made unique by a `#n` suffix where Keras repeats one."""
    seen: dict[str, int] = {}
    paths = []
    for v in variables:
        path = v.path
        seen[path] = seen.get(path, 0) + 1
        paths.append(path if seen[path] == 1 else f"{path}#{seen[path]}")
    return paths


def collect_state(model, *, include_optimizer: bool = True):
    """(paths, numpy values) of the model's variables (and its optimizer's), in a fixed order."""
    variables = _keras_variables(model, include_optimizer)
    return state_paths(variables), [np.asarray(v.numpy()) for v in variables]


_UNIQUE_SUFFIX = re.compile(r"_\d+(?=$|/|_)")


def _structural(path: str) -> str:
    """A path without Keras' uniquifying suffixes ("sequential_1/dense_2/kernel" -> "sequential/dense/kernel")."""
    return _UNIQUE_SUFFIX.sub("", path)


def restore_state(model, meta: dict, arrays, *, source: str, include_optimizer: bool = True) -> None:
    """Assigns checkpoint values to the model's variables after checking they fit.

    Variables match by position, path and shape; a path matches when it is the
    same up to the `_<n>` suffixes Keras adds to repeated names (a second model
    built in the same process is "sequential_1/dense_2/...").

    Raises:
        CheckpointMismatchError: naming the first variable whose path or shape
            differs, or the count when one side has more variables.
    """
    variables = _keras_variables(model, include_optimizer)
    paths = state_paths(variables)
    saved_paths, saved_shapes = meta["paths"], [tuple(s) for s in meta["shapes"]]
    for i, (v, path) in enumerate(zip(variables, paths)):
        if i >= len(saved_paths):
            break
        if _structural(path) != _structural(saved_paths[i]) or tuple(v.shape) != saved_shapes[i]:
            raise CheckpointMismatchError(
                f"Checkpoint {source} does not fit this model: variable #{i} is {path!r} with shape "
                f"{tuple(v.shape)} in the model but {saved_paths[i]!r} with shape {saved_shapes[i]} in the "
                "checkpoint. Restore a checkpoint written by the same model (and optimizer)."
            )
    if len(saved_paths) != len(paths):
        extra = paths[len(saved_paths)] if len(paths) > len(saved_paths) else saved_paths[len(paths)]
        raise CheckpointMismatchError(
            f"Checkpoint {source} does not fit this model: the model has {len(paths)} variables, the checkpoint "
            f"{len(saved_paths)} (first unmatched: {extra!r}). Restore a checkpoint written by the same model "
            "(and optimizer)."
        )
    for v, value in zip(variables, arrays):
        v.assign(value)


def metric_state(model) -> list:
    """Every metric variable's value on each local replica (its unreduced, per-replica part), as lists."""
    strategy = model.distribute_strategy
    return [
        [np.asarray(part.numpy()).tolist() for part in strategy.experimental_local_results(v.value)]
        for v in model.metrics_variables
    ]


def set_metric_state(model, state) -> None:
    """Restores what `metric_state` returned into the model's metric variables (same layout only)."""
    strategy = model.distribute_strategy
    variables = list(model.metrics_variables)
    if state is None or len(state) != len(variables):
        return
    for v, parts in zip(variables, state):
        local = strategy.experimental_local_results(v.value)
        if len(local) != len(parts):
            return
        for part, value in zip(local, parts):
            part.assign(np.asarray(value, dtype=part.dtype.as_numpy_dtype))


# ------------------------------------------------------------------ files
def checkpoint_name(prefix: str, step: int) -> str:
    return f"{prefix}-{step:09d}.npz"


def list_checkpoints(directory: str, prefix: str) -> list[tuple[int, str]]:
    """(step, path) of the files named like checkpoints in `directory`, oldest first (unvalidated)."""
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)\.npz$")
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(directory, n)) for n in names if (m := pattern.match(n))]
    return sorted(found)


def _fsync_dir(directory: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_file(path: str, paths, arrays, meta: dict) -> int:
    """Writes one checkpoint file atomically (temp name, fsync, rename); returns its size in bytes."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    meta = {
        **meta,
        "format": FORMAT,
        "paths": list(paths),
        "shapes": [list(a.shape) for a in arrays],
        "dtypes": [str(a.dtype) for a in arrays],
    }
    temp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(temp, "wb") as f:
            with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
                z.writestr(_META, json.dumps(meta))
                for i, a in enumerate(arrays):
                    with z.open(f"{i:06d}.npy", "w", force_zip64=True) as member:
                        np.lib.format.write_array(member, np.asarray(a, order="C"), allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        size = os.path.getsize(temp)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temp)
        raise
    _fsync_dir(directory)
    return size


def remove_stale_temps(directory: str) -> None:
    """Deletes temporary files that interrupted writes left in `directory` (call before writing there)."""
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            if name.startswith(".") and ".npz.tmp-" in name:
                with contextlib.suppress(OSError):
                    os.remove(os.path.join(directory, name))


def read_meta(path: str) -> dict:
    """The metadata of a checkpoint file (reads only its `__meta__` member)."""
    with zipfile.ZipFile(path) as z:
        return json.loads(z.read(_META))


def read_file(path: str) -> tuple[dict, list[np.ndarray]]:
    """(metadata, arrays) of a checkpoint file, every member's CRC checked as it is read.

    Raises:
        ValueError: when the file is truncated or corrupt (bad zip, CRC
            mismatch, missing members), naming the file.
    """
    try:
        with zipfile.ZipFile(path) as z:
            meta = json.loads(z.read(_META))
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r} is not {FORMAT!r}")
            arrays = []
            for i in range(len(meta["paths"])):
                with z.open(f"{i:06d}.npy") as member:
                    arrays.append(np.lib.format.read_array(member, allow_pickle=False))
                    if member.read(1):  # also reaches the member's end, where zipfile checks its CRC
                        raise ValueError(f"member {i:06d}.npy holds more bytes than its array")
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint {path} is truncated or corrupt: {e}") from e
    return meta, arrays


def newest_valid(directory: str, prefix: str, *, max_step: int | None = None):
    """(step, path, meta, arrays) of the newest readable checkpoint, warning about each damaged one; else None."""
    for step, path in reversed(list_checkpoints(directory, prefix)):
        if max_step is not None and step > max_step:
            continue
        try:
            meta, arrays = read_file(path)
        except ValueError as e:
            warnings.warn(f"Skipping {e}", CheckpointCorruptWarning, stacklevel=3)
            continue
        return step, path, meta, arrays
    return None


def check_writable_dir(name: str, directory) -> str:
    """Validates a checkpoint directory argument: a path that is (or can become) a writable directory."""
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise ValueError(
            f"Invalid value for argument `{name}`. Received: {name}={directory!r}. Expected a directory path."
        )
    directory = os.fspath(directory)
    existing = directory
    while not os.path.exists(existing):
        parent = os.path.dirname(os.path.abspath(existing))
        if parent == os.path.abspath(existing):
            break
        existing = parent
    if os.path.exists(existing) and not os.path.isdir(existing):
        raise ValueError(
            f"Invalid value for argument `{name}`: {existing!r} is a file, not a directory "
            f"({name}={directory!r}). Pass a directory path."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"Invalid value for argument `{name}`: directory {existing!r} is not writable by this process "
            f"({name}={directory!r}). Pass a writable directory."
        )
    return directory


def save(directory: str, prefix: str, step: int, paths, arrays, meta: dict, *, rank: int) -> str | None:
    """Writes a checkpoint the multi-worker-safe way; returns the real path on the chief, else None.

    The chief (rank 0) writes `directory/<prefix>-<step>.npz`; another worker
    writes the same bytes into `directory/.worker-<rank>-tmp/` and deletes it,
    as TensorFlow's `distributed_file_utils` does.
    """
    name = checkpoint_name(prefix, step)
    if rank == 0:
        path = os.path.join(directory, name)
        write_file(path, paths, arrays, meta)
        return path
    temp_dir = os.path.join(directory, f".worker-{rank}-tmp")
    try:
        write_file(os.path.join(temp_dir, name), paths, arrays, meta)
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
    return None


def data_parallel_size(strategy) -> int:
    """How many ways the batch is split: replicas in sync, or the batch-axis size of a DTensor mesh."""
    mesh_shape = getattr(strategy, "mesh_shape", None)
    batch_axis = getattr(strategy, "batch_axis", None)
    if isinstance(mesh_shape, dict) and batch_axis in mesh_shape:
        return int(mesh_shape[batch_axis])
    return int(strategy.num_replicas_in_sync)
