"""Micro-batching: a replica's batch split into micro-batches, and their gradients summed."""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python.util import nest


def _batched(t) -> bool:
    return isinstance(t, tf.Tensor) and bool(t.shape.rank)


def batched_tensors(data) -> list:
    """The tensors of `data` with a batch dimension."""
    return [t for t in nest.flatten(data) if _batched(t)]


def split(data, m: int, count: int, n, static):
    """Micro-batch `m` of `count` of `data` (`n` examples, `static` its static batch size or None):
    (its structure, its example count, whether it is a filler standing in for no example).

    With a static batch size (a multiple of `count`) every micro-batch has `static // count`
    examples; otherwise they split as evenly as they go, and an empty one is a one-row filler.
    """
    if static is not None:
        size = static // count
        part = nest.map_structure(lambda t: t[m * size : (m + 1) * size] if _batched(t) else t, data)
        return part, size, False
    base, extra = n // count, n % count
    start = m * base + tf.minimum(m, extra)
    size = base + tf.cast(m < extra, n.dtype)

    def take(t):
        if not _batched(t):
            return t
        return tf.cond(size > 0, lambda: t[start : start + size], lambda: t[:1])

    return nest.map_structure(take, data), size, tf.equal(size, 0)


def _device(g) -> str:
    return (g.values if isinstance(g, tf.IndexedSlices) else g).device


def add(a, b):
    """The sum of two gradients (None for no gradient); two IndexedSlices stay sparse.

    The sum is computed on `a`'s device: a stage's micro-batch gradients add up where they were
    computed, and only their sum goes to the optimizer's update.
    """
    if a is None:
        return b
    if b is None:
        return a
    with tf.device(_device(a)):
        return _add(a, b)


def _add(a, b):
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        # Stay sparse: optimizers update only the rows a sparse gradient touches (Keras' Adam does),
        # so a densified sum would train differently from one device's whole-batch gradient.
        return tf.IndexedSlices(
            tf.concat([a.values, b.values], axis=0), tf.concat([a.indices, b.indices], axis=0), a.dense_shape
        )
    if isinstance(a, tf.IndexedSlices) or isinstance(b, tf.IndexedSlices):
        return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)
    return a + b


class Accumulator:
    """One step's micro-batch gradients: `add` returns None until the last micro-batch, then the sum."""

    def __init__(self):
        self.sum = None
        self.last = False
        self.applied = False

    def add(self, grads):
        if self.applied:  # an optimizer inside one that already took the sum (LossScaleOptimizer's inner)
            return grads
        if self.sum is not None:
            grads = [add(a, g) for a, g in zip(self.sum, grads)]
        if not self.last:
            self.sum = grads
            return None
        self.sum, self.applied = None, True
        return grads
