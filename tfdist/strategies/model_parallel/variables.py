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

    Raises:
        ValueError: for a dimension its mesh axis does not divide.
    """
    value = tf.convert_to_tensor(value)
    mesh = layout.mesh
    specs = layout.sharding_specs
    if all(s == dtensor.UNSHARDED for s in specs):
        return dtensor.pack([value] * mesh.num_local_devices(), layout)
    sizes = mesh_lib.mesh_axes(mesh)
    split = [(dim, axis) for dim, axis in enumerate(specs) if axis != dtensor.UNSHARDED]
    for dim, axis in split:
        if value.shape[dim] % sizes[axis]:
            raise ValueError(
                f"shard_value: dimension {dim} (size {value.shape[dim]}) of a value of shape {value.shape} is not "
                f"divisible by mesh axis {axis!r} ({sizes[axis]}). Expected a size divisible by {sizes[axis]}, or a "
                f"layout that keeps dimension {dim} whole."
            )
    # One split op per split dimension (not a slice per device): the shards, keyed by their position on the mesh.
    pieces = {(): value}
    for dim, axis in split:
        pieces = {key + (i,): part for key, whole in pieces.items()
                  for i, part in enumerate(tf.split(whole, sizes[axis], axis=dim))}
    return dtensor.pack(
        [pieces[tuple(location[axis] for _, axis in split)] for location in mesh.local_device_locations()], layout
    )


def whole_sparse_operands(densify, x1, x2, mesh):
    """The operands of a Keras elementwise op that meets an IndexedSlices, laid out so that DTensor can run it.

    Keras' TensorFlow backend keeps an IndexedSlices gradient (an Embedding's)
    sparse through its arithmetic: against a dense operand, `add` /
    `subtract` / `maximum` / `minimum` densify it (`densify`: the sum of the
    rows at their indices), `multiply` / `divide` gather the dense operand at
    its rows, and `divide` and two IndexedSlices build a union of indices: rows
    of a count only the step knows, which DTensor cannot lay out split. Here
    the rows and indices are whole on every device (a relayout, which DTensor's
    layout propagation does not cross), a densified IndexedSlices is their sum
    whole, and a dense operand met by rows is whole too (a gather over the mesh:
    an optimizer that divides its slots into the rows, such as Adagrad,
    RMSprop, Adadelta and Adafactor, reads those slots whole while it updates
    the variable). The numbers are Keras' own.
    """

    def whole(value):
        if isinstance(value, tf.IndexedSlices):
            values, indices = whole(value.values), whole(value.indices)
            if densify:
                rows = tf.get_static_value(value.dense_shape)
                rows = value.dense_shape[0] if rows is None else int(rows[0])
                return whole(tf.math.unsorted_segment_sum(values, indices, rows))  # as tf.convert_to_tensor does
            return tf.IndexedSlices(values, indices, value.dense_shape)
        if isinstance(value, (tf.Tensor, tf.Variable)) and value.shape.rank:
            value = tf.convert_to_tensor(value)
            return dtensor.relayout(value, replicated(mesh, value.shape.rank))
        return value

    if densify and isinstance(x1, tf.IndexedSlices) == isinstance(x2, tf.IndexedSlices):
        densify = False  # two IndexedSlices: Keras unions their indices (whole rows), nothing to densify
    if not densify or isinstance(x1, tf.IndexedSlices):
        x1 = whole(x1)
    if not densify or isinstance(x2, tf.IndexedSlices):
        x2 = whole(x2)
    return x1, x2


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

    # DTensor (TensorFlow 2.21) lays out none of the ResourceScatter* ops, and Keras' optimizers apply an
    # IndexedSlices gradient (an Embedding's) with them: `assign_sub` / `assign_add` / `assign` of IndexedSlices
    # become `scatter_sub` / `scatter_add` / `scatter_update` (plain SGD, Adagrad, RMSprop, Adadelta, Adafactor).
    # Here each is the dense update that computes what the scatter does, in this variable's layout: the rows of
    # a repeated index add up (scatter_add / scatter_sub), or the last of them is written (scatter_update, as
    # TensorFlow's CPU and GPU kernels do). The rows reach the dense update as Keras computed them, so an
    # optimizer that treats each row apart (Adagrad squares each before they add up) stays as on one device.
    def _dense(self, value):
        """`value` (a tensor of this variable's shape) in this variable's layout inside a traced step."""
        return value if tf.executing_eagerly() else dtensor.relayout(value, self.layout)

    def _summed_rows(self, sparse_delta):
        """The dense sum of `sparse_delta`'s rows at their indices (a repeated index adds up)."""
        if not isinstance(sparse_delta, tf.IndexedSlices):
            raise TypeError(f"sparse_delta is not IndexedSlices: {sparse_delta}")
        values, indices = self._whole_rows(sparse_delta)
        return self._dense(tf.math.unsorted_segment_sum(values, indices, self.shape[0]))

    def _whole_rows(self, sparse_delta):
        """`sparse_delta`'s values and indices, whole on every device inside a traced step.

        The relayout is a boundary: DTensor does not push the variable's layout into Keras' sparse arithmetic
        that made the rows (it lays out no dynamic dimension split).
        """
        values = tf.convert_to_tensor(sparse_delta.values, dtype=self.dtype)
        indices = sparse_delta.indices
        if not tf.executing_eagerly():
            values = dtensor.relayout(values, replicated(self.layout.mesh, values.shape.rank))
            indices = dtensor.relayout(indices, replicated(self.layout.mesh, 1))
        return values, indices

    def scatter_add(self, sparse_delta, use_locking=False, name=None):
        return self.assign_add(self._summed_rows(sparse_delta), name=name)

    def scatter_sub(self, sparse_delta, use_locking=False, name=None):
        return self.assign_sub(self._summed_rows(sparse_delta), name=name)

    def scatter_update(self, sparse_delta, use_locking=False, name=None):
        if not isinstance(sparse_delta, tf.IndexedSlices):
            raise TypeError(f"sparse_delta is not IndexedSlices: {sparse_delta}")
        values, indices = self._whole_rows(sparse_delta)  # TensorScatterUpdate is laid out only on whole operands
        rows = tf.tensor_scatter_nd_update(
            tf.zeros(self.shape, self.dtype), tf.expand_dims(indices, -1), values
        )  # the last row of a repeated index wins, as in the scatter
        written = tf.math.unsorted_segment_sum(tf.ones_like(indices, self.dtype), indices, self.shape[0]) > 0
        written = tf.reshape(written, [-1] + [1] * (self.shape.rank - 1))
        return self.assign(self._dense(tf.where(written, rows, self.read_value())), name=name)


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


