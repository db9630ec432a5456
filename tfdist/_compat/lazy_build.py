"""Keras' lazy builds inside a traced step: a layer's weights and an optimizer's slots created eagerly.

A model without an `Input` builds each layer on its first call, and an optimizer
builds its slots on its first `apply_gradients`. When that first call is inside
a `tf.function` under a mirrored strategy (TensorFlow's custom-training shape:
`strategy.run(train_step)` in a `tf.function`), the new MirroredVariables'
replica initializers read the primary inside the traced graph, and the first
run fails: "You must feed a value for placeholder tensor 'cond/Placeholder'"
(plain MirroredStrategy fails the same way). Under a tfdist strategy the build
is handed to `TfdistExtended._tfdist_build_eagerly`, which runs it once outside
the graph, and the traced step then uses the variables like any built model's.
The build sees Keras' name scope of the thread that asked for it, so variable
paths are the ones a build on one device gives. Checked on Keras 3.15.
"""

from __future__ import annotations

import copy

import keras
import tensorflow as tf
from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.common.symbolic_scope import in_symbolic_scope
from keras.src.optimizers import base_optimizer as keras_base_optimizer

from tfdist._compat._hook import EXACT
from tfdist._compat._hook import hook
from tfdist.strategies import _extended

_keras_layer = keras.src.layers.layer.Layer
_original_maybe_build = _keras_layer._maybe_build
_NAME_SCOPE_STACK = "name_scope_stack"


def _builder():
    """The running tfdist strategy's extended when a build would happen inside a traced function, else None.

    Keras' own symbolic builds (stateless or symbolic scope, as `fit` does first) are left to Keras.
    """
    if tf.executing_eagerly() or in_stateless_scope() or in_symbolic_scope():
        return None
    return _extended.extended_of(tf.distribute.get_strategy())


def _in_keras_scope(build):
    """`build`, run later (maybe on another thread) inside this thread's current Keras name scope."""
    stack = list(global_state.get_global_attribute(_NAME_SCOPE_STACK, default=None) or ())

    def scoped():
        saved = global_state.get_global_attribute(_NAME_SCOPE_STACK, default=None)
        global_state.set_global_attribute(_NAME_SCOPE_STACK, list(stack))
        try:
            return build()
        finally:
            global_state.set_global_attribute(_NAME_SCOPE_STACK, saved)

    return scoped


def _symbolic(value):
    """A graph tensor's shape and dtype as a KerasTensor (what a build reads); anything else as it is."""
    if isinstance(value, tf.Tensor) and not isinstance(value, keras.KerasTensor):
        return keras.KerasTensor(value.shape, dtype=value.dtype.name)
    return value


def _symbolic_call_spec(call_spec):
    spec = copy.copy(call_spec)
    for name in ("arguments_dict", "tensor_arguments_dict", "user_arguments_dict"):
        setattr(spec, name, {k: tf.nest.map_structure(_symbolic, v) for k, v in getattr(call_spec, name).items()})
    spec.first_arg = spec.arguments_dict[spec.argument_names[0]]
    return spec


def _maybe_build(self, call_spec):
    extended = None if self.built else _builder()
    if extended is None:
        return _original_maybe_build(self, call_spec)
    spec = _symbolic_call_spec(call_spec)
    return extended._tfdist_build_eagerly(_in_keras_scope(lambda: _original_maybe_build(self, spec)), owner=self)


def build_optimizer(optimizer, trainable_variables) -> None:
    """Builds an unbuilt `optimizer` on `trainable_variables` outside the traced step (see the module).

    Called from the optimizer hook's `apply` under a tfdist strategy; Keras'
    own `apply` builds it otherwise.
    """
    extended = None if optimizer.built or trainable_variables is None else _builder()
    if extended is None:
        return
    variables = list(trainable_variables)

    def build():
        with keras.src.backend.name_scope(optimizer.name, caller=optimizer):
            optimizer.build(variables)
        optimizer.built = True

    extended._tfdist_build_eagerly(_in_keras_scope(build), owner=optimizer)


HOOKS = (
    hook(
        "layer_lazy_build",
        _original_maybe_build,
        ("shapes_dict = get_shapes_dict(call_spec)", "self.build(**shapes_dict)", "compute_output_spec("),
        *EXACT,
        patch=(_keras_layer, "_maybe_build", _maybe_build),
    ),
    hook(
        "optimizer_lazy_build",
        keras_base_optimizer.BaseOptimizer.apply,
        ("if not self.built:", "self.build(trainable_variables)", "self.built = True"),
        *EXACT,
    ),
    hook("lazy_build_name_scope", keras.src.backend.common.name_scope.current_path, (_NAME_SCOPE_STACK,), *EXACT),
)
