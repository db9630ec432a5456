"""The model's training state: its variables' values (and its optimizer's) in a fixed order, and back.

Values are plain numpy arrays named by the variables' Keras paths, so the
checkpoint file format (`_files`) needs nothing of Keras or TensorFlow.
"""

from __future__ import annotations

import re

import numpy as np


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model it is restored into."""


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

    Variables match by position, path, shape and dtype; a path matches when it
    is the same up to the `_<n>` suffixes Keras adds to repeated names (a
    second model built in the same process is "sequential_1/dense_2/...").
    Nothing is assigned unless every variable fits.

    Raises:
        CheckpointMismatchError: naming the checkpoint file and the first
            variable whose path, shape or dtype differs, or the count when one
            side has more variables.
    """
    variables = _keras_variables(model, include_optimizer)
    paths = state_paths(variables)
    saved_paths = meta["paths"]
    for i, (v, path, saved_path, value) in enumerate(zip(variables, paths, saved_paths, arrays)):
        shape, dtype = tuple(v.shape), np.dtype(v.dtype)
        if _structural(path) != _structural(saved_path) or shape != value.shape or dtype != value.dtype:
            raise CheckpointMismatchError(
                f"Checkpoint {source} does not fit this model: variable #{i} is {path!r} with shape {shape} and "
                f"dtype {dtype} in the model but {saved_path!r} with shape {value.shape} and dtype {value.dtype} "
                "in the checkpoint. Restore a checkpoint written by the same model (and optimizer)."
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
