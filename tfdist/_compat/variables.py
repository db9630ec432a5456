"""Keras variables: the path of the variable whose tf.Variable is being created.

Keras creates the tf.Variable in `Variable._initialize` with only the short name
(`name="kernel"`); a strategy's variable creator needs the full path
("block_0/mlp_in/kernel") to pick a layout or a stage. For a subclassed model
built later (deferred initialization) Keras' name scope is gone by then, but the
Keras variable knows its path: the hook records it for the creator
(`variable_path`). It only records; strategies that do not ask ignore it.
Optimizer slots are created under `colocate_vars_with` their variable.
Checked on Keras 3.15.
"""

from __future__ import annotations

import threading

import keras
from keras.src.backend.tensorflow import optimizer as keras_tf_optimizer

from tfdist._compat._hook import hook
from tfdist._compat._hook import thread_local_scope

_keras_tf_variable = keras.src.backend.tensorflow.core.Variable
_original_variable_initialize = _keras_tf_variable._initialize
_creating = threading.local()


def _variable_initialize(self, value):
    with thread_local_scope(_creating, "variable", self):
        return _original_variable_initialize(self, value)


def creating_variable():
    """The Keras variable whose backing tf.Variable is being created, else None."""
    return getattr(_creating, "variable", None)


def creating_variable_path() -> str | None:
    """The Keras path of the variable whose backing tf.Variable is being created, else None."""
    variable = creating_variable()
    return None if variable is None else variable.path


def variable_path(name: str) -> str:
    """The path of a tf.Variable being created: its Keras variable's, else Keras' name scope + `name`."""
    path = creating_variable_path()
    if path is None:
        scope = keras.src.backend.common.name_scope.current_path()
        path = f"{scope}/{name}" if scope else name
    return path


HOOKS = (
    hook(
        "variable_path",
        _original_variable_initialize,
        ("tf.Variable(", "name=self.name"),
        "model_parallel",
        "pipeline",
        patch=(_keras_tf_variable, "_initialize", _variable_initialize),
    ),
    hook(
        "variable_deferred_init",
        keras.src.backend.common.variables.Variable.__init__,
        ('self._path = f"{parent_path}/{name}"', "register_uninitialized_variable(self)"),
        "model_parallel",
    ),
    hook(
        "slot_colocation",
        keras_tf_optimizer.TFOptimizer.add_variable_from_reference,
        ("colocate_vars_with(",),
        "model_parallel",
    ),
)
