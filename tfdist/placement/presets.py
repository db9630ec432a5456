"""Layout rule presets for common model families.

Each preset returns a `LayoutRules`; combine presets with `+` and pass the
result to `tfdist.ModelParallelStrategy(rules=...)`. The regexes follow Keras'
default layer names and those of `tfdist.models`; each preset takes the layer
name patterns as arguments so models with other names can use it too.
"""

from __future__ import annotations

from tfdist.placement.rules import LayoutRules
from tfdist.placement.rules import Rule


def _layer(pattern: str) -> str:
    """A regex for a whole path component matching `pattern`."""
    return rf"(^|/)({pattern})/"


def transformer(
    *,
    axis: str = "model",
    mlp_in: str = r"(mlp|ffn|ffw|feed_forward)[^/]*_(in|up|gate)",
    mlp_out: str = r"(mlp|ffn|ffw|feed_forward)[^/]*_(out|down)",
    attention: str = r"[^/]*",
    embedding: str = r"(?!pos)[^/]*embedding[^/]*",
    lm_head: str = r"logits|lm_head",
) -> LayoutRules:
    """Megatron-style tensor parallelism for transformer blocks.

    * MLP: the first Dense / EinsumDense (`mlp_in`) is column-parallel (its
      kernel's output dimension and its bias are split), the second (`mlp_out`)
      row-parallel (its kernel's input dimension is split; DTensor all-reduces
      its output), so the hidden activation stays split between the two.
    * MultiHeadAttention (sublayers `query`, `key`, `value`,
      `attention_output` of a layer matching `attention`): head-parallel, each
      device holds `num_heads / axis size` heads.
    * Embedding tables (layers matching `embedding`, by default any name
      containing "embedding" that does not start with "pos") and the LM head
      (`lm_head`): split over the vocabulary.

    LayerNorms, position embeddings and the row-parallel biases stay replicated.

    Args:
        axis: the mesh axis to split over.
        mlp_in, mlp_out, attention, embedding, lm_head: regexes for the layer
            names (one path component) of each part.

    Returns:
        `LayoutRules`.

    Example:

    >>> from tfdist import layouts
    >>> rules = layouts.transformer()
    >>> rules.spec_for("block_0/mlp_in/kernel", (64, 256), {"batch": 2, "model": 4})
    (None, 'model')
    >>> rules.spec_for("block_0/attention/query/kernel", (64, 8, 8), {"batch": 2, "model": 4})
    (None, 'model', None)
    >>> rules.spec_for("token_embedding/embeddings", (1000, 64), {"batch": 2, "model": 4})
    ('model', None)
    """
    return LayoutRules(
        [
            (_layer(mlp_in) + "kernel$", (..., axis)),
            (_layer(mlp_in) + "bias$", (axis,)),
            (_layer(mlp_out) + "kernel$", (axis, None)),
            (rf"{_layer(attention)}(query|key|value)/kernel$", (None, axis, None)),
            (rf"{_layer(attention)}(query|key|value)/bias$", (axis, None)),
            (rf"{_layer(attention)}attention_output/kernel$", (axis, None, None)),
            (_layer(embedding) + "embeddings$", (axis, None)),
            (_layer(lm_head) + "kernel$", (None, axis)),
            (_layer(lm_head) + "bias$", (axis,)),
        ]
    )


def conv(*, axis: str = "model", layers: str = r"(?!depthwise)[^/]*conv[123]d(_\d+)?") -> LayoutRules:
    """Splits convolution weights over their output channels (kernel's last dimension and the bias).

    DTensor (TensorFlow 2.21) runs a convolution only on a whole filter, so the
    kernels are stored split (with their optimizer slots: 1 / axis size of the
    memory) and gathered whole for each use (`Rule(..., gather=True)`, as in
    FSDP / ZeRO-3); their gradients are reduce-scattered back. Biases too (a
    split bias would make DTensor expect a split convolution output).

    Args:
        axis: the mesh axis to split over.
        layers: a regex for the convolution layer names (one path component);
            the default matches Keras' default names ("conv2d", "conv2d_3",
            "stem_conv2d") but not depthwise or transposed convolutions.

    Returns:
        `LayoutRules`.

    Example:

    >>> from tfdist import layouts
    >>> layouts.conv().spec_for("conv2d_1/kernel", (3, 3, 16, 32), {"model": 4})
    (None, None, None, 'model')
    """
    return LayoutRules(
        [
            Rule(_layer(layers) + "kernel$", (..., axis), gather=True),
            Rule(_layer(layers) + "bias$", (axis,), gather=True),
        ]
    )


def data_parallel() -> LayoutRules:
    """No rules: every weight replicated, batches split over the batch axis.

    Example:

    >>> from tfdist import layouts
    >>> len(layouts.data_parallel())
    0
    """
    return LayoutRules()
