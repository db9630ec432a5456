"""Keras' own distribution API (`keras.distribution`) on TensorFlow, run by tfdist's strategies.

On the TensorFlow backend Keras 3 implements none of `keras.distribution`:
`set_distribution(DataParallel(...))` or `ModelParallel(...)` (and
`with distribution.scope():`) change nothing, and a LayoutMap's
`"<layer>/output"` key makes every call of that layer fail. After
`use_keras_distribution()` they mean what they mean on JAX:

* `ModelParallel(layout_map=..., batch_dim_name=...)` runs as a
  `tfdist.ModelParallelStrategy`: its mesh is the LayoutMap's `DeviceMesh`
  (axis names and sizes, over its devices in their order), its rules the
  LayoutMap (Keras' matching: a key matches the whole path, an exact key
  wins), its `batch_axis` the distribution's `batch_dim_name`.
* `DataParallel(devices=... | device_mesh=...)` (or `DataParallel()`: all
  devices) runs as a `tfdist.DataParallelStrategy` over the mesh's devices.

While a distribution is set, its strategy is TensorFlow's current one
(`tf.distribute.experimental_set_strategy`), so a model built and compiled
then is created under it and `fit` / `evaluate` / `predict` run distributed;
`set_distribution(None)`, or leaving `with distribution.scope():`, makes the
previous one (or none) current again, and a model built afterwards is not
distributed (one built before keeps its strategy, as a Keras model keeps the
strategy it was created under). Each distribution object has one strategy,
made when it is first set (its LayoutMap is read then).

An activation layout (a `"<layer>/output"` key) relayouts that layer's output
(a DTensor relayout) while a model-parallel step runs, except for the
dimensions the mesh axis does not divide (such as a last, smaller batch:
tfdist computes it whole on every device), which keep the layout DTensor
derives. Values never change with a layout, only where they are computed.

Keras' data adapters get the distribution, as on any backend: in one process
`distribute_dataset` passes a dataset through unchanged, and tfdist's strategy
splits each batch.

Why opt-in: `import tfdist` is cheap, loads no TensorFlow and changes nothing
else in the process. Doing this on import would give every program (or library)
that merely imports tfdist another meaning for code it already has: a
`set_distribution` call that was inert would start placing models on devices
and making a strategy current, which then refuses another strategy's scope.
`use_keras_distribution()` is one explicit line, where the choice is made.

Limits: one process (a tfdist strategy spanning processes must exist before
TensorFlow starts, which `keras.distribution.list_devices()` already starts:
construct `tfdist.ModelParallelStrategy(rules=layout_map)` or
`tfdist.MultiWorkerStrategy` first thing instead); random ops (dropout) draw
other numbers than on one device, as under the strategies themselves;
TensorFlow ties a model's variables to its strategy, so a model is read or
trained while its distribution (or none) is set, not while another one is.
`keras.utils.clear_session()` forgets the distribution and TensorFlow's
current strategy both.
"""

from __future__ import annotations

import weakref

import keras
import numpy as np
import tensorflow as tf

from tfdist import _compat
from tfdist import cluster as cluster_lib
from tfdist import devices as devices_lib
from tfdist import errors
from tfdist._compat import keras_distribution as hooks
from tfdist.placement.rules import device_mesh_axes
from tfdist.strategies.data_parallel import DataParallelStrategy
from tfdist.strategies.model_parallel import ModelParallelStrategy

__all__ = ["use_keras_distribution"]

_strategies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Keras distribution -> its tfdist strategy
_active = None  # the strategy this module made TensorFlow's current one, or None


def use_keras_distribution() -> None:
    """Makes `keras.distribution.set_distribution` (and `distribution.scope()`) distribute on TensorFlow.

    From this call on, setting a `keras.distribution.ModelParallel` makes
    the matching `tfdist.ModelParallelStrategy` current, a `DataParallel` a
    `tfdist.DataParallelStrategy`, and `None` neither; a distribution set
    before this call is taken up now. See the module docstring. Calling it
    again changes nothing.

    Raises:
        ValueError: when Keras' backend is not TensorFlow; for the
            distribution already set, as `set_distribution` raises (below).
        tfdist.CompatError: when Keras' distribution code is not the code
            tfdist was checked on.

    `set_distribution` then raises (and leaves the current distribution
    as it was):

    * ValueError for a distribution other than `DataParallel` and
      `ModelParallel` (such as Keras' `AutoTPDistribution`), a DeviceMesh
      naming devices this process does not have, this process being one
      of several (a cluster in `TF_CONFIG` or Slurm, or a Keras distribution
      over processes), or a mesh or LayoutMap `tfdist.ModelParallelStrategy`
      refuses;
    * RuntimeError when called inside another `tf.distribute.Strategy`'s
      scope.

    Example:

    >>> import keras, numpy as np, tensorflow as tf, tfdist
    >>> tfdist.use_keras_distribution()
    >>> mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"], devices=["cpu:0"])
    >>> layout_map = keras.distribution.LayoutMap(mesh)
    >>> layout_map["dense/kernel"] = (None, "model")
    >>> distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    >>> with distribution.scope():
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="dense")])
    ...     model.compile(optimizer="adam", loss="mse")
    ...     history = model.fit(np.ones((8, 4)), np.ones((8, 2)), batch_size=4, verbose=0)
    >>> type(model.distribute_strategy).__name__, model.distribute_strategy.mesh_shape
    ('ModelParallelStrategy', {'batch': 1, 'model': 1})
    >>> keras.distribution.distribution() is None, tf.distribute.has_strategy()
    (True, False)
    """
    if keras.backend.backend() != "tensorflow":
        raise ValueError(
            f"tfdist.use_keras_distribution() runs Keras' distribution API on the TensorFlow backend; Keras' "
            f"backend is {keras.backend.backend()!r}, where Keras implements the API itself. Remove the call, or "
            "set KERAS_BACKEND=tensorflow."
        )
    hooks.connect(_set_distribution)
    _compat.install("keras_distribution")
    left = hooks.unpatched_bindings()
    if left:
        raise errors.CompatError(
            f"tfdist hook 'set_distribution' no longer applies: the modules {left} bind Keras' own "
            "keras.distribution.set_distribution, which tfdist did not replace there (checked on Keras "
            f"{_compat.CHECKED_ON['keras']}, installed {keras.__version__})."
        )
    current = keras.distribution.distribution()
    if current is not None:
        _set_distribution(current, lambda value: None)


def _set_distribution(value, keras_set_distribution) -> None:
    """`keras_set_distribution(value)` (Keras' own), with the strategy of `value` made TensorFlow's current one.

    Everything is checked before anything changes: the distribution becomes
    a strategy (or raises), and no other strategy's scope may be open.
    """
    global _active
    strategy = None if value is None else _strategy_for(value)
    current = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    if strategy is not None and current is not None and current is not _active:
        raise RuntimeError(
            f"keras.distribution.set_distribution({value!r}) was called inside the scope of {current!r}. A Keras "
            "distribution makes its own tfdist strategy current (tfdist.use_keras_distribution()); set it "
            "outside any `with strategy.scope():`, or build the model under that strategy's scope alone."
        )
    keras_set_distribution(value)
    if strategy is None:
        if _active is not None and current is _active:
            tf.distribute.experimental_set_strategy(None)
    elif current is not strategy:
        tf.distribute.experimental_set_strategy(strategy)
    _active = strategy


def _strategy_for(distribution):
    """The one tfdist strategy of a Keras distribution (made the first time it is asked for)."""
    strategy = _strategies.get(distribution)
    if strategy is None:
        strategy = _strategies[distribution] = _new_strategy(distribution)
    return strategy


def _new_strategy(distribution):
    kinds = (keras.distribution.ModelParallel, keras.distribution.DataParallel)
    if not isinstance(distribution, kinds):
        raise ValueError(
            f"tfdist runs keras.distribution.DataParallel and keras.distribution.ModelParallel on TensorFlow; "
            f"got {type(distribution).__name__} ({distribution!r}). Keras' automatic tensor parallelism "
            "(AutoTPDistribution) is not one of them: give ModelParallel a LayoutMap (such as a KerasHub "
            "backbone's get_layout_map(device_mesh)), or train under tfdist.ModelParallelStrategy("
            "rules=tfdist.layouts.transformer())."
        )
    name = type(distribution).__name__
    cluster = cluster_lib.resolve()
    processes = max(distribution.num_processes, cluster.num_workers if cluster else 1)
    if processes > 1:
        counted = f"worker {cluster.rank} of the cluster in TF_CONFIG or Slurm" if cluster else "as Keras counts them"
        raise ValueError(
            f"keras.distribution.{name} through tfdist runs in one process, but this process is one of "
            f"{processes} ({counted}). A tfdist strategy over several processes must be constructed before "
            "TensorFlow starts, and Keras' DeviceMesh lists devices (starting it) first: construct "
            "tfdist.ModelParallelStrategy(rules=layout_map) (it takes the LayoutMap) or tfdist.MultiWorkerStrategy() "
            "first thing in the program and build the model under its scope, or run one process."
        )
    device_mesh = distribution.device_mesh
    devices = _mesh_devices(device_mesh)
    if isinstance(distribution, keras.distribution.ModelParallel):
        return ModelParallelStrategy(
            mesh=device_mesh_axes(device_mesh),
            rules=distribution._layout_map,  # Keras keeps no public handle on it (hook "model_parallel_layout_map")
            devices=devices,
            batch_axis=distribution.batch_dim_name,
            cluster=cluster,
        )
    return DataParallelStrategy(devices=devices)


def _mesh_devices(device_mesh) -> list[str]:
    """The devices of a Keras DeviceMesh, in its order, as this process' full device names."""
    names = [str(d) for d in np.asarray(device_mesh.devices).flatten()]
    try:
        return devices_lib.device_list(names)
    except ValueError as e:
        raise ValueError(
            f"The DeviceMesh {device_mesh} names the devices {names}, not all of which are this process' "
            f"({e}) Give the DeviceMesh devices from keras.distribution.list_devices(): "
            f"{keras.distribution.list_devices()}."
        ) from e
