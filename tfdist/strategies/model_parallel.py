"""Model parallelism: Keras 3 weights split over a DTensor device mesh.

`ModelParallelStrategy` is a `tf.distribute.Strategy` whose variables are
DTensor variables (`DVariable`s). Layout rules on each variable's Keras path
decide which dimensions are split over which mesh axis; the batch is split over
the batch axis. The model runs as ONE global SPMD program (DTensor inserts the
collectives), so Keras sees a single replica (`num_replicas_in_sync == 1`) and
computes the loss, gradients and metrics of the global batch as on one device.

How Keras is plugged in (tf.distribute's extension points, plus two hooks in
`_keras_compat`: the path of the variable being created, and sharding of
`train_on_batch` / `test_on_batch` / `predict_on_batch` inputs):

* `scope()` -> `_create_variable`: each tf.Variable Keras creates becomes a
  `ShardedVariable` with the layout its rule asks for; optimizer slots take
  their variable's layout (Keras creates them under `colocate_vars_with`);
  scalars are replicated. The path comes from the Keras variable being
  initialized (a hook in `_keras_compat`), so it is right for subclassed models
  whose variables are created after their name scopes are gone.
* `experimental_distribute_dataset` -> an iterable of batch-sharded DTensor
  batches (DTensor cannot consume a tf.data iterator inside a traced step, so
  Keras takes its Python-loop path).
* `run` -> `_call_for_each_replica`: packs eager inputs into batch-sharded
  DTensors and returns outputs replicated, so Keras can read them on the host.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import one_device_strategy
from tensorflow.python.util import nest

from tfdist.placement import mesh as mesh_lib
from tfdist.placement.rules import LayoutRules
from tfdist.strategies import _keras_compat
from tfdist.strategies import topology as topology_lib

COMBINE_ALL_REDUCES_ENV = "DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"


def ensure_safe_dtensor_env() -> None:
    """Disables DTensor's all-reduce combining pass, which corrupts Adam updates.

    On TensorFlow 2.21 the pass makes Adam silently wrong (measured on a
    transformer block, 2x4 mesh: weights off by 0.07 and the loss by 1-3% after
    8 steps, no error). DTensor reads the variable when it compiles a program,
    not when TensorFlow loads, so setting it here, before any DTensor
    computation, is enough (tested with TensorFlow imported first).

    Raises:
        RuntimeError: if the variable is set to anything but "0".
    """
    value = os.environ.setdefault(COMBINE_ALL_REDUCES_ENV, "0")
    if value != "0":
        raise RuntimeError(
            f"{COMBINE_ALL_REDUCES_ENV}={value!r} is set. DTensor's all-reduce combining pass silently "
            "corrupts optimizer updates (Adam) on TensorFlow 2.21; ModelParallelStrategy refuses to run "
            f"with it. Unset the variable or set {COMBINE_ALL_REDUCES_ENV}=0 before starting Python."
        )


def _replicated(mesh, rank):
    return dtensor.Layout.replicated(mesh, rank)


def _layout(spec, mesh):
    return dtensor.Layout([dtensor.UNSHARDED if a is None else a for a in spec], mesh)


def _spec(layout) -> tuple:
    return tuple(None if s == dtensor.UNSHARDED else s for s in layout.sharding_specs)


def shard_value(value, layout):
    """Packs a host (non-DTensor) value into a DTensor with `layout`, slicing on the host.

    Each device receives only its own shard; nothing is replicated first.
    """
    value = tf.convert_to_tensor(value)
    mesh = layout.mesh
    specs = layout.sharding_specs
    if all(s == dtensor.UNSHARDED for s in specs):
        return dtensor.pack([value] * mesh.num_local_devices(), layout)
    sizes = mesh_lib.mesh_axes(mesh)
    components = []
    for location in mesh.local_device_locations():
        index = []
        for dim, axis in enumerate(specs):
            if axis == dtensor.UNSHARDED:
                index.append(slice(None))
            else:
                step = value.shape[dim] // sizes[axis]
                index.append(slice(location[axis] * step, (location[axis] + 1) * step))
        components.append(value[tuple(index)])
    return dtensor.pack(components, layout)


def _gather(value):
    """A DTensor as one host tensor (all shards joined)."""
    layout = dtensor.fetch_layout(value)
    if not layout.is_fully_replicated():
        value = dtensor.relayout(value, _replicated(layout.mesh, layout.rank))
    return dtensor.unpack(value)[0]


class ShardedVariable(dtensor.DVariable):
    """A DVariable that Keras' host-side code can read and write.

    `numpy()` / `np.asarray()` gather the shards; an eager `assign` of a host
    value (numpy, a plain tensor, a DTensor of another layout) re-shards it into
    this variable's layout. That is what `get_weights` / `set_weights`,
    `save_weights` / `load_weights` and `.keras` save / load need, and what makes
    a checkpoint saved on one mesh load onto another. Inside a traced step the
    variable behaves as a plain DVariable.
    """

    def numpy(self):
        return _gather(self.read_value()).numpy()

    def __array__(self, dtype=None, copy=None):
        array = self.numpy()
        return array if dtype is None else array.astype(dtype)

    def _as_layout(self, value):
        if not tf.executing_eagerly():
            return value
        if isinstance(value, tf.Variable):
            value = value.read_value()
        value = tf.convert_to_tensor(value, dtype=self.dtype)
        if dtensor.is_dtensor(value):
            if dtensor.fetch_layout(value) == self.layout:
                return value
            value = _gather(value)
        return shard_value(value, self.layout)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        return super().assign(self._as_layout(value), use_locking, name, read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        return super().assign_add(self._as_layout(delta), use_locking, name, read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        return super().assign_sub(self._as_layout(delta), use_locking, name, read_value)


class GatheredVariable(ShardedVariable):
    """A ShardedVariable stored split but read whole inside traced steps (FSDP-style).

    For ops that DTensor runs only on a replicated operand (a convolution's
    filter): each read in a traced step all-gathers the shards; the gradient
    flows back to the split layout, so optimizer slots and updates stay split.
    """

    def _read_variable_op(self, no_copy=False):
        value = super()._read_variable_op(no_copy)
        if tf.executing_eagerly() or self.layout.is_fully_replicated():
            return value
        return dtensor.relayout(value, _replicated(self.layout.mesh, self.layout.rank))


class _DTensorBatches:
    """Iterable over a dataset whose elements come out as batch-sharded DTensors."""

    def __init__(self, dataset, extended):
        self._dataset = dataset
        self._extended = extended

    def __iter__(self):
        for element in self._dataset:
            yield self._extended.shard_batch(element)

    @property
    def element_spec(self):
        return self._dataset.element_spec


@dataclasses.dataclass(frozen=True)
class VariablePlacement:
    """Where one variable lives: its path, global shape, per-dimension spec and bytes."""

    path: str
    shape: tuple
    dtype: str
    spec: tuple
    bytes_total: int
    bytes_per_device: int
    gathered: bool = False


@dataclasses.dataclass(frozen=True)
class PlacementReport:
    """`ModelParallelStrategy.placement_report`'s result.

    Attributes:
        mesh: axis name -> size.
        variables: one `VariablePlacement` per variable (model weights, then
            optimizer state), in the model's order.
        bytes_per_device: device name -> bytes of all variables it holds.
        unmatched_rules: `(rule, near misses)` for each rule that matched no
            variable of the model.
        misplaced: `(path, spec the rules give, spec it has)` for each model
            variable whose layout is not what the rules give its path (it was
            created under another path, or under another strategy's rules).
    """

    mesh: dict
    variables: tuple
    bytes_per_device: dict
    unmatched_rules: tuple
    misplaced: tuple = ()

    @property
    def bytes_total(self) -> int:
        """Bytes of all variables, counted once (as on one device)."""
        return sum(v.bytes_total for v in self.variables)

    def table(self) -> str:
        """The report as a text table."""
        rows = [("path", "shape", "layout", "bytes total", "bytes/device")]
        for v in self.variables:
            layout = (
                "(" + ", ".join("-" if a is None else a for a in v.spec) + ")" + (" gathered" if v.gathered else "")
            )
            rows.append((v.path, str(list(v.shape)), layout, f"{v.bytes_total:,}", f"{v.bytes_per_device:,}"))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = [
            "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        per_device = set(self.bytes_per_device.values())
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
        if len(per_device) == 1:
            lines.append(
                f"mesh {mesh}: {len(self.variables)} variables, {self.bytes_total:,} bytes in all, "
                f"{per_device.pop():,} bytes on each of {len(self.bytes_per_device)} devices"
            )
        else:
            lines.append(f"mesh {mesh}: bytes per device {self.bytes_per_device}")
        lines.extend(self.problems())
        return "\n".join(lines)

    def problems(self) -> list[str]:
        """One line per rule that matched nothing and per misplaced variable."""
        lines = [
            f"rule {rule} matched no variable; similar paths: {near or 'none'}" for rule, near in self.unmatched_rules
        ]
        lines += [
            f"variable {path!r} has layout {actual} but the rules give its path {expected}"
            for path, expected, actual in self.misplaced
        ]
        return lines


class _ModelParallelExtended(one_device_strategy.OneDeviceExtended):
    """Creates DTensor variables by rule and runs Keras steps as one SPMD program."""

    _tfdist_dtensor = True

    def __init__(self, container_strategy, mesh, rules, batch_axis):
        super().__init__(container_strategy, mesh.local_devices()[0])
        self.mesh = mesh
        self.rules = rules
        self.batch_axis = batch_axis
        self._axes = mesh_lib.mesh_axes(mesh)

    # ------------------------------------------------------------------ variables
    def layout_for(self, path, shape):
        """The layout of a variable, and whether it is gathered for use."""
        spec, rule = self.rules.resolve(path, shape, self._axes)
        return _layout(spec, self.mesh), bool(rule is not None and rule.gather)

    def _create_variable(self, next_creator, **kwargs):
        colocate_with = kwargs.pop("colocate_with", None)
        for unused in ("distribute_strategy", "layout", "use_resource", "shape"):
            kwargs.pop(unused, None)
        init = kwargs.pop("initial_value")
        with tf.init_scope():
            if callable(init):
                init = init()
            init = tf.convert_to_tensor(init, dtype=kwargs.get("dtype"))
            if dtensor.is_dtensor(init):
                init = _gather(init)
            shape = tuple(init.shape)
            gather = False
            if isinstance(colocate_with, dtensor.DVariable) and tuple(colocate_with.shape) == shape:
                layout = colocate_with.layout  # an optimizer slot follows its variable
            elif colocate_with is not None:
                layout = _replicated(self.mesh, len(shape))
            else:
                path = _keras_compat.variable_path(kwargs.get("name") or "variable")
                layout, gather = self.layout_for(path, shape)
            cls = GatheredVariable if gather else ShardedVariable
            return cls(shard_value(init, layout), **kwargs)

    def _validate_colocate_with_variable(self, colocate_with_variable):
        del colocate_with_variable  # any variable; its layout is reused when shapes agree

    # ------------------------------------------------------------------ inputs
    def shard_batch(self, structure):
        """Packs each tensor of `structure` into a DTensor split on the batch axis (scalars replicated)."""
        parts = self._axes.get(self.batch_axis, 1) if self.batch_axis else 1

        def one(value):
            if value is None or (isinstance(value, tf.Tensor) and dtensor.is_dtensor(value)):
                return value
            value = tf.convert_to_tensor(value)
            rank = value.shape.rank
            if not rank or self.batch_axis is None:
                return shard_value(value, _replicated(self.mesh, rank or 0))
            if value.shape[0] % parts:
                raise ValueError(
                    f"A batch of {value.shape[0]} examples cannot be split over mesh axis "
                    f"{self.batch_axis!r} of size {parts}. Use a batch size divisible by {parts} "
                    "(for the last batch of a dataset: `dataset.batch(n, drop_remainder=True)`, or a "
                    f"number of examples divisible by the batch size)."
                )
            layout = dtensor.Layout.batch_sharded(self.mesh, self.batch_axis, rank)
            return shard_value(value, layout)

        return nest.map_structure(one, structure)

    _tfdist_shard_batch = shard_batch  # _keras_compat shards train/test/predict_on_batch inputs with it

    def _experimental_distribute_dataset(self, dataset, options):
        del options
        return _DTensorBatches(dataset, self)

    def _distribute_datasets_from_function(self, dataset_fn, options):
        del options
        return _DTensorBatches(dataset_fn(tf.distribute.InputContext()), self)

    # ------------------------------------------------------------------ execution
    def _call_for_each_replica(self, fn, args, kwargs):
        if tf.executing_eagerly():  # inside a traced step, inputs are DTensors already
            args = self.shard_batch(args)
            kwargs = self.shard_batch(kwargs or {})
        with one_device_strategy._OneDeviceReplicaContext(self._container_strategy()):
            outputs = fn(*args, **(kwargs or {}))

        def replicated(value):  # Keras reads step outputs on the host
            if isinstance(value, tf.Tensor) and value.shape.rank:
                return dtensor.relayout(value, _replicated(self.mesh, value.shape.rank))
            return value

        return nest.map_structure(replicated, outputs)

    def _update_non_slot(self, colocate_with, fn, args, kwargs, group):
        del colocate_with
        with distribute_lib.UpdateContext(self._device):
            result = fn(*args, **kwargs)
            return result if group else nest.map_structure(self._local_results, result)


class ModelParallelStrategy(distribute_lib.Strategy):
    """Trains a Keras 3 model whose weights are split over a mesh of devices.

    Build the model under `scope()`; then `fit`, `evaluate`, `predict`,
    `save`, `keras.saving.load_model`, `get_weights` and `set_weights` work as
    on one device, with numpy or tf.data input. Each weight is placed by the
    first (and only) layout rule matching its Keras path; unmatched weights and
    scalars are replicated; optimizer slots follow their weight. The batch is
    split over `batch_axis` (data parallelism over the model-parallel groups).

    The model runs as one global program: losses, gradients and metrics are
    those of the global batch, as on one device, and `num_replicas_in_sync` is 1.
    Checkpoints (`.keras`, `.weights.h5`, `tf.train.Checkpoint`) hold whole
    tensors, so they load onto another mesh shape or one device.

    Limits: devices of this host only; every batch (the last one too) must
    divide by the batch axis; random ops (dropout) draw other numbers than on
    one device; each variable's initial value is computed whole on the host,
    then split.

    Args:
        mesh: mesh axis name -> size; the product must equal the number of
            devices. Default `{"batch": 2, "model": 4}`. `{"model": 8}` is pure
            model parallelism, `{"batch": 8}` pure data parallelism.
        rules: layout rules, e.g. `tfdist.layouts.transformer()`: a
            `tfdist.layouts.LayoutRules` or a list of `(regex, spec)` pairs.
            None means every weight is replicated.
        devices: device names; defaults to all GPUs, else all logical CPUs.
        batch_axis: the mesh axis that splits each batch. When the mesh has no
            axis of this name (e.g. `{"model": 8}` with the default "batch"),
            each device sees the whole batch. None: never split batches.

    Raises:
        ValueError: for a bad mesh, a mesh whose size differs from the device
            count, a rule naming an axis the mesh lacks, or a `batch_axis`
            (other than the default) that the mesh lacks.
        RuntimeError: if DTensor's all-reduce combining pass is enabled
            (`DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION` other than "0"),
            which corrupts Adam updates.

    Example:

    >>> import keras, numpy as np, tfdist
    >>> strategy = tfdist.ModelParallelStrategy(
    ...     mesh={"batch": 1, "model": 1}, devices=["CPU:0"],
    ...     rules=[(r"dense/kernel$", (None, "model"))])
    >>> with strategy.scope():
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="dense")])
    ...     model.compile(optimizer="adam", loss="mse")
    >>> history = model.fit(np.ones((8, 4)), np.ones((8, 2)), batch_size=4, verbose=0)
    >>> strategy.placement_report(model, print_fn=None).variables[0].spec
    (None, 'model')
    """

    def __init__(
        self,
        *,
        mesh: dict[str, int] | None = None,
        rules: LayoutRules | list | None = None,
        devices: list[str] | None = None,
        batch_axis: str | None = "batch",
    ):
        ensure_safe_dtensor_env()
        axes = mesh_lib.validate_axes({"batch": 2, "model": 4} if mesh is None else mesh)
        rules = LayoutRules(rules or ())
        rules.check_axes(axes)
        if batch_axis is not None:
            if not isinstance(batch_axis, str):
                raise ValueError(f"`batch_axis` must be a mesh axis name or None; got {batch_axis!r}.")
            if batch_axis not in axes:
                if batch_axis != "batch":
                    raise ValueError(
                        f"batch_axis={batch_axis!r} is not an axis of the mesh {axes!r}. "
                        f"Valid choices: {list(axes)} or None (every device sees the whole batch)."
                    )
                batch_axis = None
        dmesh = mesh_lib.make_mesh(axes, devices)
        _keras_compat.install_model_parallel()
        super().__init__(_ModelParallelExtended(self, dmesh, rules, batch_axis))

    @property
    def mesh(self) -> dtensor.Mesh:
        """The DTensor mesh."""
        return self.extended.mesh

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Axis name -> size."""
        return dict(self.extended._axes)

    @property
    def rules(self) -> LayoutRules:
        return self.extended.rules

    @property
    def batch_axis(self) -> str | None:
        """The mesh axis that splits batches, or None when every device sees the whole batch."""
        return self.extended.batch_axis

    @property
    def topology(self) -> topology_lib.Topology:
        """One process; each global batch is split over the batch axis (1 without one)."""
        size = self.mesh_shape[self.batch_axis] if self.batch_axis else 1
        return topology_lib.Topology(worker_index=0, num_workers=1, data_parallel_size=size)

    def shard_batch(self, structure):
        """Packs host tensors/arrays into DTensors split on the batch axis (for custom loops)."""
        return self.extended.shard_batch(structure)

    def placement_report(self, model, *, print_fn=print) -> PlacementReport:
        """Where each variable of `model` (and of its optimizer) lives, and bytes per device.

        Args:
            model: a Keras model built under this strategy's scope.
            print_fn: called with the table as text; None to print nothing.

        Returns:
            A `PlacementReport`: per variable path, shape, spec, bytes in all
            and on each device; totals per device; rules that matched nothing
            and variables whose layout differs from what their rule gives
            (both also issued as a warning).

        Raises:
            ValueError: if a variable of `model` was not created under this
                strategy's scope.
        """
        variables, seen = [], set()
        optimizer = getattr(model, "optimizer", None)
        optimizer_variables = list(optimizer.variables) if optimizer is not None else []
        for v in list(model.weights) + optimizer_variables:
            if id(v) not in seen:
                seen.add(id(v))
                variables.append(v)
        axes = self.extended._axes
        rows = []
        for v in variables:
            backing = getattr(v, "value", v)
            if not isinstance(backing, dtensor.DVariable) or backing.layout.mesh != self.mesh:
                raise ValueError(
                    f"Variable {v.path!r} was not created under this ModelParallelStrategy's scope. "
                    "Build the model (and compile it) inside `with strategy.scope():`."
                )
            spec = _spec(backing.layout)
            shape = tuple(int(d) for d in v.shape)
            itemsize = np.dtype(backing.dtype.as_numpy_dtype).itemsize
            total = math.prod(shape) * itemsize
            split = math.prod(axes[a] for a in spec if a is not None)
            gathered = isinstance(backing, GatheredVariable)
            rows.append(VariablePlacement(v.path, shape, backing.dtype.name, spec, total, total // split, gathered))
        per_device = sum(r.bytes_per_device for r in rows)
        by_path = {r.path: r for r in rows}
        misplaced = []
        for w in model.weights:
            expected = self.rules.spec_for(w.path, by_path[w.path].shape, axes)
            if expected != by_path[w.path].spec:
                misplaced.append((w.path, expected, by_path[w.path].spec))
        report = PlacementReport(
            mesh=dict(axes),
            variables=tuple(rows),
            bytes_per_device={d: per_device for d in self.mesh.local_devices()},
            unmatched_rules=tuple(self.rules.unmatched(w.path for w in model.weights)),
            misplaced=tuple(misplaced),
        )
        if print_fn is not None:
            print_fn(report.table())
        if report.problems():
            warnings.warn("ModelParallelStrategy placement: " + "; ".join(report.problems()), stacklevel=2)
        return report

    def __repr__(self):
        return f"ModelParallelStrategy(mesh={self.mesh_shape!r}, rules={self.rules!r}, batch_axis={self.batch_axis!r})"
