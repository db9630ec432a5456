"""Every private TensorFlow / Keras internal tfdist hooks, in one registry: patches only, no behaviour of their own.

Each module covers one TensorFlow/Keras target and lists its `Hook`s: what it
replaces, the source it checks (its probe) and the features that need it.
`install(feature)` checks and applies exactly the hooks of one feature, once:

| feature              | needed by                         | hooks                                                     |
|----------------------|-----------------------------------|-----------------------------------------------------------|
| "data_parallel"      | DataParallelStrategy              | loss_scaling, optimizer, lazy_build, trainer, mirrored,   |
|                      |                                   | multi_device_iterator, batch_statistics (+ KerasHub MoE   |
|                      |                                   | hooks when trained), layer_losses                         |
| "multi_worker"       | MultiWorkerStrategy               | data_parallel's + trainer, step_deadline, keras_callbacks |
| "model_parallel"     | ModelParallelStrategy             | trainer, variables, dtensor, spmd_ops, optimizer,         |
|                      |                                   | sparse_ops, layer_call, deferred_variables,               |
|                      |                                   | step_deadline, keras_callbacks (across processes)         |
| "pipeline"           | PipelineStrategy                  | data_parallel's + variables, layer_call, gradients, ...   |
| "callbacks"          | tfdist.callbacks.BackupAndRestore | epoch_iterator, callbacks                                 |
| "keras_distribution" | tfdist.use_keras_distribution     | keras_distribution                                        |
| "step_stats"         | tfdist.callbacks.StepStats        | step_timing (checks only)                                 |

A hook acts only when the running strategy's `extended` (for a model call, or an
optimizer step outside a replica context: the strategy the model or optimizer
was created under) is a `tfdist.strategies._extended.TfdistExtended` and asks
it what to do (see that module); under any other strategy Keras keeps its
behaviour ("keras_distribution" hands `keras.distribution.set_distribution` to
`tfdist.keras_distribution`, which a user opts into). A probe that no
longer matches raises `tfdist.CompatError` naming the hook, at install time.

Example:

>>> from tfdist import _compat
>>> _compat.install("data_parallel")
>>> _compat.installed("data_parallel")
True
>>> sorted(_compat.FEATURES)
['callbacks', 'data_parallel', 'keras_distribution', 'model_parallel', 'multi_worker', 'pipeline', 'step_stats']
"""

from __future__ import annotations

import threading

from tfdist import _validate
from tfdist import errors
from tfdist._compat import batch_statistics
from tfdist._compat import callbacks
from tfdist._compat import deferred_variables
from tfdist._compat import dtensor
from tfdist._compat import epoch_iterator
from tfdist._compat import gradients
from tfdist._compat import keras_callbacks
from tfdist._compat import keras_distribution
from tfdist._compat import layer_call
from tfdist._compat import layer_losses
from tfdist._compat import lazy_build
from tfdist._compat import loss_scaling
from tfdist._compat import mirrored
from tfdist._compat import multi_device_iterator
from tfdist._compat import optimizer
from tfdist._compat import sparse_ops
from tfdist._compat import spmd_ops
from tfdist._compat import step_deadline
from tfdist._compat import step_timing
from tfdist._compat import trainer
from tfdist._compat import variables
from tfdist._compat._hook import CHECKED_ON
from tfdist._compat._hook import Hook
from tfdist._compat._hook import versions_match

__all__ = ["CHECKED_ON", "FEATURES", "HOOKS", "CompatError", "Hook", "check_hooks", "install", "installed"]

CompatError = errors.CompatError
FEATURES = (
    "data_parallel", "multi_worker", "model_parallel", "pipeline", "callbacks", "keras_distribution", "step_stats",
)

HOOKS: tuple[Hook, ...] = (
    *loss_scaling.HOOKS,
    *optimizer.HOOKS,
    *lazy_build.HOOKS,
    *trainer.HOOKS,
    *mirrored.HOOKS,
    *multi_device_iterator.HOOKS,
    *step_deadline.HOOKS,
    *variables.HOOKS,
    *deferred_variables.HOOKS,
    *dtensor.HOOKS,
    *spmd_ops.HOOKS,
    *sparse_ops.HOOKS,
    *layer_call.HOOKS,
    *gradients.HOOKS,
    *epoch_iterator.HOOKS,
    *callbacks.HOOKS,
    *keras_callbacks.HOOKS,
    *keras_distribution.HOOKS,
    *step_timing.HOOKS,
    *batch_statistics.HOOKS,
    *layer_losses.HOOKS,
)
"""The registry: every hook once. `install` and `check_hooks` read it when called."""

_lock = threading.Lock()
_installed: set[str] = set()


def hooks_for(feature: str) -> tuple[Hook, ...]:
    """The hooks `feature` needs, in registry order."""
    _validate.one_of("feature", feature, FEATURES)
    return tuple(h for h in HOOKS if feature in h.features)


def install(feature: str) -> None:
    """Checks, then applies, the hooks `feature` needs (once per process).

    Raises:
        CompatError: naming the first hook whose TensorFlow/Keras code changed.
        ValueError: for a feature not in `FEATURES`.
    """
    hooks = hooks_for(feature)
    with _lock:
        if feature in _installed:
            return
        for h in hooks:
            h.check()
        for h in hooks:
            h.apply()
        _installed.add(feature)


def installed(feature: str) -> bool:
    """True once `install(feature)` ran and its patches are still in place."""
    return feature in _installed and all(h.patched for h in hooks_for(feature))


def check_hooks() -> None:
    """Raises CompatError if any registered hook's TensorFlow/Keras code changed shape (installs nothing)."""
    for h in HOOKS:
        h.check()


__all__ += ["hooks_for", "versions_match"]
