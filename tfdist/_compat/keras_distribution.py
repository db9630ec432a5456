"""Keras' distribution API on TensorFlow: `set_distribution` where it is bound, and the backend's `distribute_tensor`.

* `keras.distribution.set_distribution` is one function bound in four
  modules (`keras.src.distribution.distribution_lib`, whose `Distribution.scope()`
  calls it, `keras.src.distribution`, `keras.distribution` and the `tf.keras`
  alias `keras._tf_keras.keras.distribution`); each binding is
  replaced by one function that hands the value and Keras' own function to the
  listener `tfdist.keras_distribution` connects (it makes the matching tfdist
  strategy current). Modules importing it later get the replacement from
  `distribution_lib`; `unpatched_bindings()` finds any module still holding
  Keras' function.
* Keras' `Layer.__call__` calls `distribution_lib.distribute_tensor(outputs,
  layout)` for a layer whose `"<layer>/output"` key the current distribution's
  LayoutMap has; the TensorFlow backend has no `distribute_tensor` (Keras raises
  AttributeError). The hook adds one that asks the current strategy's
  `TfdistExtended._tfdist_distribute_tensor` (under any other strategy the
  tensor is returned as it is: without DTensors there is no layout to change).
* Check-only: `Distribution.scope()` sets and restores through
  `set_distribution`; `ModelParallel` keeps its map as `_layout_map`; a
  `Distribution` counts processes through backend functions the TensorFlow
  backend lacks (one process, which `tfdist.keras_distribution` checks), and
  Keras' tf.data adapter hands the dataset to `distribute_dataset`, which
  changes it only across processes: in one process the data adapters pass
  their input through as without a distribution.

Checked on Keras 3.15.
"""

from __future__ import annotations

import sys

import keras
import keras._tf_keras.keras.distribution
import tensorflow as tf
from keras.src import distribution as keras_distribution_package
from keras.src.backend.common import name_scope
from keras.src.backend.tensorflow import distribution_lib as backend_lib
from keras.src.distribution import distribution_lib
from keras.src.layers import layer as keras_layer
from keras.src.trainers.data_adapters import tf_dataset_adapter

from tfdist._compat._hook import ABSENT
from tfdist._compat._hook import hook
from tfdist.strategies import _extended

_original_set_distribution = distribution_lib.set_distribution
# The modules binding `set_distribution` (`distribution_lib` first: a module importing it later gets the replacement).
_BINDINGS = (distribution_lib, keras_distribution_package, keras.distribution, keras._tf_keras.keras.distribution)


_listener = None  # called as listener(value, keras_set_distribution) by every replaced binding


def connect(listener) -> None:
    """Makes `listener(value, keras_set_distribution)` what `keras.distribution.set_distribution(value)` runs."""
    global _listener
    _listener = listener


def _set_distribution(value):
    """`keras.distribution.set_distribution`, through the listener tfdist connected."""
    if _listener is None:
        return _original_set_distribution(value)
    return _listener(value, _original_set_distribution)


def _distribute_tensor(tensor, layout):
    extended = _extended.extended_of(tf.distribute.get_strategy())
    if extended is None:
        return tensor
    return extended._tfdist_distribute_tensor(tensor, layout)


def layer_output_path() -> str:
    """The LayoutMap key Keras looks up for the output of the layer being called ("<layer path>/output")."""
    return f"{name_scope.current_path()}/output"


def unpatched_bindings() -> list[str]:
    """The loaded modules whose `set_distribution` is still Keras' own function (empty once installed)."""
    return sorted(
        name
        for name, module in list(sys.modules.items())
        if getattr(module, "set_distribution", None) is _original_set_distribution
    )


HOOKS = (
    *(
        hook(
            f"set_distribution:{module.__name__}",
            _original_set_distribution,
            ("global_state.set_global_attribute(GLOBAL_ATTRIBUTE_NAME, value)",),
            "keras_distribution",
            patch=(module, "set_distribution", _set_distribution),
            original=_original_set_distribution,
        )
        for module in _BINDINGS
    ),
    hook(
        "distribution_scope",
        distribution_lib.Distribution.scope,
        ("set_distribution(self)", "set_distribution(original_scope)"),
        "keras_distribution",
    ),
    hook(
        "distribute_tensor",
        distribution_lib.distribute_tensor,
        ("return distribution_lib.distribute_tensor(tensor, layout)",),
        "keras_distribution",
        patch=(backend_lib, "distribute_tensor", _distribute_tensor),
        original=ABSENT,
    ),
    hook(
        "layer_output_layout",
        keras_layer.Layer.__call__,
        ('current_layer_path += "/output"', "distribution_lib.distribute_tensor("),
        "keras_distribution",
    ),
    hook(
        "model_parallel_layout_map",
        distribution_lib.ModelParallel.__init__,
        ("self._layout_map = layout_map",),
        "keras_distribution",
    ),
    hook(
        "distribution_processes",
        distribution_lib.Distribution.__init__,
        ('hasattr(distribution_lib, "num_processes")', "self._num_processes = 1"),
        "keras_distribution",
    ),
    hook(
        "distribute_dataset",
        distribution_lib.Distribution.distribute_dataset,
        ("if not self._is_multi_process or not self.auto_shard_dataset:\n            return dataset",),
        "keras_distribution",
    ),
    hook(
        "dataset_adapter_distribution",
        tf_dataset_adapter.TFDatasetAdapter.__init__,
        ("dataset = distribution.distribute_dataset(dataset)",),
        "keras_distribution",
    ),
)
