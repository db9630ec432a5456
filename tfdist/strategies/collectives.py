"""The collectives tfdist's training step runs, as public functions for tools (benchmarks, the advisor).

Example:

>>> import tensorflow as tf, tfdist
>>> from tfdist.strategies import collectives
>>> strategy = tfdist.DataParallelStrategy(devices=["CPU:0"])
>>> summed = strategy.run(lambda: collectives.all_reduce_gradients(strategy, [tf.ones([2])]))
>>> summed[0].numpy().tolist()
[1.0, 1.0]
"""

from __future__ import annotations

import tensorflow as tf


def all_reduce_gradients(strategy, grads) -> list:
    """Sums per-replica gradients over all replicas of `strategy` as its training step does.

    Call it in replica context (inside `strategy.run`). A tfdist strategy
    all-reduces the way its `fit` does (for example in its `gradient_dtype`,
    each result cast back to its gradient's dtype); any other
    `tf.distribute.Strategy` uses the replica context's `all_reduce` (SUM).

    Args:
        strategy: the strategy whose replicas run this.
        grads: a list of gradient tensors, one per variable.

    Returns:
        The summed gradients, a list in the order of `grads`.

    Raises:
        RuntimeError: when called outside a replica context of `strategy`.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.strategy is not strategy:
        raise RuntimeError(
            "all_reduce_gradients(strategy, grads) runs in a replica context of `strategy`: call it inside "
            "strategy.run(...)."
        )
    grads = list(grads)
    reduce = getattr(strategy.extended, "_tfdist_all_reduce_gradients", None)
    if reduce is None:
        return list(context.all_reduce(tf.distribute.ReduceOp.SUM, grads)) if grads else []
    return list(reduce(grads))
