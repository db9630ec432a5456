"""Keras `Layer.__call__`: a pipeline stage's layers run on the stage's device; a model calls its strategy.

* While `stage_devices({id(layer): device})` is active on a thread (a
  PipelineStrategy step), `Layer.__call__` enters the device of the stage that
  owns the layer (a `tf.device` around Keras' own `__call__`), so each stage's
  forward ops run where its weights live; sublayers inherit the scope.
* A Keras model remembers the strategy it was created under
  (`_distribute_strategy`); when that is a tfdist strategy, calling the model
  goes to its `TfdistExtended._tfdist_call_model` with Keras' own `__call__`.
  That is how a custom loop without `strategy.run`, inside the strategy's scope
  or outside it, still builds the model's variables under the strategy.

Elsewhere it is Keras' call. Checked on Keras 3.15.
"""

from __future__ import annotations

import functools
import threading

import keras
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as keras_tf_trainer

from tfdist._compat._hook import hook
from tfdist._compat._hook import thread_local_scope
from tfdist.strategies import _extended

_state = threading.local()
_keras_layer = keras.src.layers.layer.Layer
_original_layer_call = _keras_layer.__call__


def stage_devices(devices):
    """While active on this thread, layer `id -> device` placement and gradient colocation apply."""
    return thread_local_scope(_state, "devices", devices)


def staging() -> bool:
    """Whether `stage_devices` is active on this thread."""
    return bool(getattr(_state, "devices", None))


def _layer_call(self, *args, **kwargs):
    devices = getattr(_state, "devices", None)
    device = devices.get(id(self)) if devices else None
    if device is not None:
        with tf.device(device):
            return _original_layer_call(self, *args, **kwargs)
    extended = _extended.extended_of(getattr(self, "_distribute_strategy", None))
    if extended is None:
        return _original_layer_call(self, *args, **kwargs)
    return extended._tfdist_call_model(self, functools.partial(_original_layer_call, self), args, kwargs)


HOOKS = (
    hook(
        "layer_call",
        _original_layer_call,
        ("def __call__(self, *args, **kwargs):", "super().__call__("),
        "pipeline",
        "model_parallel",
        patch=(_keras_layer, "__call__", _layer_call),
    ),
    hook(
        "model_strategy",
        keras_tf_trainer.TensorFlowTrainer.__init__,
        ("self._distribute_strategy = tf.distribute.get_strategy()",),
        "model_parallel",
    ),
)
