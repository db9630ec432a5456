"""Ops that DTensor's SPMD expansion computes wrongly, replaced by exact equivalents in DTensor programs.

Both replacements act while a DTensor strategy's program is traced (the
running strategy's `TfdistExtended` says `_tfdist_spmd`, or no tfdist strategy
is current in a process that created one: a custom loop outside the scope);
elsewhere TensorFlow's and Keras' own code runs. Checked on TensorFlow 2.21
and Keras 3.15.

- The gradient of top-k (`nn_grad._TopKGrad`, registered for TopK and TopKV2)
  scatters the incoming gradient with `scatter_nd` at linear indices
  `row * n + index` counted from `tf.shape`. When the rows are split over a
  mesh axis after a reshape (a MoE router: `[batch, seq, hidden]` ->
  `[tokens, hidden]` -> top-k over the experts), DTensor lays the ScatterNd
  out in a device's local rows while the indices count the global ones: the
  gradient is silently wrong (KerasHub Mixtral: 1.5% off one device in loss
  after 4 steps on a `{batch: 8}` mesh) or out of range. The replacement,
  `sum_k where(index_k == j, grad_k, 0)` over the last dimension, gives the
  same numbers (each position receives at most one term: top-k indices are
  distinct) at the cost of a `[..., k, n]` intermediate.
- Keras' `one_hot` (`tf.one_hot`) fails to expand when its depth dimension is
  split over a mesh axis ("SPMD expansion resulted in op output inconsistent
  with the provided layout"; KerasHub's Qwen3-MoE layout map splits the router
  kernel over the experts). The replacement compares the indices with
  `range(depth)`: the same values, elementwise ops DTensor lays out right.
- Keras' `slice_update` (XLA's DynamicUpdateSlice, which DTensor cannot lay
  out: "'tf.XlaDynamicUpdateSlice' op does not implement layout
  propagation"; KerasHub's `generate` updates its key/value cache with it)
  gathers the update to the input's shape at the (clamped, as XLA does) start
  and selects it where it lands: the same values, at the cost of a full-size
  intermediate per update.
"""

from __future__ import annotations

import tensorflow as tf
from keras.src import backend as keras_backend
from keras.src.backend.tensorflow import core as keras_tf_core
from keras.src.backend.tensorflow import nn as keras_tf_nn
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import nn_grad

from tfdist._compat._hook import hook
from tfdist.strategies import _extended

_TOP_K_OPS = ("TopK", "TopKV2")
_original_top_k_grad = nn_grad._TopKGrad
_original_one_hot = keras_tf_nn.one_hot
_original_slice_update = keras_tf_core.slice_update


def traced_for_spmd() -> bool:
    """Whether the op being built belongs to a DTensor (SPMD) program.

    True under a tfdist strategy whose extended says so, and outside any tfdist
    strategy (the hooks are installed only once a DTensor strategy exists).
    """
    extended = _extended.extended_of(tf.distribute.get_strategy())
    return True if extended is None else extended._tfdist_spmd


def top_k_gradient(op, grad, _):
    """The gradient of `tf.math.top_k` with respect to its input (and a zero for `k`)."""
    if not traced_for_spmd():
        return _original_top_k_grad(op, grad, _)
    values, indices = op.inputs[0], op.outputs[1]
    positions = tf.range(tf.shape(values, out_type=indices.dtype)[-1], dtype=indices.dtype)
    hits = tf.equal(indices[..., None], positions)  # [..., k, n]
    spread = tf.where(hits, grad[..., None], tf.zeros([], grad.dtype))
    return [tf.reduce_sum(spread, axis=-2), tf.zeros([], tf.int32)]


def one_hot(x, num_classes, axis=-1, dtype=None, sparse=False):
    """Keras' `one_hot` (TensorFlow backend), built from a comparison with `range(num_classes)` in DTensor programs."""
    if sparse or not traced_for_spmd():
        return _original_one_hot(x, num_classes, axis=axis, dtype=dtype, sparse=sparse)
    x = tf.cast(tf.convert_to_tensor(x), tf.int64)
    dtype = "float32" if dtype is None else keras_backend.standardize_dtype(dtype)
    rank = x.shape.rank
    axis = axis + rank + 1 if axis < 0 else axis
    classes = tf.reshape(tf.range(num_classes, dtype=tf.int64), [1] * axis + [num_classes] + [1] * (rank - axis))
    hits = tf.equal(tf.expand_dims(x, axis), classes)
    return hits if dtype == "bool" else tf.cast(hits, dtype)


def slice_update(inputs, start_indices, updates):
    """Keras' `slice_update` (TensorFlow backend), as gathers and a select in DTensor programs.

    Along each dimension the update does not fill, the update is gathered to
    the input's length at (clamped, as XLA clamps) offsets and a mask marks
    where it lands; dimensions it fills are left as they are, so static shapes
    stay static (DTensor splits no dynamic dimension).
    """
    if not traced_for_spmd():
        return _original_slice_update(inputs, start_indices, updates)
    inputs = tf.convert_to_tensor(inputs)
    updates = tf.cast(tf.convert_to_tensor(updates), inputs.dtype)
    shape, update_shape = tf.shape(inputs), tf.shape(updates)
    start = tf.cast(tf.stack(start_indices) if isinstance(start_indices, (list, tuple)) else start_indices, tf.int32)
    start = tf.clip_by_value(start, 0, shape - update_shape)
    rank = inputs.shape.rank
    values, lands = updates, None
    for axis in range(rank):
        length, width = inputs.shape[axis], updates.shape[axis]
        if length is not None and length == width:
            continue
        offset = tf.range(length if length is not None else shape[axis]) - start[axis]
        values = tf.gather(values, tf.clip_by_value(offset, 0, update_shape[axis] - 1), axis=axis)
        inside = (offset >= 0) & (offset < update_shape[axis])
        inside = tf.reshape(inside, [-1 if a == axis else 1 for a in range(rank)])
        lands = inside if lands is None else lands & inside
    return values if lands is None else tf.where(lands, values, inputs)


def _register_top_k_gradient() -> None:
    """Points TensorFlow's gradient registry entries of TopK and TopKV2 at `nn_grad._TopKGrad` (now replaced)."""
    for name in _TOP_K_OPS:
        tf_ops._gradient_registry._registry[name]["type"] = nn_grad._TopKGrad


def _registered_top_k_gradient():
    """The function TensorFlow's gradient registry holds for TopKV2 (its source is the hook's probe)."""
    entry = tf_ops._gradient_registry._registry.get("TopKV2", {}).get("type")
    return entry if entry is not top_k_gradient else _original_top_k_grad


HOOKS = (
    hook(
        "top_k_gradient",
        _registered_top_k_gradient(),
        ("array_ops.scatter_nd(", "math_ops.range(0,", "[math_ops.reduce_prod(in_shape)]"),
        "model_parallel",
        patch=(nn_grad, "_TopKGrad", top_k_gradient),
        after=_register_top_k_gradient,
    ),
    hook(
        "one_hot",
        _original_one_hot,
        ("return tf.one_hot(", "on_value, off_value = (True, False) if dtype == \"bool\""),
        "model_parallel",
        patch=(keras_tf_nn, "one_hot", one_hot),
    ),
    hook(
        "slice_update",
        _original_slice_update,
        ("return dynamic_update_slice(inputs, updates, start_indices)",),
        "model_parallel",
        patch=(keras_tf_core, "slice_update", slice_update),
    ),
)
