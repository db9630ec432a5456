"""Micro-batching: a replica's batch split into micro-batches, their gradients summed, batch losses over all."""

from __future__ import annotations

import contextlib

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


def add_earlier(g, e):
    """`g`, a step's summed micro-batch gradient, plus `e`: the batch loss terms' gradient via earlier micro-batches.

    Two IndexedSlices (an embedding's lookups) are added row by row: `e` has a row for each row of the earlier
    micro-batches' part of `g`, the same lookups in the same order, and one device has one row per lookup
    holding both parts. Keras' optimizers update each row of a sparse gradient by itself (Adam's second moment
    adds a² + b² for two rows of one lookup, (a + b)² for one), so rows of their own would train otherwise.
    """
    if not (isinstance(g, tf.IndexedSlices) and isinstance(e, tf.IndexedSlices)):
        return add(g, e)
    with tf.device(_device(g)):
        n = tf.shape(e.indices)[0]
        same = tf.debugging.assert_equal(
            tf.cast(e.indices, g.indices.dtype), g.indices[:n],
            message="PipelineStrategy: the rows of a batch loss's gradient through the earlier micro-batches are "
            "not their lookups' rows, in order (a sparse gradient)",
        )
        with tf.control_dependencies([same]):
            values = tf.concat([g.values[:n] + tf.cast(e.values, g.values.dtype), g.values[n:]], axis=0)
        return tf.IndexedSlices(values, g.indices, g.dense_shape)


class Accumulator:
    """One step's micro-batch gradients: `add` returns None until the last micro-batch, then the sum.

    With `losses` (a `BatchLosses`), the sum includes the gradient its loss terms owe to the earlier
    micro-batches.
    """

    def __init__(self, losses: BatchLosses | None = None):
        self.sum = None
        self.last = False
        self.applied = False
        self.losses = losses

    def add(self, grads):
        if self.applied:  # an optimizer inside one that already took the sum (LossScaleOptimizer's inner)
            return grads
        if self.sum is not None:
            grads = [add(a, g) for a, g in zip(self.sum, grads)]
        if not self.last:
            self.sum = grads
            return None
        self.sum, self.applied = None, True
        if self.losses is not None:
            grads = [add_earlier(g, e) for g, e in zip(grads, self.losses.earlier_gradients(len(grads)))]
        return grads


def _on_gradient(value, record):
    """`value`, whose gradient, when the backward pass computes it, is also handed to `record`."""

    @tf.custom_gradient
    def identity(x):
        def grad(upstream):
            record(upstream)
            return upstream

        return tf.identity(x), grad

    return identity(value)


class BatchLosses:
    """A step's loss terms computed from sums over the whole batch (MoE load balancing), across micro-batches.

    One device computes such a term once, from the whole batch's sums. Here each
    micro-batch's forward pass adds its sums (`add`, by call order: the k-th call
    of each micro-batch is the same layer); earlier micro-batches add nothing to
    their loss, and the last adds the term of the global sums (over its replica's
    micro-batches, all-reduced over the replicas), scaled so that the step's
    summed, weighted loss holds it once. The last micro-batch's step
    differentiates it through its own sums; the gradient it receives there is
    recorded, and `earlier_gradients` takes the same term through the earlier
    micro-batches' sums to the variables with the step's outer tape
    (`recording`), which saw every micro-batch's forward pass.

    Args:
        replica_share: this replica's share of the global batch (1 for one replica).
        replicas: the number of replicas (the sums are all-reduced over them when more than one).
        variables: the variables gradients are taken for, in the order of the step's gradients
            (the model's trainable weights), or None in an evaluation step (no gradients).
    """

    def __init__(self, replica_share, *, replicas: int, variables):
        self._replica_share = replica_share
        self._replicas = replicas
        self._variables = variables
        self._calls = []  # per micro-batch: the sums of each call, in call order
        self._pending = []  # (a term over the earlier micro-batches' sums, its gradient), for the outer tape
        self._tape = None
        self._share = None
        self._last = False

    @contextlib.contextmanager
    def recording(self):
        """The step's outer tape around every micro-batch (a training step only)."""
        if self._variables is None:
            yield
            return
        with tf.GradientTape() as tape:
            self._tape = tape
            yield

    def begin(self, share, *, last: bool) -> None:
        """A micro-batch with `share` of the global batch (0 for a filler standing in for no example) begins."""
        self._share, self._last = share, last
        self._calls.append([])

    def add(self, sums, loss):
        """This micro-batch's term of `loss` (a function of the global `sums`), given its local `sums`."""
        live = self._share > 0
        sums = [s * tf.cast(live, s.dtype) for s in sums]  # a filler micro-batch adds nothing
        k = len(self._calls[-1])
        self._calls[-1].append(sums)
        if not self._last:
            return tf.zeros([], sums[0].dtype)
        earlier = [tf.add_n(parts) for parts in zip(*(c[k] for c in self._calls[:-1]))]

        def of_global(local, others):
            total = [a + b for a, b in zip(local, others)]
            if self._replicas > 1:
                total = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, total)
            return loss(total)

        # The same number twice: the term, differentiated by this micro-batch's step through its own sums, and
        # the target of the outer tape through the earlier micro-batches' sums, with the gradient the term gets.
        value = of_global(sums, [tf.stop_gradient(e) for e in earlier])
        if self._tape is not None and earlier:
            target = of_global([tf.stop_gradient(s) for s in sums], earlier)
            value = _on_gradient(value, lambda upstream: self._pending.append((target, upstream)))
        # The last micro-batch's loss is weighted by its own share: scaled, the step's loss holds the term once.
        ratio = tf.math.divide_no_nan(tf.cast(self._replica_share, value.dtype), tf.cast(self._share, value.dtype))
        return value * ratio

    def earlier_gradients(self, count: int) -> list:
        """The gradient of the step's batch loss terms through the earlier micro-batches' sums, per variable."""
        if self._tape is None or not self._pending:
            return [None] * count
        targets, upstream = zip(*self._pending)
        # `earlier_gradients` runs once, at the last micro-batch's apply; the tape stops recording here.
        grads = self._tape.gradient(list(targets), self._variables, output_gradients=list(upstream))
        self._pending.clear()
        return list(grads)
