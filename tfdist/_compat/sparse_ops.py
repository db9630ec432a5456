"""Keras' sparse-aware elementwise ops (TensorFlow backend): operands laid out by the strategy first.

Keras keeps an IndexedSlices gradient (an Embedding's) sparse through `add`,
`subtract`, `maximum`, `minimum` (densified against a dense operand),
`multiply` and `divide` (the dense operand gathered at its rows; `divide`
unions indices in a `cond`). Under a tfdist strategy, an op that meets an
IndexedSlices first hands its operands to
`TfdistExtended._tfdist_sparse_operands` (DTensor lays out no dynamic number of
rows split); the op itself is Keras'. Checked on Keras 3.15.
"""

from __future__ import annotations

import tensorflow as tf
from keras.src.backend.tensorflow import numpy as keras_tf_numpy

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
        if isinstance(x1, tf.IndexedSlices) or isinstance(x2, tf.IndexedSlices):
            extended = _extended.extended_of(tf.distribute.get_strategy())
            if extended is not None:
                x1, x2 = extended._tfdist_sparse_operands(densify, x1, x2)
        return original(x1, x2)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = original.__doc__
    return op


HOOKS = tuple(
    hook(
        f"sparse_{name}",
        original,
        ("@sparse.elementwise_", f"def {name}(x1, x2):"),
        "model_parallel",
        patch=(keras_tf_numpy, name, _laid_out(name)),
    )
    for name, original in _originals.items()
)
