"""Keras' sparse-aware elementwise ops (TensorFlow backend): operands laid out by the strategy first.

Keras keeps an IndexedSlices gradient (an Embedding's) sparse through `add`,
`subtract`, `maximum`, `minimum` (densified against a dense operand),
`multiply` and `divide` (the dense operand gathered at its rows; `divide`
unions indices in a `cond`). Under a tfdist strategy, an op that meets an
IndexedSlices first hands its operands to
`TfdistExtended._tfdist_sparse_operands` (DTensor lays out no dynamic number of
rows split); the op itself is Keras', except one: in a DTensor program
(`_tfdist_spmd`), rows divided by a dense tensor are `divide_rows`, without
Keras' `cond` (whose other branch unions the rows with the divisor's zero rows;
TF 2.21's DTensor cannot lower it once the quotient meets a split tensor:
"DTensorAllScatter requires slice on input axis 0 which is dynamic", Adadelta
with an Embedding). Checked on Keras 3.15.
"""

from __future__ import annotations

import tensorflow as tf
from keras.src.backend.tensorflow import numpy as keras_tf_numpy
from keras.src.backend.tensorflow import sparse as keras_tf_sparse

from tfdist._compat._hook import hook
from tfdist.strategies import _extended

# Keras' decorators: elementwise_binary_union (densify against a dense operand), elementwise_binary_intersection,
# elementwise_division.
DENSIFYING = ("add", "subtract", "maximum", "minimum")
GATHERING = ("multiply", "divide")
_originals = {name: getattr(keras_tf_numpy, name) for name in DENSIFYING + GATHERING}


def _laid_out(name):
    original, densify = _originals[name], name in DENSIFYING

    def op(x1, x2):
        if not isinstance(x1, tf.IndexedSlices) and not isinstance(x2, tf.IndexedSlices):
            return original(x1, x2)
        extended = _extended.extended_of(tf.distribute.get_strategy())
        if extended is None:
            return original(x1, x2)
        x1, x2 = extended._tfdist_sparse_operands(densify, x1, x2)
        if name == "divide" and extended._tfdist_spmd and _rows_by_dense(x1, x2) and not tf.executing_eagerly():
            return divide_rows(x1, x2)
        return original(x1, x2)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = original.__doc__
    return op


def _rows_by_dense(x1, x2) -> bool:
    return isinstance(x1, tf.IndexedSlices) and isinstance(x2, (tf.Tensor, tf.Variable)) and bool(x2.shape.rank)


def divide_rows(x1: tf.IndexedSlices, x2) -> tf.IndexedSlices:
    """`x1 / x2` for rows `x1` and a dense `x2`: each row divided by `x2`'s row at its index, without a `cond`.

    The numbers of Keras' sparse `divide` whenever no row of `x2` that `x1`
    leaves untouched holds a zero or NaN (an optimizer's divisor, sqrt(slot +
    epsilon), never does). Where one does, Keras also returns that row (a zero
    divided there: NaN or +-0); here it stays untouched, as the sparse gradient
    leaves it. DTensor lowers neither Keras' `cond` nor any way of appending a
    step-dependent number of rows (`tf.where`, a dynamic slice).
    """
    return tf.IndexedSlices(x1.values / tf.gather(tf.convert_to_tensor(x2), x1.indices), x1.indices, x1.dense_shape)


HOOKS = tuple(
    hook(
        f"sparse_{name}",
        original,
        ("@sparse.elementwise_", f"def {name}(x1, x2):"),
        "model_parallel",
        patch=(keras_tf_numpy, name, _laid_out(name)),
    )
    for name, original in _originals.items()
) + (
    hook(
        "sparse_divide_rows",
        keras_tf_sparse.elementwise_division,
        ("func(x1.values, tf.gather(x2, x1.indices))", "indexed_slices_union_indices_and_values(", "tf.cond("),
        "model_parallel",
    ),
)
