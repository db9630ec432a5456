"""Keras `Layer.__call__`: a pipeline stage's layers run on the stage's device; a model calls its strategy.

* While `stage_devices({key: device})` is active on a thread (a
  PipelineStrategy step), `Layer.__call__` enters the device of the stage that
  owns the call (a `tf.device` around Keras' own `__call__`), so each stage's
  forward ops run where its weights live; sublayers inherit the scope. A call
  is keyed by its graph node's id: a functional model runs each node through
  `Function._get_operation_for_node`, which records the node for the layer
  call that follows, so two calls of one layer (inside a backbone and at the
  top, as a tied embedding is) can be placed apart, and the layers inside a
  nested functional model are placed one by one. A layer called outside a
  graph (a Sequential without an Input) is keyed by its own id.
  With `compiled_stages()` active as well (a model with `jit_compile=True`),
  each such layer's call is an XLA-compiled function on its stage's device
  (one per layer and device, traced once per step; its gradient is compiled
  too); the losses its layers add and its outputs' Keras masks are carried out
  of the compiled function.
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
_keras_function = keras.src.ops.function.Function
_original_operation_for_node = _keras_function._get_operation_for_node


def stage_devices(devices):
    """While active on this thread, call placement (`{id(node) or id(layer): device}`) and gradient
    colocation apply."""
    return thread_local_scope(_state, "devices", devices)


def staging() -> bool:
    """Whether `stage_devices` is active on this thread."""
    return bool(getattr(_state, "devices", None))


def compiled_stages():
    """While active on this thread (inside `stage_devices`), staged layers' calls are XLA-compiled."""
    return thread_local_scope(_state, "compiled", {})


def _compiled_call(self, device, args, kwargs):
    """`self(*args, **kwargs)` as one XLA-compiled function on `device` (sublayers run inside it)."""
    cache = _state.compiled
    layers = list(self._flatten_layers())

    def body(*a, **kw):
        before = [len(layer._losses) for layer in layers]
        _state.inside = True
        try:
            outputs = _original_layer_call(self, *a, **kw)
        finally:
            _state.inside = False
        masks = tf.nest.map_structure(lambda o: getattr(o, "_keras_mask", None), outputs)
        losses = [list(layer._losses[n:]) for layer, n in zip(layers, before)]
        return outputs, masks, losses

    key = (id(self), device)
    if key not in cache:
        cache[key] = tf.function(body, jit_compile=True, autograph=False)
    before = [len(layer._losses) for layer in layers]
    outputs, masks, losses = cache[key](*args, **kwargs)
    for layer, n, added in zip(layers, before, losses):
        del layer._losses[n:]  # tensors of the compiled function's graph, if its trace added any
        layer._losses.extend(added)

    def with_mask(output, mask):
        if mask is not None:
            output._keras_mask = mask
        return output

    return tf.nest.map_structure(with_mask, outputs, masks)


def _operation_for_node(self, node):
    if getattr(_state, "devices", None):
        _state.node = node  # the call Keras makes next is this node's
    return _original_operation_for_node(self, node)


def _call_key(layer) -> int:
    """This call's placement key: its node's id when a functional graph is running it, else the layer's."""
    node = getattr(_state, "node", None)
    _state.node = None  # the layer's own sublayer calls are not graph nodes
    return id(node) if node is not None and node.operation is layer else id(layer)


def _layer_call(self, *args, **kwargs):
    devices = getattr(_state, "devices", None)
    device = devices.get(_call_key(self)) if devices else None
    if device is not None:
        with tf.device(device):
            if getattr(_state, "compiled", None) is not None and not getattr(_state, "inside", False):
                return _compiled_call(self, device, args, kwargs)
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
        "graph_node_call",
        _keras_function._run_through_graph,
        ("operation = self._get_operation_for_node(node)", "op = operation_fn(operation)", "op(*args, **kwargs)"),
        "pipeline",
        patch=(_keras_function, "_get_operation_for_node", _operation_for_node),
    ),
    hook(
        "model_strategy",
        keras_tf_trainer.TensorFlowTrainer.__init__,
        ("self._distribute_strategy = tf.distribute.get_strategy()",),
        "model_parallel",
    ),
)
