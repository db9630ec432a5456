"""Keras' optimizer `apply`: handed to the strategy, which all-reduces first and applies once.

Keras clips each replica's gradient before the all-reduce, and its accumulation
step calls `merge_call` inside a `cond` branch, which tf.distribute forbids.
Under a tfdist strategy, `apply` in replica context goes to
`TfdistExtended._tfdist_apply_gradients` with Keras' own `apply` to call once;
outside any replica context (a custom loop without `strategy.run`, where Keras'
`maybe_merge_call` finds no replica context and its lazy slot creation needs the
scope) it goes to `_tfdist_apply_outside_replica` of the strategy the optimizer
was created under;
`LossScaleOptimizer.apply` (which does not go through the base class') first
asks for the micro-batch sum (`_tfdist_accumulate_microbatch`), so its
loss-scale check and unscaling see the whole step's gradient.
Inside a replica step compiled with XLA, each `apply` is first offered to
`_tfdist_defer_apply` (it runs after the compiled part: its all-reduce cannot
run inside one device's XLA cluster).
`rekey` re-indexes an optimizer whose tf.Variables were replaced. Checked on
Keras 3.15.
"""

from __future__ import annotations

import keras
from keras.src.backend.tensorflow import optimizer as keras_tf_optimizer
from keras.src.optimizers import base_optimizer as keras_base_optimizer
from tensorflow.python.distribute import merge_call_interim

from tfdist._compat import lazy_build
from tfdist._compat._hook import EXACT
from tfdist._compat._hook import hook
from tfdist.strategies import _extended

_original_apply = keras_base_optimizer.BaseOptimizer.apply
_original_clip_gradients = keras_base_optimizer.BaseOptimizer._clip_gradients
_original_all_reduce_sum_gradients = keras_tf_optimizer.TFOptimizer._all_reduce_sum_gradients
_loss_scale_optimizer = keras.optimizers.LossScaleOptimizer
_original_loss_scale_apply = _loss_scale_optimizer.apply


def _apply(self, grads, trainable_variables=None):
    def keras_apply(g):
        return _original_apply(self, g, trainable_variables)

    extended = _extended.in_replica()
    if extended is not None and extended._tfdist_defer_apply(lambda g: self.apply(g, trainable_variables), grads):
        return None
    lazy_build.build_optimizer(self, trainable_variables)
    if extended is not None:
        return extended._tfdist_apply_gradients(
            grads, keras_apply, accumulates=bool(self.gradient_accumulation_steps)
        )
    extended = _extended.extended_of(self._distribution_strategy)
    if extended is not None:
        return extended._tfdist_apply_outside_replica(grads, keras_apply)
    return keras_apply(grads)


def _clip_gradients(self, grads):
    extended = _extended.in_replica()
    if extended is not None:
        grads = extended._tfdist_reduce_for_update(grads)
    return _original_clip_gradients(self, grads)


def _all_reduce_sum_gradients(self, grads_and_vars):
    extended = _extended.in_replica()
    if extended is not None and extended._tfdist_gradients_reduced():
        return list(grads_and_vars)
    return _original_all_reduce_sum_gradients(self, grads_and_vars)


def _loss_scale_apply(self, grads, trainable_variables=None):
    extended = _extended.in_replica()
    if extended is not None and extended._tfdist_defer_apply(lambda g: self.apply(g, trainable_variables), grads):
        return None
    if extended is not None:
        grads = extended._tfdist_accumulate_microbatch(list(grads))
        if grads is None:
            return None
    return _original_loss_scale_apply(self, grads, trainable_variables)


def rekey(optimizer) -> None:
    """Re-indexes a built optimizer's variables after their tf.Variables were replaced.

    Keras keys each trainable variable by its tf.Variable (`_var_key`); a strategy
    that moves a variable gives the Keras variable a new tf.Variable.
    """
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):  # LossScaleOptimizer wraps one
        if opt is not None:
            opt._trainable_variables_indices = {opt._var_key(v): i for i, v in enumerate(opt._trainable_variables)}


HOOKS = (
    hook(
        "optimizer_apply",
        keras_base_optimizer.BaseOptimizer.apply,
        ("_backend_apply_gradients",),
        *EXACT,
        "model_parallel",
        patch=(keras_tf_optimizer.TFOptimizer, "apply", _apply),
        original=_original_apply,  # TFOptimizer must not override the base class' apply
    ),
    hook(
        "optimizer_strategy",
        keras_tf_optimizer.TFOptimizer.__init__,
        ("self._distribution_strategy = tf.distribute.get_strategy()",),
        *EXACT,
        "model_parallel",
    ),
    hook(
        "optimizer_accumulation",
        keras_base_optimizer.BaseOptimizer._backend_apply_gradients,
        ("ops.cond(", "_clip_gradients(grads)", "_backend_update_step("),
        *EXACT,
    ),
    hook(
        "optimizer_all_reduce",
        keras_tf_optimizer.TFOptimizer._backend_update_step,
        ("_all_reduce_sum_gradients", "maybe_merge_call"),
        *EXACT,
    ),
    hook(
        "optimizer_clip",
        _original_clip_gradients,
        ("def _clip_gradients(self, grads):", "clip_by_global_norm(grads"),
        *EXACT,
        patch=(keras_base_optimizer.BaseOptimizer, "_clip_gradients", _clip_gradients),
    ),
    hook(
        "optimizer_all_reduce_sum",
        _original_all_reduce_sum_gradients,
        ("tf.distribute.get_replica_context().all_reduce(", "tf.distribute.ReduceOp.SUM"),
        *EXACT,
        patch=(keras_tf_optimizer.TFOptimizer, "_all_reduce_sum_gradients", _all_reduce_sum_gradients),
    ),
    hook(
        "optimizer_accumulate_locally",
        keras_tf_optimizer.TFOptimizer._backend_increment_gradient_accumulators,
        ("distribution.extended.update(", "maybe_merge_call("),
        *EXACT,
    ),
    hook("optimizer_merge_call", merge_call_interim.strategy_supports_no_merge_call, ("_use_merge_call()",), *EXACT),
    hook(
        "loss_scale_apply",
        _original_loss_scale_apply,
        ("def apply(self, grads, trainable_variables=None):", "self._tf_apply(grads, trainable_variables)"),
        *EXACT,
        patch=(_loss_scale_optimizer, "apply", _loss_scale_apply),
    ),
    hook(
        "optimizer_variable_keys",
        keras_base_optimizer.BaseOptimizer.build,
        ("self._trainable_variables_indices[self._var_key(variable)] = i",),
        "pipeline",
    ),
    hook(
        "optimizer_tf_variable_key", keras_tf_optimizer.TFOptimizer._var_key, ("variable = variable.value",), "pipeline"
    ),
)
