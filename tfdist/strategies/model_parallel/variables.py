"""DTensor variables that Keras' host-side code can read and write, and host values packed into DTensors."""

from __future__ import annotations

import tensorflow as tf
from tensorflow.experimental import dtensor

from tfdist._compat import step_deadline
from tfdist.placement import mesh as mesh_lib


def replicated(mesh, rank):
    """The fully replicated layout of rank `rank` on `mesh`."""
    return dtensor.Layout.replicated(mesh, rank)


def layout_of(spec, mesh):
    """The DTensor layout of a sharding spec (a mesh axis name or None per dimension)."""
    return dtensor.Layout([dtensor.UNSHARDED if a is None else a for a in spec], mesh)


def spec_of(layout) -> tuple:
    """The sharding spec of a DTensor layout (None for an unsharded dimension)."""
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


def gather(value):
    """A DTensor as one host tensor (all shards joined)."""
    layout = dtensor.fetch_layout(value)
    if not layout.is_fully_replicated():
        with step_deadline.timed("gather variable"):  # across processes, a collective: bounded like a step
            value = dtensor.relayout(value, replicated(layout.mesh, layout.rank))
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
        return gather(self.read_value()).numpy()

    def __array__(self, dtype=None, copy=None):
        array = self.numpy()
        return array if dtype is None else array.astype(dtype)

    # Set on variables whose updates may come in another layout (sharded data parallelism: a ZeRO-1 weight
    # updated from split optimizer slots): a traced assign relayouts its value (a gather) to the variable's.
    _tfdist_relayout_assign = False

    def _as_layout(self, value):
        if not tf.executing_eagerly():
            if self._tfdist_relayout_assign and isinstance(value, tf.Tensor):
                return dtensor.relayout(value, self.layout)
            return value
        if isinstance(value, tf.Variable):
            value = value.read_value()
        value = tf.convert_to_tensor(value, dtype=self.dtype)
        if dtensor.is_dtensor(value):
            if dtensor.fetch_layout(value) == self.layout:
                return value
            value = gather(value)
        return shard_value(value, self.layout)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        return super().assign(self._as_layout(value), use_locking, name, read_value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True):
        return super().assign_add(self._as_layout(delta), use_locking, name, read_value)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True):
        return super().assign_sub(self._as_layout(delta), use_locking, name, read_value)


class GatheredVariable(ShardedVariable):
    """A ShardedVariable stored split but read in another layout inside traced steps (FSDP-style).

    Each read in a traced step all-gathers the shards into `compute_layout`
    (default: whole on every device); the gradient flows back to the stored
    layout, so optimizer slots and updates stay split. For ops that DTensor runs
    only on a replicated operand (a convolution's filter), and for sharded data
    parallelism (stored split over the data axis, used as the layout rules say).

    Args:
        initial_value: the value, already in the stored layout.
        compute_layout: the layout reads take in a traced step; None: replicated.
        **kwargs: as for `dtensor.DVariable`.
    """

    def __init__(self, initial_value, *args, compute_layout=None, **kwargs):
        super().__init__(initial_value, *args, **kwargs)
        self.compute_layout = compute_layout or replicated(self.layout.mesh, self.layout.rank)

    def _read_variable_op(self, no_copy=False):
        value = super()._read_variable_op(no_copy)
        if tf.executing_eagerly() or self.layout == self.compute_layout:
            return value
        compute, stored = self.compute_layout, self.layout

        @tf.custom_gradient
        def gathered(stored_value):
            def grad(upstream):
                # The gradient takes the use's layout first (a convolution computes its filter's gradient whole
                # over the batch axis and only so), then the stored one: a local slice of it.
                if isinstance(upstream, tf.IndexedSlices):
                    # An embedding lookup's rows stay rows: Keras' optimizers treat them otherwise than the dense
                    # sum (Adam squares each row before summing repeated ones), as on one device.
                    return upstream
                return dtensor.relayout(dtensor.relayout(upstream, compute), stored)

            return dtensor.relayout(stored_value, compute), grad

        return gathered(value)


