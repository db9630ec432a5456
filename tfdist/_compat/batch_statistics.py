"""Layers that compute from the batch: BatchNormalization's moments and KerasHub's MoE load balancing.

Under a data-parallel strategy each replica computes these from its own part of
the global batch (in a pipeline, from one micro-batch), which is not what one
device computes. Under a tfdist strategy whose `TfdistExtended` asks for the
global batch's statistics (`_tfdist_global_batch_statistics`, e.g.
`DataParallelStrategy(batch_statistics="global")`) they are computed from sums
over the global batch instead, all-reduced by `_tfdist_sum_batch_statistics`
(which weights each replica by its real examples: a padded replica adds
nothing), so training equals one device:

* `synchronized_moments` replaces Keras' `_compute_moments_sync` (TF backend of
  `keras.ops.moments(..., synchronized=True)`, also what
  `BatchNormalization(synchronized=True)` calls): sum and count are all-reduced,
  then the sum of squared differences from the global mean (two passes, as one
  device computes moments; Keras' one-pass sum of squares loses digits). Keras
  counts a padded replica's filler example; tfdist does not. It is the opt-in
  for a user's own layer: `keras.ops.moments(x, axes=[0], synchronized=True)`
  gives the global batch's mean under tfdist's data-parallel strategies and the
  batch's on one device.
* `batch_norm_moments` replaces `BatchNormalization._moments`: a layer (or a
  subclass) in training takes the global moments when the strategy asks, or
  when it was built with `synchronized=True`; masked moments too.
* KerasHub's MoE families (`MOE_FAMILIES`: Mixtral, Qwen-MoE, Qwen3-MoE,
  Qwen3.5-MoE; GPT-OSS adds no balancing loss) add the Switch-Transformer load
  balancing loss `num_experts * sum_e f_e * P_e` (f: the fraction of tokens
  routed to expert e, averaged over the top-k choices; P: the mean router
  probability of e; both over the unmasked tokens). Each family's
  `compute_load_balancing_loss` is replaced by `_global_balancing_loss`: when
  the strategy asks (`_tfdist_global_batch_losses()`), it computes the
  per-expert sums and the token count and hands them, with the loss as a
  function of their global values, to `_tfdist_batch_loss` (data parallelism
  all-reduces them; a pipeline sums its micro-batches' too). KerasHub
  is imported late (and is optional), so these hooks are made and applied by
  `install_moe_hooks()` when a model is first trained
  (`moe_hooks()` lists them for the modules already imported).

`batch_dependent_layers(model)` names the layers of a model that compute from
the batch, for the strategies' warning at `fit`. Checked on Keras 3.15 and
KerasHub 0.32.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys

import keras
import tensorflow as tf
from keras import ops
from keras.src.backend.tensorflow import nn as keras_tf_nn
from keras.src.layers.layer import Layer as _KerasLayer

from tfdist._compat._hook import EXACT
from tfdist._compat._hook import Hook
from tfdist._compat._hook import hook
from tfdist.strategies import _extended

_BatchNormalization = keras.layers.BatchNormalization
_original_moments_sync = keras_tf_nn._compute_moments_sync
_original_bn_moments = _BatchNormalization._moments


def _global_sums(extended, values):
    """`values` (local sums) summed over the global batch by `extended`, or None to keep them per replica."""
    return extended._tfdist_sum_batch_statistics(list(values))


def _moments_from_sums(extended, x, axes, keepdims, weights=None):
    """Mean and variance of `x` over `axes` from global sums; `weights` (broadcast to `x`) mask elements.

    Two passes, as one device computes them (`tf.nn.moments`, and Keras' masked
    moments): the global mean from all-reduced sums (of `x`, or `w x`) and counts,
    then the variance from the all-reduced sum of squared differences from it. The
    one-pass E[x^2] - E[x]^2 (Keras' synchronized moments) loses digits to
    cancellation where the mean is large against the spread (a ResNet's moving
    variance 3.6e-6 off one device after 4 steps); two passes agree to rounding.
    """
    if weights is None:
        total = tf.reduce_sum(x, axes, keepdims=True)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype)
        total, count = _global_sums(extended, (total, count))
        mean = tf.math.divide_no_nan(total, count)
        (squares,) = _global_sums(
            extended, (tf.reduce_sum(tf.math.squared_difference(x, tf.stop_gradient(mean)), axes, keepdims=True),)
        )
        variance = tf.math.divide_no_nan(squares, count)
    else:
        total, count = _global_sums(
            extended, (tf.reduce_sum(x * weights, axes, keepdims=True), tf.reduce_sum(weights, axes, keepdims=True))
        )
        denominator = count + keras.backend.epsilon()
        mean = total / denominator
        (squares,) = _global_sums(extended, (tf.reduce_sum(tf.square(x - mean) * weights, axes, keepdims=True),))
        variance = squares / denominator
    if not keepdims:
        mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
    return mean, variance


def synchronized_moments(x, axes, keepdims):
    """Keras' `_compute_moments_sync`: under a tfdist strategy, from sums the strategy all-reduces."""
    extended = _extended.in_replica()
    if extended is None:
        return _original_moments_sync(x, axes, keepdims)
    return _moments_from_sums(extended, x, list(axes), keepdims)


def batch_norm_moments(self, inputs, mask):
    """`BatchNormalization._moments`: the global batch's when the strategy asks for it or the layer is synchronized."""
    extended = _extended.in_replica()
    if extended is None or not (self.synchronized or extended._tfdist_global_batch_statistics()):
        return _original_bn_moments(self, inputs, mask)
    axes = list(self._reduction_axes)
    if mask is None:
        return _moments_from_sums(extended, inputs, axes, keepdims=False)
    weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs)), inputs.dtype)
    mean, variance = _moments_from_sums(extended, inputs, axes, keepdims=True, weights=weights)
    return tf.squeeze(mean), tf.squeeze(variance)


# ------------------------------------------------------------------ MoE load balancing (KerasHub)
@dataclasses.dataclass(frozen=True)
class MoeFamily:
    """A KerasHub MoE family whose sparse block adds the Switch load-balancing loss from its batch.

    Attributes:
        module: the decoder module defining `compute_load_balancing_loss` and the block.
        block: the block's class name (the layer named in warnings).
        coefficient: the block's attribute scaling the loss (0: no loss).
    """

    module: str
    block: str
    coefficient: str


_MODELS = "keras_hub.src.models"
_QWEN_COEFFICIENT = "router_aux_loss_coefficient"
MOE_FAMILIES = (
    MoeFamily(f"{_MODELS}.mixtral.mixtral_decoder", "MixtralSparseMoeBlock", "router_aux_loss_coef"),
    MoeFamily(f"{_MODELS}.qwen_moe.qwen_moe_decoder", "QwenSparseMoeBlock", _QWEN_COEFFICIENT),
    MoeFamily(f"{_MODELS}.qwen3_moe.qwen3_moe_decoder", "Qwen3SparseMoeBlock", _QWEN_COEFFICIENT),
    MoeFamily(f"{_MODELS}.qwen3_5_moe.qwen3_5_moe_decoder", "Qwen3_5MoeSparseMoeBlock", _QWEN_COEFFICIENT),
)
# What every family's function must still compute for `_global_balancing_loss` to stand in for it.
_BALANCING_NEEDLES = (
    "router_logits, num_experts, top_k, attention_mask=None",
    "ops.softmax(",
    "ops.top_k(",
    "ops.one_hot(",
    "tokens_per_expert = ops.mean(",
    "ops.sum(tokens_per_expert * router_prob_per_expert)",
    "* num_experts",
)
_MOE_HOOKS: dict[str, tuple[Hook, Hook]] = {}


def _token_mask(attention_mask, tokens):
    """Each routed token's weight (tokens, 1): 1 unmasked, from a (batch, seq) or (batch, seq, seq) mask."""
    if len(attention_mask.shape) == 3:
        attention_mask = ops.any(attention_mask, axis=-1)
    seq_len = ops.shape(attention_mask)[1]
    attention_mask = ops.slice(attention_mask, [0, 0], [tokens // seq_len, seq_len])
    return ops.cast(ops.reshape(attention_mask, (-1, 1)), "float32")


def _global_balancing_loss(original, router_logits, num_experts, top_k, attention_mask=None):
    """The family's balancing loss, over the global batch when the strategy asks for it (else `original`'s)."""
    extended = _extended.in_replica()
    if extended is None or not extended._tfdist_global_batch_losses():
        return original(router_logits, num_experts, top_k, attention_mask=attention_mask)
    routing_weights = ops.softmax(router_logits, axis=-1)
    _, selected_experts = ops.top_k(routing_weights, k=top_k)
    # The fraction of each token's top-k choices that is expert e: (tokens, num_experts).
    chosen = ops.mean(ops.one_hot(selected_experts, num_experts), axis=1)
    tokens = ops.shape(router_logits)[0]
    if attention_mask is None:
        weights = ops.ones((tokens, 1), dtype="float32")
    else:
        weights = _token_mask(attention_mask, tokens)
    weights = ops.cast(weights, routing_weights.dtype)
    sums = [
        ops.sum(ops.cast(chosen, routing_weights.dtype) * weights, axis=0),
        ops.sum(routing_weights * weights, axis=0),
        ops.sum(weights),
    ]

    def loss(global_sums):
        chosen_sum, probability_sum, count = global_sums
        count = ops.maximum(count, 1e-9)
        return ops.sum((chosen_sum / count) * (probability_sum / count)) * num_experts

    return extended._tfdist_batch_loss(sums, loss)


def _family_hooks(family: MoeFamily) -> tuple[Hook, Hook]:
    module = sys.modules[family.module]
    original = module.compute_load_balancing_loss

    def compute_load_balancing_loss(router_logits, num_experts, top_k, attention_mask=None):
        return _global_balancing_loss(original, router_logits, num_experts, top_k, attention_mask)

    name = family.module.rsplit(".", 1)[-1]
    return (
        hook(
            f"moe_balancing:{name}",
            original,
            _BALANCING_NEEDLES,
            *EXACT,
            patch=(module, "compute_load_balancing_loss", compute_load_balancing_loss),
        ),
        hook(
            f"moe_balancing_call:{name}",
            getattr(module, family.block).call,
            ("compute_load_balancing_loss(", f"self.add_loss(self.{family.coefficient} * aux_loss)"),
            *EXACT,
        ),
    )


def moe_hooks(*, load: bool = False) -> tuple[Hook, ...]:
    """The hooks of the `MOE_FAMILIES` whose KerasHub module is imported (`load`: import them all first)."""
    hooks = []
    for family in MOE_FAMILIES:
        if load:
            importlib.import_module(family.module)
        if family.module not in sys.modules:
            continue
        if family.module not in _MOE_HOOKS:
            _MOE_HOOKS[family.module] = _family_hooks(family)
        hooks.extend(_MOE_HOOKS[family.module])
    return tuple(hooks)


def _moe_family(layer) -> MoeFamily | None:
    for family in MOE_FAMILIES:
        module = sys.modules.get(family.module)
        if module is not None and isinstance(layer, getattr(module, family.block)):
            return family
    return None


def install_moe_hooks() -> None:
    """Checks and applies the balancing hooks of the imported `MOE_FAMILIES` (once each).

    Called when a model is first trained: a model using a family has imported its module by then.
    """
    hooks = moe_hooks()
    for h in hooks:
        h.check()
    for h in hooks:
        h.apply()


def batch_dependent_layers(model, *, norms: bool = True, losses: bool = True) -> list[str]:
    """`"<kind> <path>"` for each layer of `model` that computes from the batch in training.

    `norms`: BatchNormalization layers (and subclasses) that are trainable; `losses`: KerasHub MoE
    blocks of `MOE_FAMILIES` with a nonzero balancing-loss coefficient.
    """
    found = []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, _BatchNormalization):
            if norms and layer.trainable:
                found.append(f"{type(layer).__name__} {layer.path!r}")
            continue
        family = _moe_family(layer)
        if losses and family is not None and getattr(layer, family.coefficient, 0):
            found.append(f"{type(layer).__name__} {layer.path!r} (load-balancing loss)")
    return found


HOOKS = (
    hook(
        "moments_sync",
        keras_tf_nn.moments,
        ("if synchronized:", "_compute_moments_sync(x, axes, keepdims)"),
        *EXACT,
        patch=(keras_tf_nn, "_compute_moments_sync", synchronized_moments),
    ),
    hook(
        "batch_norm_moments",
        _BatchNormalization,
        (
            "mean, variance = self._moments(inputs, mask)",
            "synchronized=self.synchronized",
            "mean = masked_input_sum / (sum_of_weights + backend.epsilon())",
            "variance = weighted_distsq / (sum_of_weights + backend.epsilon())",
        ),
        *EXACT,
        patch=(_BatchNormalization, "_moments", batch_norm_moments),
    ),
    hook(
        "batch_layers_walk",
        _KerasLayer._flatten_layers,
        ("def _flatten_layers(self, include_self=True, recursive=True)",),
        *EXACT,
    ),
)
