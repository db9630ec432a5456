"""tfdist's replacements for gradients DTensor cannot lay out give TensorFlow's own numbers (no mesh needed).

`tfdist/_compat/spmd_ops.py` computes the gradients of a depthwise convolution (filter and input), of average
pooling and of a stack with ops DTensor expands; outside any tfdist strategy they are what a DTensor program
gets, so here each is called on the op TensorFlow traced and compared with TensorFlow's own gradient over
paddings, strides and channel multipliers. Tolerance 1e-5 relative: float32 sums in another order.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfdist._compat import spmd_ops


def _both(forward, replacement, original, *inputs):
    """(replacement's gradients, TensorFlow's) of `forward`'s single op at `inputs`, for a random incoming gradient."""

    @tf.function
    def grads(*args):
        out = forward(*args)
        incoming = tf.cos(tf.reshape(tf.range(tf.size(out), dtype=out.dtype), tf.shape(out)))
        return replacement(out.op, incoming), original(out.op, incoming)

    ours, theirs = grads(*[tf.constant(x) for x in inputs])
    return [np.asarray(g) for g in tf.nest.flatten(ours)], [np.asarray(g) for g in tf.nest.flatten(theirs)]


def _close(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


@pytest.mark.parametrize(
    "size, kernel, strides, padding, multiplier",
    [(8, 3, 1, "SAME", 1), (8, 3, 2, "SAME", 2), (9, 5, 2, "SAME", 1), (7, 3, 2, "VALID", 1), (8, 4, 3, "SAME", 1),
     (6, 2, 2, [0, 0, 1, 0, 0, 1, 0, 0], 3)],
)  # fmt: skip
def test_depthwise_convolution_gradients_equal_tensorflows(size, kernel, strides, padding, multiplier):
    # (Dilated depthwise convolutions reach TensorFlow's CPU kernel as space-to-batch around an undilated one.)
    rng = np.random.default_rng(size * kernel + strides)
    x = rng.normal(size=(3, size, size + 1, 4)).astype("float32")
    w = rng.normal(size=(kernel, kernel, 4, multiplier)).astype("float32")
    explicit = isinstance(padding, list)
    forward = lambda x, w: tf.raw_ops.DepthwiseConv2dNative(  # noqa: E731
        input=x, filter=w, strides=[1, strides, strides, 1], padding="EXPLICIT" if explicit else padding,
        explicit_paddings=padding if explicit else [],
    )  # fmt: skip
    _close(*_both(forward, spmd_ops.depthwise_conv_gradient, spmd_ops._original_depthwise_grad, x, w))


@pytest.mark.parametrize("size, window, strides, padding", [(8, 2, 2, "VALID"), (7, 3, 2, "SAME"), (9, 3, 1, "SAME"),
                                                             (8, 3, 2, "VALID"), (5, 2, 1, "SAME")])  # fmt: skip
def test_average_pooling_gradient_equals_tensorflows(size, window, strides, padding):
    x = np.random.default_rng(size + window).normal(size=(2, size, size + 2, 3)).astype("float32")
    forward = lambda x: tf.nn.avg_pool2d(x, window, strides, padding)  # noqa: E731
    _close(*_both(forward, spmd_ops.avg_pool_gradient, spmd_ops._original_avg_pool_grad, x))


@pytest.mark.parametrize("axis", [0, 2, -1, -2])
def test_stack_gradient_equals_tensorflows(axis):
    x = np.random.default_rng(4).normal(size=(2, 3, 4)).astype("float32")
    forward = lambda x: tf.stack([x, 2.0 * x, -x], axis=axis)  # noqa: E731
    _close(*_both(forward, spmd_ops.pack_gradient, spmd_ops._original_pack_grad, x))
