"""Layout rule presets for common model families.

Each preset returns a `LayoutRules`; combine presets with `+` and pass the
result to `tfdist.ModelParallelStrategy(rules=...)`. `auto()` finds each
weight's role (attention projection, feed-forward layer, embedding, LM head,
expert bank, convolution) from the layer types and how the layers fit
together, whatever their names;
the other presets are regexes on weight paths that follow Keras' default layer
names and those of `tfdist.models`, with the patterns as arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

from tfdist.placement.roles import ROLES
from tfdist.placement.roles import RoleRule
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
    """Megatron-style tensor parallelism for transformer blocks, by layer name.

    The rules match weight paths, so they fit `tfdist.models` and models whose
    layers are named alike; for other names (KerasHub's GPT-2, Llama, Gemma,
    BERT) use `auto()`, which finds the same parts by layer type and position.

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


def auto(*, axis: str = "model", roles: Sequence[str] = ROLES, expert_axis: str | None = None) -> LayoutRules:
    """Megatron-style tensor parallelism found from what each layer does, not from its name.

    The same splits as `transformer()`, for weights found by role (see
    `tfdist.placement.roles`): the layer's type, the layer it belongs to, and
    its place among its siblings.

    * "attention_in": the query, key and value projections (the `Dense` /
      `EinsumDense` sublayers of an attention layer that split into heads:
      `MultiHeadAttention`, KerasHub's `CachedMultiHeadAttention`,
      `LlamaAttention`, `CachedGemmaAttention`, ...), split over the heads;
    * "attention_out": its output projection (the one merging the heads),
      split over the heads it sums;
    * "mlp_in": the first dense layer(s) of a feed-forward unit (both of a
      gated one: gate and up), split over their output units;
    * "mlp_out": the dense layer that takes their output back to the model
      width, split over its input units;
    * "embedding": `Embedding` tables (KerasHub's `ReversibleEmbedding` too),
      split over the vocabulary;
    * "lm_head": untied reverse embeddings, and a dense layer onto the
      vocabulary of the model's largest embedding, split over the vocabulary;
    * "expert": stacked expert weights `[experts, in, out]` (KerasHub's
      Mixtral, Qwen-MoE, Qwen3-MoE, GPT-OSS expert banks, or any layer holding
      such a bank) and their `[experts, n]` biases, split over the experts
      (expert parallelism); with `expert_axis`, over the experts on that
      axis and over each expert's hidden units on `axis` (experts x hidden);
    * "conv": `Conv1D` / `Conv2D` / `Conv3D` kernels and biases, split over
      their output channels, stored split and gathered whole for each use
      (as `conv()` places them).

    Row-parallel biases, norms and position embeddings stay replicated. A role
    whose dimension the axis does not divide (2 key/value heads over 4
    devices, a vocabulary of 50257) stays whole, with the reason in the
    placement report's note, instead of raising. The report's "chosen by"
    column names each weight's role ("attention query (EinsumDense in
    CachedMultiHeadAttention)").

    Path rules win over roles: `auto() + LayoutRules([...])` (either order)
    places the weights a path rule matches by that rule, the others by role.

    Under a strategy with these rules, the weights of a layer being built are
    created when the outermost build ends, once the whole block is known (for a
    functional model: each top-level layer; a subclassed model built by
    tracing its call: the whole model).

    Args:
        axis: the mesh axis to split over.
        roles: the roles to split, a subset of `tfdist.placement.roles.ROLES`
            (default: all); weights of the others stay replicated.
        expert_axis: a second model axis for the "expert" role (a mesh such as
            `{"batch": 2, "expert": 2, "model": 2}`): experts are split over
            it and each expert's hidden units over `axis`. Default: experts
            over `axis`, each expert whole.

    Returns:
        `LayoutRules` of role rules.

    Raises:
        ValueError: for an unknown or repeated role, an axis that is not a
            non-empty string, or an `expert_axis` equal to `axis`.

    Example:

    >>> import tfdist
    >>> from tfdist import layouts
    >>> [str(rule) for rule in layouts.auto(roles=["mlp_in", "mlp_out"])]
    ["role 'mlp_in' -> 'model'", "role 'mlp_out' -> 'model'"]
    >>> [str(rule) for rule in layouts.auto(roles=["expert", "conv"], expert_axis="expert")]
    ["role 'expert' -> ('expert', 'model')", "role 'conv' -> 'model' gathered for use"]
    >>> strategy = tfdist.ModelParallelStrategy(
    ...     mesh={"batch": 1, "model": 1}, devices=["CPU:0"], rules=layouts.auto())
    >>> with strategy.scope():
    ...     model = tfdist.models.transformer_lm(seq_len=8, vocab_size=32, d_model=16, num_heads=2, num_layers=1)
    >>> report = {v.path: v for v in strategy.placement_report(model, print_fn=None).variables}
    >>> report["block_0/attention/query/kernel"].spec, report["block_0/attention/query/kernel"].chosen_by
    ((None, 'model', None), 'attention query (EinsumDense in MultiHeadAttention)')
    >>> report["block_0/mlp_out/kernel"].spec, report["block_0/mlp_out/kernel"].chosen_by
    (('model', None), 'feed-forward out (Dense in TransformerBlock)')
    >>> report["logits/kernel"].chosen_by
    'LM head (Dense onto the 32-entry vocabulary of an embedding)'
    """
    if isinstance(roles, str) or not isinstance(roles, Sequence):
        raise ValueError(f"`roles` must be a list of role names from {list(ROLES)}; got {roles!r}.")
    unknown = [r for r in roles if r not in ROLES]
    if unknown:
        raise ValueError(f"Unknown role {unknown[0]!r} in `roles` of auto(). Valid roles: {list(ROLES)}.")
    repeated = sorted({r for r in roles if list(roles).count(r) > 1})
    if repeated:
        raise ValueError(f"Role {repeated[0]!r} is given twice in `roles` of auto(); keep one.")
    if expert_axis is not None and expert_axis == axis:
        raise ValueError(
            f"`expert_axis` of auto() is {expert_axis!r}, the same axis as `axis`; give another mesh axis "
            "(experts over it, each expert's hidden units over `axis`), or leave it None (experts over `axis`)."
        )
    return LayoutRules(
        [RoleRule.of(role, axis) if role != "expert" or expert_axis is None else RoleRule.of(role, expert_axis, axis)
         for role in roles]
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
