"""Keras `Layer.__call__`: a pipeline stage's layers run on the stage's device.

While `stage_devices({id(layer): device})` is active on a thread (a
PipelineStrategy step), `Layer.__call__` enters the device of the stage that
owns the layer (a `tf.device` around Keras' own `__call__`), so each stage's
forward ops run where its weights live; sublayers inherit the scope. Elsewhere
it is Keras' call. Checked on Keras 3.15.
"""

from __future__ import annotations

import threading

import keras
import tensorflow as tf

from tfdist._compat._hook import hook
from tfdist._compat._hook import thread_local_scope

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
    if device is None:
        return _original_layer_call(self, *args, **kwargs)
    with tf.device(device):
        return _original_layer_call(self, *args, **kwargs)


HOOKS = (
    hook(
        "layer_call",
        _original_layer_call,
        ("def __call__(self, *args, **kwargs):", "super().__call__("),
        "pipeline",
        patch=(_keras_layer, "__call__", _layer_call),
    ),
)
