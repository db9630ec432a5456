"""Keras' loss scaling for distribution: a replica's loss weighted by its share of the global batch.

Keras scales each replica's mean loss by 1 / replicas, so a global batch that
splits unevenly (10 examples over 4 replicas) weights a replica holding 1
example like one holding 3. Under a tfdist strategy whose replica reports its
share (`TfdistExtended._tfdist_replica_share`), the loss is scaled by that
share instead. Checked on Keras 3.15.
"""

from __future__ import annotations

import tensorflow as tf
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.losses import loss as keras_loss

from tfdist._compat._hook import EXACT
from tfdist._compat._hook import hook
from tfdist.strategies import _extended

_original_scale = keras_loss.scale_loss_for_distribution
_original_unscale = keras_loss.unscale_loss_for_distribution


def _share():
    extended = _extended.in_replica()
    return None if extended is None else extended._tfdist_replica_share()


def _scale_loss_for_distribution(value):
    share = _share()
    if share is None:
        return _original_scale(value)
    return value * tf.cast(share, value.dtype)


def _unscale_loss_for_distribution(value):
    share = _share()
    if share is None:
        return _original_unscale(value)
    return tf.math.divide_no_nan(value, tf.cast(share, value.dtype))


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
        "train_step_scaling",
        keras_tf_trainer.TensorFlowTrainer.train_step,
        ("unscale_loss_for_distribution(loss)", "self.optimizer.apply_gradients("),
        *EXACT,
    ),
)
