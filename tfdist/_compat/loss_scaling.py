"""Keras' loss scaling for distribution: a replica's loss weighted by its share of the global batch.

Keras scales each replica's mean loss by 1 / replicas, so a global batch that
splits unevenly (10 examples over 4 replicas) weights a replica holding 1
example like one holding 3. Under a tfdist strategy whose replica reports its
share (`TfdistExtended._tfdist_replica_share`), the loss is scaled by that
share instead.

The logged loss of a custom `train_step` / `test_step` (Keras' "customizing
what happens in fit" guide: `self.loss_tracker.update_state(loss)` with a
`keras.metrics.Mean`). Its metric variables are summed over replicas when
read, so under any MirroredStrategy it logs the scaled loss summed over the
replicas divided by the number of replicas: 1 / replicas of one device's loss
(1 / micro-batches in a pipeline). Keras' own `train_step` unscales the loss
and weights it by the batch size; a tfdist replica does the same for every
scalar a `Mean` receives without a `sample_weight` inside a step: it is
weighted by the replica's share of the global batch, and unscaled first when
it was computed from a loss scaled here (the scaled loss, or sums and
multiples of it, before any unscaling), so the logged value is one device's.
Checked on Keras 3.15.
"""

from __future__ import annotations

import threading

import numpy as np
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.losses import loss as keras_loss
from keras.src.metrics import reduction_metrics

from tfdist._compat._hook import EXACT
from tfdist._compat._hook import hook
from tfdist.strategies import _extended

_original_scale = keras_loss.scale_loss_for_distribution
_original_unscale = keras_loss.unscale_loss_for_distribution


def _share():
    extended = _extended.in_replica()
    return None if extended is None else extended._tfdist_replica_share()


class _Scaled(threading.local):
    """The losses this thread's step (its share: one replica's, or micro-batch's, part) scaled and unscaled."""

    share = None
    scaled: list = []
    unscaled: list = []


_scaled = _Scaled()


def _record(share, kind: str, value):
    if _scaled.share is not share:
        _scaled.share, _scaled.scaled, _scaled.unscaled = share, [], []
    getattr(_scaled, kind).append(value)
    return value


def _scale_loss_for_distribution(value):
    share = _share()
    if share is None:
        return _original_scale(value)
    return _record(share, "scaled", value * tf.cast(share, value.dtype))


def _unscale_loss_for_distribution(value):
    share = _share()
    if share is None:
        return _original_unscale(value)
    return _record(share, "unscaled", tf.math.divide_no_nan(value, tf.cast(share, value.dtype)))


def from_scaled_loss(value, share) -> bool:
    """Whether `value` was computed in this step from a loss scaled by `share`, before any unscaling.

    In a traced step, its graph inputs are followed back to a scaled loss (a
    path through an unscaled one does not count); eagerly, only the scaled loss
    itself is recognized.
    """
    if _scaled.share is not share or not _scaled.scaled:
        return False
    if tf.executing_eagerly() or not isinstance(value, tf.Tensor):
        return any(value is t for t in _scaled.scaled)
    scaled = {id(t.op) for t in _scaled.scaled}
    stops = {id(t.op) for t in _scaled.unscaled}
    stack, seen = [value.op], set()
    while stack:
        op = stack.pop()
        if id(op) in scaled:
            return True
        if id(op) in seen or id(op) in stops:
            continue
        seen.add(id(op))
        stack.extend(t.op for t in op.inputs)
    return False


_original_mean_update_state = reduction_metrics.Mean.update_state


def _rank(values):
    return values.shape.rank if isinstance(values, tf.Tensor) else np.ndim(values)


def _mean_update_state(self, values, sample_weight=None):
    share = _share() if sample_weight is None else None
    if share is None or _rank(values) != 0:
        return _original_mean_update_state(self, values, sample_weight)
    weight = tf.cast(share, self.dtype)
    if from_scaled_loss(values, share):
        values = tf.math.divide_no_nan(tf.cast(values, self.dtype), weight)
    return _original_mean_update_state(self, values, weight)


HOOKS = (
    hook(
        "loss_scaling",
        keras_loss.scale_loss_for_distribution,
        ("num_replicas_in_sync",),
        *EXACT,
        patch=(keras_loss, "scale_loss_for_distribution", _scale_loss_for_distribution),
    ),
    hook(
        "loss_unscaling",
        keras_loss.unscale_loss_for_distribution,
        ("num_replicas_in_sync",),
        *EXACT,
        patch=(keras_loss, "unscale_loss_for_distribution", _unscale_loss_for_distribution),
    ),
    hook("loss_reduction", keras_loss.reduce_values, ("scale_loss_for_distribution(loss)",), *EXACT),
    hook(
        "logged_loss",
        _original_mean_update_state,
        ("reduce_to_samplewise_values(", "num_samples = 1", "self.count.assign_add("),
        *EXACT,
        patch=(reduction_metrics.Mean, "update_state", _mean_update_state),
    ),
    hook(
        "train_step_scaling",
        keras_tf_trainer.TensorFlowTrainer.train_step,
        ("unscale_loss_for_distribution(loss)", "self.optimizer.apply_gradients("),
        *EXACT,
    ),
)
