"""Ops that DTensor's SPMD expansion computes wrongly, replaced by exact equivalents in DTensor programs.

The replacements act while a DTensor strategy's program is traced (the
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
- The gradient of `tf.stack` (`array_grad._PackGrad`: an Unpack) fails to
  expand when a dimension before the stacked axis is split ("SPMD expansion
  resulted in op output inconsistent with the provided layout"; KerasHub's
  rotary embedding stacks along -2, and Gemma's and Gemma 3's attention heads
  are split by `layouts.auto()`). The replacement splits the gradient along
  that axis and squeezes it: the same numbers, without an Unpack.
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

import numpy as np
import tensorflow as tf
from keras.src import backend as keras_backend
from keras.src.backend.tensorflow import core as keras_tf_core
from keras.src.backend.tensorflow import nn as keras_tf_nn
from tensorflow.python.framework import ops as tf_ops
from tensorflow.python.ops import array_grad
from tensorflow.python.ops import nn_grad

from tfdist._compat._hook import hook
from tfdist.strategies import _extended

_TOP_K_OPS = ("TopK", "TopKV2")
_original_top_k_grad = nn_grad._TopKGrad
_original_pack_grad = array_grad._PackGrad
_original_depthwise_grad = nn_grad._DepthwiseConv2dNativeGrad
_original_avg_pool_grad = nn_grad._AvgPoolGrad
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


def pack_gradient(op, grad):
    """The gradient of `tf.stack`: the incoming gradient split along the stacked axis (no Unpack) under DTensor."""
    if not traced_for_spmd():
        return _original_pack_grad(op, grad)
    axis = op.get_attr("axis")
    if axis < 0:
        axis += grad.shape.rank
    return [tf.squeeze(part, axis) for part in tf.split(grad, op.get_attr("N"), axis=axis)]


def _window_padding(op, size: int, out: int, dim: int, kernel: int, stride: int, dilation: int) -> tuple[int, int]:
    """The padding before and after spatial dimension `dim` (NHWC) of a windowed op, as TensorFlow computes it."""
    padding = op.get_attr("padding")
    padding = padding.decode() if isinstance(padding, bytes) else padding
    if padding == "EXPLICIT":
        explicit = op.get_attr("explicit_paddings")
        return explicit[2 * dim], explicit[2 * dim + 1]
    if padding == "VALID":
        return 0, 0
    total = max((out - 1) * stride + (kernel - 1) * dilation + 1 - size, 0)
    return total // 2, total - total // 2


def _spread(values, axis: int, stride: int, offset: int, length: int):
    """`values` placed along `axis` at `offset + stride * k` of a zero tensor `length` long there (no scatter)."""
    shape = values.shape.as_list()
    out = shape[axis]
    if stride > 1:
        zeros = tf.zeros_like(values)
        values = tf.stack([values] + [zeros] * (stride - 1), axis=axis + 1)
        values = tf.reshape(values, [-1] + shape[1:axis] + [out * stride] + shape[axis + 1 :])
    end = offset + out * stride
    pads = [[0, 0]] * len(shape)
    pads[axis] = [offset, max(length - end, 0)]
    values = tf.pad(values, pads)
    if end > length:  # the trailing zeros of the last stride
        begin, size = [0] * len(shape), [-1] * len(shape)
        size[axis] = length
        values = tf.slice(values, begin, size)
    return values


def _windows(op, x_shape, out_shape, kernel, strides, dilations):
    """Per spatial dimension (H, W): (size, out, kernel, stride, dilation, before, after); None if not static."""
    dims = []
    for dim in (1, 2):
        size, out = x_shape[dim], out_shape[dim]
        if size is None or out is None:
            return None
        k, st, d = kernel[dim - 1], strides[dim], dilations[dim]
        dims.append((size, out, k, st, d, *_window_padding(op, size, out, dim, k, st, d)))
    return dims


def _static_nhwc(op, *tensors) -> bool:
    data_format = op.get_attr("data_format")
    data_format = data_format.decode() if isinstance(data_format, bytes) else data_format
    return data_format == "NHWC" and all(
        t.shape.rank == 4 and None not in t.shape.as_list()[1:] for t in tensors
    )


def depthwise_conv_gradient(op, grad):
    """The gradients of a depthwise convolution, from strided slices and padding in DTensor programs (NHWC)."""
    x, w = op.inputs
    if not traced_for_spmd() or not _static_nhwc(op, x, grad) or not w.shape.is_fully_defined():
        return _original_depthwise_grad(op, grad)
    kh, kw, channels, multiplier = w.shape.as_list()
    dims = _windows(op, x.shape.as_list(), grad.shape.as_list(), (kh, kw), op.get_attr("strides"),
                    op.get_attr("dilations"))
    (_, oh, _, _, _, top, bottom), (_, ow, _, _, _, left, right) = dims
    (sh, dh), (sw, dw) = (dims[0][3], dims[0][4]), (dims[1][3], dims[1][4])
    padded = tf.pad(x, [[0, 0], [top, bottom], [left, right], [0, 0]])
    g = tf.reshape(grad, [-1, oh, ow, channels, multiplier])
    terms = []
    for i in range(kh):
        for j in range(kw):
            patch = padded[:, i * dh : i * dh + (oh - 1) * sh + 1 : sh, j * dw : j * dw + (ow - 1) * sw + 1 : sw, :]
            terms.append(tf.reduce_sum(patch[..., None] * g, axis=[0, 1, 2]))
    filter_grad = tf.reshape(tf.stack(terms), [kh, kw, channels, multiplier])
    input_grad = None
    for i in range(kh):
        for j in range(kw):
            share = tf.reduce_sum(g * w[i, j], axis=-1)  # [batch, oh, ow, channels]: what tap (i, j) sends back
            term = _spread(_spread(share, 1, sh, i * dh, padded.shape[1]), 2, sw, j * dw, padded.shape[2])
            input_grad = term if input_grad is None else input_grad + term
    height, width = x.shape[1], x.shape[2]
    input_grad = input_grad[:, top : top + height, left : left + width, :]
    return [input_grad, filter_grad]


def avg_pool_gradient(op, grad):
    """The gradient of average pooling; in DTensor programs (NHWC) spread by padding and reshapes, no AvgPoolGrad."""
    x = op.inputs[0]
    if not traced_for_spmd() or not _static_nhwc(op, x, grad):
        return _original_avg_pool_grad(op, grad)
    ksize = op.get_attr("ksize")
    dims = _windows(op, x.shape.as_list(), grad.shape.as_list(), (ksize[1], ksize[2]), op.get_attr("strides"),
                    (1, 1, 1, 1))
    counts = []
    for size, out, k, stride, _, before, _ in dims:  # the window's entries inside the input (padding excluded)
        starts = np.arange(out) * stride - before
        counts.append(np.minimum(starts + k, size) - np.maximum(starts, 0))
    count = (counts[0][:, None] * counts[1][None, :]).astype(grad.dtype.as_numpy_dtype)[None, :, :, None]
    share = grad / count
    (h, _, kh, sh, _, top, bottom), (w, _, kw, sw, _, left, right) = dims
    total = None
    for i in range(kh):
        rows = _spread(share, 1, sh, i, h + top + bottom)
        for j in range(kw):
            term = _spread(rows, 2, sw, j, w + left + right)
            total = term if total is None else total + term
    return total[:, top : top + h, left : left + w, :]


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


def _registered(name: str, replacement, original):
    """The function TensorFlow's gradient registry holds for op `name` (its source is a hook's probe)."""
    entry = tf_ops._gradient_registry._registry.get(name, {}).get("type")
    return entry if entry is not replacement else original


def _gradient_hook(name: str, ops: tuple, module, attribute: str, replacement, original, probe: tuple):
    """A hook replacing TensorFlow's gradient function `module.attribute` of `ops` with `replacement`.

    TensorFlow's registry holds the function object itself, so after the patch its entries of `ops` are
    pointed at the module's (now replaced) attribute.
    """

    def repoint() -> None:
        for op in ops:
            tf_ops._gradient_registry._registry[op]["type"] = getattr(module, attribute)

    return hook(name, _registered(ops[-1], replacement, original), probe, "model_parallel",
                patch=(module, attribute, replacement), after=repoint)  # fmt: skip


HOOKS = (
    _gradient_hook("top_k_gradient", _TOP_K_OPS, nn_grad, "_TopKGrad", top_k_gradient, _original_top_k_grad,
                   ("array_ops.scatter_nd(", "math_ops.range(0,", "[math_ops.reduce_prod(in_shape)]")),
    _gradient_hook("pack_gradient", ("Pack",), array_grad, "_PackGrad", pack_gradient, _original_pack_grad,
                   ('axis=op.get_attr("axis")', "array_ops_stack.unstack(")),
    _gradient_hook("depthwise_conv_gradient", ("DepthwiseConv2dNative",), nn_grad, "_DepthwiseConv2dNativeGrad",
                   depthwise_conv_gradient, _original_depthwise_grad,
                   ("gen_nn_ops.depthwise_conv2d_native_backprop_filter(", "array_ops.shape(op.inputs[1])")),
    _gradient_hook("avg_pool_gradient", ("AvgPool",), nn_grad, "_AvgPoolGrad", avg_pool_gradient,
                   _original_avg_pool_grad, ("gen_nn_ops.avg_pool_grad(", 'op.get_attr("ksize")')),
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
