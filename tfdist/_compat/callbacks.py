"""Keras `fit` resuming mid-training, for `tfdist.callbacks.BackupAndRestore`.

`fit` starts at `model._initial_epoch` when set (Keras' own BackupAndRestore
sets it in `on_train_begin`), builds `model.train_function` BEFORE
`on_train_begin`, and looks `self.train_function` up again for every step,
passing it the data iterator. tfdist's BackupAndRestore sets the epoch the same
way, wraps `train_function` to skip the already-trained batches, counts
iterators with the `epoch_iterator` hooks, and builds the compiled metrics from
the batch spec before restoring their state. Install with
`tfdist._compat.install("callbacks")`. Checked on Keras 3.15.
"""

from __future__ import annotations

from keras.src.backend.tensorflow import trainer as keras_tf_trainer

from tfdist._compat._hook import hook
from tfdist._compat._hook import missing_spec_error
from tfdist._compat.epoch_iterator import iterators_created
from tfdist._compat.epoch_iterator import latest_epoch_iterator
from tfdist._compat.epoch_iterator import make_unused_iterators
from tfdist._compat.trainer import batch_spec

__all__ = [
    "build_compiled_state",
    "iterators_created",
    "latest_epoch_iterator",
    "make_unused_iterators",
    "set_initial_epoch",
]


def set_initial_epoch(model, epoch: int | None) -> None:
    """Makes the running (or next) `fit` of `model` start at `epoch` (None: the `initial_epoch` argument)."""
    model._initial_epoch = epoch


def build_compiled_state(model, epoch_iterator) -> None:
    """Builds the compiled metrics and losses of `model` from `epoch_iterator`'s batch spec, reading no data.

    Without a distribution strategy Keras builds them when it first traces the train step; a resumed
    `fit` that skips the trained batches restores their state (and asks for their results) first.
    """
    unbuilt = [m for m in (model._compile_metrics, model._compile_loss) if m is not None and not m.built]
    if not unbuilt:
        return
    data_batch = batch_spec(epoch_iterator)
    if data_batch is None:
        raise missing_spec_error("compiled_state_build", "dataset")
    with model.distribute_strategy.scope():
        model._symbolic_build(data_batch=data_batch)


HOOKS = (
    hook(
        "fit_resume",
        keras_tf_trainer.TensorFlowTrainer.fit,
        (
            "initial_epoch = self._initial_epoch or initial_epoch",
            "epoch_iterator = TFEpochIterator(",
            "self.make_train_function()\n        callbacks.on_train_begin()",
            "logs = self.train_function(iterator)",
        ),
        "callbacks",
    ),
    hook(
        "compiled_state_build",
        keras_tf_trainer.TensorFlowTrainer._symbolic_build,
        ("compile_metrics_unbuilt", "compile_loss_unbuilt", "data_batch = tree.map_structure("),
        "callbacks",
    ),
)
