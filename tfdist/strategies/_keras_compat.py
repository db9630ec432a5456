"""Every private TensorFlow / Keras hook tfdist relies on, in one place.

Plain Keras 3 under `tf.distribute.MirroredStrategy` (measured on TF 2.21,
Keras 3.15) is wrong or broken in four ways that tfdist corrects:

1. Loss scaling. Keras scales each replica's mean loss by 1 / replicas, so a
   global batch that splits unevenly (10 examples over 4 replicas) weights a
   replica holding 1 example like one holding 3. tfdist weights each replica by
   its share of the global batch (n_replica / n_global), which makes the summed
   gradient exactly the single-device gradient. A replica left without examples
   (global batch smaller than the replica count) runs on a padding copy of one
   example with share 0, its metric updates undone and its outputs dropped.
   Hooks: Keras' `scale_loss_for_distribution` / `unscale_loss_for_distribution`,
   and the strategy's `_call_for_each_replica`, which computes the shares.
2. Gradient clipping and accumulation. Keras clips each replica's gradient
   before the all-reduce, and its accumulation step calls `merge_call` inside a
   `cond` branch, which tf.distribute forbids. tfdist all-reduces first, then
   runs Keras' own `apply` once in cross-replica context on the reduced
   gradient, so clipping, accumulation, weight decay and EMA behave as on one
   device. Hooks: `TFOptimizer.apply`, and the strategy's `_use_merge_call`.
3. Symbolic build. Keras builds the model on the replica-MEAN of a first batch
   drawn from an extra iterator: it crashes (`AddN`) when that batch splits
   unevenly, and the extra pass reshuffles a `shuffle()`d dataset, so training
   sees another order than on one device. tfdist builds from the dataset's
   element spec. Hook: `TensorFlowTrainer._maybe_symbolic_build`.
4. `steps_per_execution > 1` fails at run time under MirroredStrategy (a nested
   tf.function in a cond in a while loop). tfdist traces the step inline.
   Hook: `TensorFlowTrainer._make_function`.

The hooks act only under tfdist strategies; other strategies keep Keras'
behaviour. Each hook checks at install time that the code it replaces still
looks as it did on the versions below, and raises `CompatError` naming the hook
when it does not.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading

import keras
import tensorflow as tf
from keras.src.backend.tensorflow import optimizer as keras_tf_optimizer
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.losses import loss as keras_loss
from keras.src.optimizers import base_optimizer as keras_base_optimizer
from tensorflow.python import pywrap_tfe
from tensorflow.python.autograph.core import ag_ctx
from tensorflow.python.autograph.impl import api as autograph
from tensorflow.python.distribute import merge_call_interim
from tensorflow.python.distribute import mirrored_strategy
from tensorflow.python.distribute import values as tf_values
from tensorflow.python.eager import backprop as tf_backprop
from tensorflow.python.eager.polymorphic_function import atomic_function as tf_atomic_function
from tensorflow.python.util import nest
from tensorflow.python.util import tf_decorator

from tfdist import errors

CHECKED_ON = {"tensorflow": "2.21", "keras": "3.15"}


CompatError = errors.CompatError


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def versions_match() -> bool:
    """True when the installed TensorFlow and Keras are the versions the hooks were checked on."""
    return (
        _major_minor(tf.__version__) == CHECKED_ON["tensorflow"]
        and _major_minor(keras.__version__) == CHECKED_ON["keras"]
    )


def _qualified_name(obj) -> str:
    if inspect.ismodule(obj):
        return obj.__name__
    return f"{obj.__module__}.{obj.__qualname__}"


def _require(hook: str, obj, *needles: str) -> None:
    """Raises CompatError unless the source of `obj` contains every needle."""
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError) as e:
        raise CompatError(f"tfdist hook {hook!r}: cannot read the source of {obj!r}: {e}") from e
    missing = [n for n in needles if n not in source]
    if missing:
        raise CompatError(
            f"tfdist hook {hook!r} no longer applies: {_qualified_name(obj)} does not "
            f"contain {missing}. tfdist was checked on TensorFlow {CHECKED_ON['tensorflow']} and "
            f"Keras {CHECKED_ON['keras']}; installed are TensorFlow {tf.__version__} and Keras "
            f"{keras.__version__}. Install the pinned versions (pip install -e .)."
        )


# --------------------------------------------------------------------------------------------
# Per-replica state: the replica's share of the global batch while its step function runs.
# MirroredStrategy runs each replica's function in its own thread, so this is thread-local.
# --------------------------------------------------------------------------------------------
_replica_state = threading.local()


@contextlib.contextmanager
def thread_local_scope(state: threading.local, name: str, value):
    """Sets `state.<name>` to `value` on this thread meanwhile, then restores what it was."""
    previous = getattr(state, name, None)
    setattr(state, name, value)
    try:
        yield
    finally:
        setattr(state, name, previous)


def _example_share(share):
    return thread_local_scope(_replica_state, "share", share)


def current_example_share():
    """This replica's examples / the global batch's examples while a tfdist step runs, else None."""
    return getattr(_replica_state, "share", None)


# --------------------------------------------------------------------------------------------
# Hook 1: loss scaling by the replica's share of the global batch.
# --------------------------------------------------------------------------------------------
_original_scale = keras_loss.scale_loss_for_distribution
_original_unscale = keras_loss.unscale_loss_for_distribution


def _scale_loss_for_distribution(value):
    share = current_example_share()
    if share is None:
        return _original_scale(value)
    return value * tf.cast(share, value.dtype)


def _unscale_loss_for_distribution(value):
    share = current_example_share()
    if share is None:
        return _original_unscale(value)
    return tf.math.divide_no_nan(value, tf.cast(share, value.dtype))


# --------------------------------------------------------------------------------------------
# Hook 2: all-reduce, then Keras' own apply in cross-replica context.
# --------------------------------------------------------------------------------------------
_original_apply = keras_base_optimizer.BaseOptimizer.apply


def _is_exact_strategy(strategy) -> bool:
    return getattr(strategy.extended, "_tfdist_exact", False)


def _as_mirrored(value):
    if isinstance(value, tf_values.PerReplica):
        return tf_values.Mirrored(value.values)
    return value


def _microbatch_gradients(grads):
    """In a pipeline step (PipelineStrategy), the gradients of all micro-batches summed at the last
    one, None at the others (they are applied once, with the last); elsewhere `grads` as they are."""
    if tf.distribute.get_replica_context() is None:
        return grads
    accumulate = getattr(tf.distribute.get_strategy().extended, "_tfdist_accumulate_microbatch", None)
    return grads if accumulate is None else accumulate(list(grads))


def _apply(self, grads, trainable_variables=None):
    grads = _microbatch_gradients(grads)
    if grads is None:
        return None
    replica_context = tf.distribute.get_replica_context()
    strategy = tf.distribute.get_strategy()
    if replica_context is None or not _is_exact_strategy(strategy):
        return _original_apply(self, grads, trainable_variables)
    grads = list(grads)
    if strategy.num_replicas_in_sync > 1:
        present = [i for i, g in enumerate(grads) if g is not None]
        reduced = strategy.extended._tfdist_all_reduce_gradients([grads[i] for i in present])
        for i, g in zip(present, reduced):
            grads[i] = g
    # Even with one replica: Keras' accumulation step would call merge_call inside a cond.

    def apply_once(unused_strategy, reduced_grads):
        reduced_grads = [None if g is None else _as_mirrored(g) for g in reduced_grads]
        with strategy.extended._tfdist_cross_replica_apply():
            return _original_apply(self, reduced_grads, trainable_variables)

    return replica_context.merge_call(apply_once, args=(grads,))


# --------------------------------------------------------------------------------------------
# Hook 3: symbolic build from the dataset's element spec. Keras builds the model on the
# replica-MEAN of a first batch it draws from a fresh iterator: that crashes (`AddN`) when the
# first batch splits unevenly, and it starts one extra pass over the dataset, so a dataset that
# reshuffles on every pass (`shuffle()`'s default) trains on another order than on one device.
# Under tfdist strategies the model is built from the distributed dataset's element spec (shapes
# and dtypes, which is all the build uses), reading no data.
# --------------------------------------------------------------------------------------------
_original_maybe_symbolic_build = keras_tf_trainer.TensorFlowTrainer._maybe_symbolic_build


def _is_tfdist_strategy(strategy) -> bool:
    return type(strategy).__module__.startswith("tfdist.")


def _batch_spec(epoch_iterator):
    """One replica's batch as TensorSpecs, from the epoch iterator's distributed dataset."""
    spec = getattr(getattr(epoch_iterator, "_distributed_dataset", None), "element_spec", None)
    if spec is None:
        return None

    def one_replica(leaf):
        if isinstance(leaf, tf_values.PerReplicaSpec):
            return leaf._value_specs[0]
        return leaf

    return nest.map_structure(one_replica, spec)


def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    strategy = self._distribute_strategy
    if strategy is None or not _is_tfdist_strategy(strategy) or iterator is None:
        return _original_maybe_symbolic_build(self, iterator=iterator, data_batch=data_batch)
    data_batch = _batch_spec(iterator)
    if data_batch is None:
        raise CompatError(
            "tfdist hook 'symbolic_build': the epoch iterator has no distributed dataset with an element "
            f"spec (checked on Keras {CHECKED_ON['keras']}, installed {keras.__version__})."
        )
    check = getattr(strategy.extended, "_tfdist_check_global_batch", None)
    if check is not None:
        check(iterator.data_adapter.batch_size)
    with strategy.scope():
        self._symbolic_build(data_batch=data_batch)


# --------------------------------------------------------------------------------------------
# Hook 4: steps_per_execution > 1. Keras runs its nested `one_step_on_data` tf.function inside a
# cond inside a while loop; with distributed inputs that graph fails at run time ("You must feed a
# value for placeholder tensor 'while/cond/Placeholder'") under any MirroredStrategy. Under tfdist
# strategies the step is traced inline into the loop instead (same ops, no nested function).
# --------------------------------------------------------------------------------------------
_original_make_function = keras_tf_trainer.TensorFlowTrainer._make_function
_make_function_lock = threading.Lock()


class _InlineStepTensorFlow:
    """Stands in for the `tf` module inside Keras' trainer while it builds a step function."""

    def __getattr__(self, name):
        return getattr(tf, name)

    @staticmethod
    def function(func=None, **kwargs):
        if func is not None and getattr(func, "__name__", "") == "one_step_on_data":
            return func
        return tf.function(func, **kwargs) if func is not None else tf.function(**kwargs)


def _make_function(self, step_function):
    strategy = self._distribute_strategy
    if strategy is None or not _is_exact_strategy(strategy) or self.steps_per_execution == 1:
        return _original_make_function(self, step_function)
    with _make_function_lock:
        keras_tf_trainer.tf = _InlineStepTensorFlow()
        try:
            return _original_make_function(self, step_function)
        finally:
            keras_tf_trainer.tf = tf


# --------------------------------------------------------------------------------------------
# Strategy side: a mixin for the `extended` of tfdist's tf.distribute strategies.
# --------------------------------------------------------------------------------------------
class ExactReplicaMixin:
    """Mixin for a `StrategyExtended` whose replicas compute the single-device result.

    It overrides `_call_for_each_replica` (to give each replica its share of the
    global batch) and `_use_merge_call` (so that Keras' optimizer code, which asks
    for `merge_call`, runs directly while tfdist applies gradients in
    cross-replica context).
    """

    _tfdist_exact = True

    def _tfdist_flags(self):
        flags = self.__dict__.get("_tfdist_thread_flags")
        if flags is None:
            flags = self.__dict__["_tfdist_thread_flags"] = threading.local()
        return flags

    @contextlib.contextmanager
    def _tfdist_cross_replica_apply(self):
        flags = self._tfdist_flags()
        flags.applying = True
        try:
            yield
        finally:
            flags.applying = False

    def _use_merge_call(self):
        if getattr(self._tfdist_flags(), "applying", False):
            return False
        return super()._use_merge_call()

    # A tf.DType that float gradients wider than it are all-reduced in (the strategy's
    # `gradient_dtype`); None sends each gradient in its own dtype.
    _tfdist_gradient_dtype = None

    def _tfdist_all_reduce_gradients(self, grads):
        """All-reduces (sums) the per-replica gradients; runs in replica context.

        With `_tfdist_gradient_dtype` set, wider float gradients travel in it and are cast back.
        """
        if not grads:
            return []
        wire = self._tfdist_gradient_dtype
        if wire is not None:
            sent = [tf.cast(g, wire) if g.dtype.is_floating and g.dtype.size > wire.size else g for g in grads]
        else:
            sent = grads
        reduced = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, sent)
        return [r if r.dtype == g.dtype else tf.cast(r, g.dtype) for r, g in zip(reduced, grads)]

    def _tfdist_global_count(self, local_count):
        """Examples in this step over all workers, given this worker's count."""
        return local_count

    def _call_for_each_replica(self, fn, args, kwargs):
        prepared = self._tfdist_prepare_replicas(fn, args, kwargs or {})
        if prepared is None:
            return super()._call_for_each_replica(fn, args, kwargs)
        args, shares, padded, model = prepared
        fn = autograph.tf_convert(fn, ag_ctx.control_status_ctx(), convert_by_default=False)

        @autograph.do_not_convert
        def weighted(replica_share, replica_padded, *a, **kw):
            return run_weighted(fn, replica_share, replica_padded, model, *a, **kw)

        return super()._call_for_each_replica(weighted, (shares, padded) + tuple(args), kwargs)

    def _tfdist_prepare_replicas(self, fn, args, kwargs):
        """Each replica's share of the global batch; empty replicas padded for Keras steps.

        A global batch smaller than the number of replicas leaves some replicas
        without examples, and several CPU kernels (oneDNN convolutions) fail on
        an empty batch. For Keras' train/test/predict steps such a replica runs
        on one filler row (replica 0's first example, or zeros on a worker with
        no example at all) with loss share 0, its metric updates are undone and
        its outputs dropped, so the step equals one device's.
        """
        batched = [
            leaf
            for leaf in nest.flatten((args, kwargs))
            if isinstance(leaf, tf_values.PerReplica)
            and all(isinstance(p, tf.Tensor) and p.shape.rank for p in leaf.values)
        ]
        # One replica in sync needs no weighting; a multi-worker replica may be alone on its worker.
        if not batched or self._num_replicas_in_sync < 2:
            return None
        devices = self.worker_devices
        counts = []
        for device, part in zip(devices, batched[0].values):
            with tf.device(device):
                counts.append(tf.shape(part)[0])
        model = _keras_step_model(fn) if not kwargs and len(args) == 1 else None
        if model is not None:
            args = (nest.map_structure(lambda leaf: self._tfdist_pad(leaf, counts), args[0]),)
        total = self._tfdist_global_count(tf.cast(tf.add_n(counts), tf.float32))
        shares, padded = [], []
        for device, count in zip(devices, counts):
            with tf.device(device):
                shares.append(tf.math.divide_no_nan(tf.cast(count, tf.float32), total))
                padded.append(tf.logical_and(model is not None, tf.equal(count, 0)))
        return args, tf_values.PerReplica(shares), tf_values.PerReplica(padded), model

    def _tfdist_pad(self, leaf, counts):
        """Gives each empty local replica of a batched PerReplica leaf one filler row.

        The filler is replica 0's first row when it has one (real data), else a
        row of zeros (a worker whose replicas all got no example).
        """
        if not isinstance(leaf, tf_values.PerReplica) or not leaf.values[0].shape.rank:
            return leaf
        devices = self.worker_devices
        first = leaf.values[0]
        with tf.device(devices[0]):
            zeros = tf.zeros(tf.concat([[1], tf.shape(first)[1:]], axis=0), dtype=first.dtype)
            filler = tf.cond(counts[0] > 0, lambda: first[:1], lambda: zeros)
        parts = []
        for device, count, part in zip(devices, counts, leaf.values):
            with tf.device(device):
                parts.append(tf.cond(count > 0, lambda p=part: p, lambda: filler))
        return tf_values.PerReplica(parts)


_KERAS_STEPS = ("train_step", "test_step", "predict_step")
# Keras' predict function runs a local closure over the model, not the bound predict_step.
_KERAS_PREDICT_CLOSURE = "make_predict_function.<locals>.one_step_on_data"


def keras_step(fn):
    """`(model, kind)` when `fn` is (a wrapper of) a Keras model's step, else `(None, None)`.

    `kind` is "train", "test" or "predict".
    """
    _, target = tf_decorator.unwrap(fn)
    for _ in range(8):  # tf_convert and functools wrappers, a few deep
        owner = getattr(target, "__self__", None)
        name = getattr(target, "__name__", "")
        if isinstance(owner, keras.Model) and name in _KERAS_STEPS:
            return owner, name[: -len("_step")]
        if getattr(target, "__qualname__", "").endswith(_KERAS_PREDICT_CLOSURE) and hasattr(target, "__code__"):
            cells = dict(zip(target.__code__.co_freevars, target.__closure__ or ()))
            owner = cells["self"].cell_contents if "self" in cells else None
            if isinstance(owner, keras.Model):  # else a wrapper carrying the same name
                return owner, "predict"
        target = getattr(target, "__wrapped__", None)
        if target is None:
            break
    return None, None


def _keras_step_model(fn):
    """The Keras model when `fn` is (a wrapper of) its train/test/predict step, else None."""
    return keras_step(fn)[0]


def run_weighted(fn, share, padded, model, *args, **kwargs):
    """Runs a Keras step on part of the global batch: its loss weighted by `share` (its examples /
    the global batch's), and, when `padded` (a filler row standing in for no example), its metric
    updates undone and its batch-sized outputs dropped. `padded=False` skips both."""
    with _example_share(share):
        if padded is False:
            return fn(*args, **kwargs)
        with _undo_metric_updates_if(padded, model):
            outputs = fn(*args, **kwargs)
    return nest.map_structure(lambda t: _drop_padding(t, padded), outputs)


@contextlib.contextmanager
def _undo_metric_updates_if(padded, model):
    """Restores this replica's (local, sync-on-read) metric state afterwards when `padded`."""
    if model is None:
        yield
        return
    variables = list(model.metrics_variables)
    saved = [tf.identity(v.value) for v in variables]
    yield

    def restore():
        for v, value in zip(variables, saved):
            v.assign(value)
        return tf.constant(True)

    tf.cond(padded, restore, lambda: tf.constant(False))


def _drop_padding(value, padded):
    """Drops the rows of a padded replica's batch-sized output (its static batch size is unknown)."""
    if not isinstance(value, tf.Tensor) or not value.shape.rank or value.shape[0] is not None:
        return value
    return tf.cond(padded, lambda: value[:0], lambda: value)


# --------------------------------------------------------------------------------------------
# Multi-worker (tfdist.MultiWorkerStrategy). Hook 5: Keras' `reduce_per_replica` reduces the
# "mean" of step outputs (scalar metric results) across workers with `strategy.reduce(..., axis=0)`,
# which fails on scalars ("Invalid reduction dimension 0"). tfdist takes the element-wise mean over
# all replicas (axis=None), the multi-worker equivalent of Keras' single-worker mean of
# `experimental_local_results`. Checked on TensorFlow 2.21 / Keras 3.15.
# --------------------------------------------------------------------------------------------
_original_reduce_per_replica = keras_tf_trainer.reduce_per_replica


def _reduce_per_replica(values, strategy, reduction):
    if (
        reduction not in ("auto", "mean")
        or not _is_exact_strategy(strategy)
        or not keras_tf_trainer._collective_all_reduce_multi_worker(strategy)
    ):
        return _original_reduce_per_replica(values, strategy, reduction)
    return nest.map_structure(lambda v: strategy.reduce(tf.distribute.ReduceOp.MEAN, v, axis=None), values)


# --------------------------------------------------------------------------------------------
# Multi-worker. Hook 5b: the deadline on distributed steps (tfdist/strategies/_deadline.py). Every
# eager call of a traced function goes through `AtomicFunction.call_flat`; while a deadline is set
# (a MultiWorkerStrategy with a `timeout`), calls of functions that contain collective ops are
# timed by it. Checked on TensorFlow 2.21.
# --------------------------------------------------------------------------------------------
_original_call_flat = tf_atomic_function.AtomicFunction.call_flat
_step_deadline = None
_collective_functions: dict = {}


def set_step_deadline(deadline) -> None:
    """Times calls of functions with collectives by `deadline` (a `_deadline.StepDeadline`; None: untimed)."""
    global _step_deadline
    with _install_lock:
        if deadline is not None:
            tf_atomic_function.AtomicFunction.call_flat = _call_flat
        if _step_deadline is not None and _step_deadline is not deadline:
            _step_deadline.close()
        _step_deadline = deadline


def _has_collectives(function) -> bool:
    """Whether the traced function, or one it calls, contains a collective op (cached by name)."""
    key = (function._bound_context.function_scope_id, function.name)
    found = _collective_functions.get(key)
    if found is None:
        found = any(node.op.startswith("Collective") for node in function.cached_definition.node_def) or any(
            _has_collectives(child) for child in function.children
        )
        _collective_functions[key] = found
    return found


def _call_flat(self, *args):
    deadline = _step_deadline
    if deadline is None or not self._bound_context.executing_eagerly() or not _has_collectives(self):
        return _original_call_flat(self, *args)
    with deadline.running():
        return _original_call_flat(self, *args)


# --------------------------------------------------------------------------------------------
# Installation.
# --------------------------------------------------------------------------------------------
_HOOKS = (
    ("loss_scaling", keras_loss.scale_loss_for_distribution, ("num_replicas_in_sync",)),
    ("loss_unscaling", keras_loss.unscale_loss_for_distribution, ("num_replicas_in_sync",)),
    ("loss_reduction", keras_loss.reduce_values, ("scale_loss_for_distribution(loss)",)),
    ("optimizer_apply", keras_base_optimizer.BaseOptimizer.apply, ("_backend_apply_gradients",)),
    (
        "optimizer_accumulation",
        keras_base_optimizer.BaseOptimizer._backend_apply_gradients,
        ("ops.cond(", "_clip_gradients(grads)", "_backend_update_step("),
    ),
    (
        "optimizer_all_reduce",
        keras_tf_optimizer.TFOptimizer._backend_update_step,
        ("_all_reduce_sum_gradients", "maybe_merge_call"),
    ),
    ("optimizer_merge_call", merge_call_interim.strategy_supports_no_merge_call, ("_use_merge_call()",)),
    (
        "symbolic_build",
        keras_tf_trainer.TensorFlowTrainer._maybe_symbolic_build,
        ('self.distribute_strategy.reduce(', '"MEAN"', "self._symbolic_build(data_batch=data_batch)"),
    ),
    (
        "epoch_iterator_dataset",
        keras_tf_trainer.TFEpochIterator.__init__,
        ("self._distributed_dataset = dataset",),
    ),
    (
        "inline_step",
        keras_tf_trainer.TensorFlowTrainer._make_function,
        ("def one_step_on_data(data):", "one_step_on_data = tf.function(", "tf.while_loop("),
    ),
    (
        "predict_closure",
        keras_tf_trainer.TensorFlowTrainer.make_predict_function,
        ("def one_step_on_data(data):", "return self.predict_step(data)", "distribute_strategy.run("),
    ),
    (
        "train_step_scaling",
        keras_tf_trainer.TensorFlowTrainer.train_step,
        ("unscale_loss_for_distribution(loss)", "self.optimizer.apply_gradients("),
    ),
    ("replica_call", mirrored_strategy.MirroredExtended._call_for_each_replica, ("call_for_each_replica",)),
    ("merge_call_choice", mirrored_strategy.MirroredExtended._use_merge_call, ("def _use_merge_call",)),
    # multi-worker
    (
        "multi_worker_reduce",
        keras_tf_trainer.reduce_per_replica,
        ("_collective_all_reduce_multi_worker(strategy)", 'strategy.reduce("MEAN", v, axis=0)'),
    ),
    (
        "multi_worker_check",
        keras_tf_trainer._collective_all_reduce_multi_worker,
        ("_in_multi_worker_mode()",),
    ),
    ("step_deadline", _original_call_flat, ("if self._bound_context.executing_eagerly():", ".call_function(")),
)

_installed = False
_install_lock = threading.Lock()


def check_hooks() -> None:
    """Raises CompatError if any hooked TF/Keras internal changed shape."""
    if keras_tf_optimizer.TFOptimizer.apply not in (_original_apply, _apply):
        raise CompatError(
            "tfdist hook 'optimizer_apply' no longer applies: keras TFOptimizer overrides apply(); "
            f"checked on Keras {CHECKED_ON['keras']}, installed {keras.__version__}."
        )
    for name, target, needles in _HOOKS:
        _require(name, target, *needles)


def install() -> None:
    """Installs the Keras hooks (idempotent). They act only under tfdist strategies."""
    global _installed
    with _install_lock:
        if _installed:
            return
        check_hooks()
        keras_loss.scale_loss_for_distribution = _scale_loss_for_distribution
        keras_loss.unscale_loss_for_distribution = _unscale_loss_for_distribution
        keras_tf_optimizer.TFOptimizer.apply = _apply
        keras_tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
        keras_tf_trainer.TensorFlowTrainer._make_function = _make_function
        keras_tf_trainer.reduce_per_replica = _reduce_per_replica
        _installed = True


def installed() -> bool:
    """True once `install()` has patched Keras."""
    return (
        _installed
        and keras_loss.scale_loss_for_distribution is _scale_loss_for_distribution
        and keras_loss.unscale_loss_for_distribution is _unscale_loss_for_distribution
        and keras_tf_optimizer.TFOptimizer.apply is _apply
        and keras_tf_trainer.TensorFlowTrainer._maybe_symbolic_build is _maybe_symbolic_build
        and keras_tf_trainer.TensorFlowTrainer._make_function is _make_function
        and keras_tf_trainer.reduce_per_replica is _reduce_per_replica
    )


# --------------------------------------------------------------------------------------------
# model-parallel (DTensor): tfdist.ModelParallelStrategy. Checked on TensorFlow 2.21 / Keras 3.15.
#
# Hook 6: the Keras path of the variable whose tf.Variable is being created. Keras creates it in
# `Variable._initialize` with only the short name (`name="kernel"`); the strategy's variable
# creator needs the full path ("block_0/mlp_in/kernel") to pick a layout. For a subclassed model
# built later (deferred initialization) Keras' name scope is gone by then, but the Keras variable
# knows its path: the hook records it for the creator. It only records; other strategies ignore it.
#
# Also checked here: ModelParallelStrategy's GatheredVariable (a DVariable read whole, stored split)
# overrides TensorFlow's `BaseResourceVariable._read_variable_op`, the one read path.
#
# Hook 7: `train_on_batch` / `test_on_batch` / `predict_on_batch` hand host arrays to the traced
# step, and a DTensor program refuses non-DTensor inputs. Under a strategy whose `extended` has
# `_tfdist_shard_batch`, the hooks shard the batch first (class weights become sample weights on
# the host first); other strategies keep Keras' behaviour.
# --------------------------------------------------------------------------------------------
_keras_tf_variable = keras.src.backend.tensorflow.core.Variable
_original_variable_initialize = _keras_tf_variable._initialize
_creating = threading.local()


def _variable_initialize(self, value):
    with thread_local_scope(_creating, "path", self.path):
        return _original_variable_initialize(self, value)


def creating_variable_path() -> str | None:
    """The Keras path of the variable whose backing tf.Variable is being created, else None."""
    return getattr(_creating, "path", None)


def variable_path(name: str) -> str:
    """The path of a tf.Variable being created: its Keras variable's, else Keras' name scope + `name`."""
    path = creating_variable_path()
    if path is None:
        scope = keras.src.backend.common.name_scope.current_path()
        path = f"{scope}/{name}" if scope else name
    return path


_trainer = keras_tf_trainer.TensorFlowTrainer
_original_train_on_batch = _trainer.train_on_batch
_original_test_on_batch = _trainer.test_on_batch
_original_predict_on_batch = _trainer.predict_on_batch


def _batch_sharder(model):
    return getattr(getattr(model.distribute_strategy, "extended", None), "_tfdist_shard_batch", None)


def _train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
    shard = _batch_sharder(self)
    if shard is not None:
        if class_weight is not None and sample_weight is None:
            sample_weight = keras.src.trainers.data_adapters.data_adapter_utils.class_weight_to_sample_weights(
                y, class_weight
            )
            class_weight = None
        x, y, sample_weight = shard((x, y, sample_weight))
    return _original_train_on_batch(self, x, y, sample_weight, class_weight, return_dict)


def _test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
    shard = _batch_sharder(self)
    if shard is not None:
        x, y, sample_weight = shard((x, y, sample_weight))
    return _original_test_on_batch(self, x, y, sample_weight, return_dict)


def _predict_on_batch(self, x):
    shard = _batch_sharder(self)
    return _original_predict_on_batch(self, x if shard is None else shard(x))


_MODEL_PARALLEL_PATCHES = (
    (_keras_tf_variable, "_initialize", _variable_initialize),
    (_trainer, "train_on_batch", _train_on_batch),
    (_trainer, "test_on_batch", _test_on_batch),
    (_trainer, "predict_on_batch", _predict_on_batch),
)
_MODEL_PARALLEL_HOOKS = (
    ("variable_path", _original_variable_initialize, ("tf.Variable(", "name=self.name")),
    # model_parallel.GatheredVariable overrides `_read_variable_op`, which every read goes through.
    ("variable_read", tf.experimental.dtensor.DVariable.value, ("self._read_variable_op()",)),
    ("variable_read_op", tf.experimental.dtensor.DVariable._read_variable_op, ("read_variable_op(",)),
    ("variable_to_tensor", tf.experimental.dtensor.DVariable._dense_var_to_tensor, ("return self.value()",)),
    (
        "variable_deferred_init",
        keras.src.backend.common.variables.Variable.__init__,
        ('self._path = f"{parent_path}/{name}"', "register_uninitialized_variable(self)"),
    ),
    ("slot_colocation", keras_tf_optimizer.TFOptimizer.add_variable_from_reference, ("colocate_vars_with(",)),
    ("train_on_batch", _original_train_on_batch, ("def data():", "self.train_function(data())")),
    ("test_on_batch", _original_test_on_batch, ("def data():", "self.test_function(data())")),
    ("predict_on_batch", _original_predict_on_batch, ("self.predict_function([(x,)])",)),
)
_HOOKS = _HOOKS + _MODEL_PARALLEL_HOOKS


def _patched(patches) -> bool:
    return all(getattr(owner, attribute) is hook for owner, attribute, hook in patches)


def _install_patches(hooks, patches) -> None:
    """Checks `hooks`' probes, then applies `patches` (owner, attribute, replacement); idempotent."""
    with _install_lock:
        if not _patched(patches):
            for name, target, needles in hooks:
                _require(name, target, *needles)
            for owner, attribute, hook in patches:
                setattr(owner, attribute, hook)


def install_model_parallel() -> None:
    """Installs the hooks ModelParallelStrategy needs, after the common ones (idempotent)."""
    install()
    _install_patches(_MODEL_PARALLEL_HOOKS, _MODEL_PARALLEL_PATCHES)


def model_parallel_installed() -> bool:
    """True once `install_model_parallel()` has patched Keras."""
    return _patched(_MODEL_PARALLEL_PATCHES)


# --------------------------------------------------------------------------------------------
# pipeline (tfdist.PipelineStrategy). Checked on TensorFlow 2.21 / Keras 3.15.
#
# Hook 10: stage devices for layer calls. While a pipeline step runs on a thread, `Layer.__call__`
# enters the device of the stage that owns the layer (a `tf.device` around Keras' own __call__), so
# each stage's forward ops run where its weights live; sublayers inherit the scope.
#
# Hook 11: gradients next to their forward ops. `tf.GradientTape` builds each gradient op in the
# device scope of the `tape.gradient` call, so every backward op would land on one device. TF has
# `colocate_gradients_with_ops` for `tf.gradients` only; for tapes, tfdist re-registers the eager
# gradient function with a wrapper that, during a pipeline step, enters the forward op's device.
# Both hooks read a thread-local set only by PipelineStrategy's step; elsewhere they are no-ops.
# (The micro-batch gradient sum lives in Hook 2, `_apply`, and, for mixed precision, in
# `LossScaleOptimizer.apply`, which does not go through the base class' `apply`.)
# --------------------------------------------------------------------------------------------
_pipeline_state = threading.local()
_keras_layer = keras.src.layers.layer.Layer
_original_layer_call = _keras_layer.__call__
_original_gradient_function = tf_backprop._gradient_function


def stage_devices(devices):
    """While active on this thread, layer `id -> device` placement and gradient colocation apply."""
    return thread_local_scope(_pipeline_state, "devices", devices)


def _layer_call(self, *args, **kwargs):
    devices = getattr(_pipeline_state, "devices", None)
    device = devices.get(id(self)) if devices else None
    if device is None:
        return _original_layer_call(self, *args, **kwargs)
    with tf.device(device):
        return _original_layer_call(self, *args, **kwargs)


def _graph_tensors(tensors):
    return [t for t in tensors or () if isinstance(t, tf.Tensor) and hasattr(t, "op")]


def _forward_device(op_name, inputs, outputs) -> str:
    """The device of the forward op being differentiated, found from its outputs or inputs.

    The tape hands over an op's outputs only when its gradient needs them (not for MatMul); then the
    op is the consumer of its inputs with the same type and the same input tensors.
    """
    for t in _graph_tensors(outputs):
        return t.op.device
    inputs = list(inputs or ())
    for t in _graph_tensors(inputs):
        for op in t.consumers():
            if op.type == op_name and len(op.inputs) == len(inputs):
                if all(b is None or a is b for a, b in zip(op.inputs, inputs)):
                    return op.device
    return ""


def _colocated_gradient_function(
    op_name, attr_tuple, num_inputs, inputs, outputs, out_grads, skip_input_indices, forward_pass_name_scope
):
    args = (op_name, attr_tuple, num_inputs, inputs, outputs, out_grads, skip_input_indices, forward_pass_name_scope)
    device = ""
    if getattr(_pipeline_state, "devices", None):
        device = _forward_device(op_name, inputs, outputs)
    if not device:
        return _original_gradient_function(*args)
    with tf.device(device):
        return _original_gradient_function(*args)


def rekey_optimizer(optimizer) -> None:
    """Re-indexes a built optimizer's variables after their tf.Variables were replaced.

    Keras keys each trainable variable by its tf.Variable (`_var_key`); PipelineStrategy moves a
    variable to its stage by giving the Keras variable a new tf.Variable.
    """
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):  # LossScaleOptimizer wraps one
        if opt is not None:
            opt._trainable_variables_indices = {opt._var_key(v): i for i, v in enumerate(opt._trainable_variables)}


_loss_scale_optimizer = keras.optimizers.LossScaleOptimizer
_original_loss_scale_apply = _loss_scale_optimizer.apply


def _loss_scale_apply(self, grads, trainable_variables=None):
    # The loss-scale check and the unscaling act on the sum of the micro-batch gradients.
    grads = _microbatch_gradients(grads)
    if grads is None:
        return None
    return _original_loss_scale_apply(self, grads, trainable_variables)


_PIPELINE_PATCHES = (
    (_loss_scale_optimizer, "apply", _loss_scale_apply),
    (_keras_tf_variable, "_initialize", _variable_initialize),
    (_keras_layer, "__call__", _layer_call),
    (tf_backprop, "_gradient_function", _colocated_gradient_function),
)
_PIPELINE_HOOKS = (
    ("variable_path", _original_variable_initialize, ("tf.Variable(", "name=self.name")),
    (
        "loss_scale_apply",
        _original_loss_scale_apply,
        ("def apply(self, grads, trainable_variables=None):", "self._tf_apply(grads, trainable_variables)"),
    ),
    ("layer_call", _original_layer_call, ("def __call__(self, *args, **kwargs):", "super().__call__(")),
    (
        "gradient_function",
        _original_gradient_function,
        ("mock_op = _MockOp(", "return grad_fn(mock_op, *out_grads)"),
    ),
    ("gradient_registration", tf_backprop, ("TFE_Py_RegisterGradientFunction(_gradient_function)",)),
    (
        "optimizer_variable_keys",
        keras_base_optimizer.BaseOptimizer.build,
        ("self._trainable_variables_indices[self._var_key(variable)] = i",),
    ),
    ("optimizer_tf_variable_key", keras_tf_optimizer.TFOptimizer._var_key, ("variable = variable.value",)),
    ("epoch_iterator_adapter", keras_tf_trainer.TFEpochIterator.__init__, ("self.data_adapter.get_tf_dataset()",)),
    ("batch_size_property", keras.src.trainers.data_adapters.data_adapter.DataAdapter, ("def batch_size(self)",)),
    ("pipeline_variable_creator", mirrored_strategy.MirroredExtended._create_variable, ("colocate_with._devices",)),
)
_HOOKS = _HOOKS + _PIPELINE_HOOKS


class _DropMessage(logging.Filter):
    """Drops one TensorFlow log message that is expected, and only noise, under a pipeline."""

    def __init__(self, text):
        super().__init__()
        self.text = text

    def filter(self, record):
        return self.text not in record.getMessage()


# A pipeline's gradients live on their stages' devices, so TensorFlow's batched all-reduce, which
# needs one destination device set, falls back to one all-reduce per gradient and says so.
_PIPELINE_LOG_FILTER = _DropMessage("is not supported if destinations are different")


def install_pipeline() -> None:
    """Installs the hooks PipelineStrategy needs, after the common ones (idempotent)."""
    install()
    if _PIPELINE_LOG_FILTER not in tf.get_logger().filters:
        tf.get_logger().addFilter(_PIPELINE_LOG_FILTER)
    with _install_lock:
        registered = _patched(_PIPELINE_PATCHES)
    _install_patches(_PIPELINE_HOOKS, _PIPELINE_PATCHES)
    if not registered:
        pywrap_tfe.TFE_Py_RegisterGradientFunction(_colocated_gradient_function)


def pipeline_installed() -> bool:
    """True once `install_pipeline()` has patched Keras and TensorFlow."""
    return _patched(_PIPELINE_PATCHES)


# --------------------------------------------------------------------------------------------
# callbacks (tfdist.callbacks). Checked on TensorFlow 2.21 / Keras 3.15.
#
# Hook 8: resuming mid-training. `fit` starts at `model._initial_epoch` when set (Keras' own
# BackupAndRestore sets it in `on_train_begin`), builds `model.train_function` BEFORE
# `on_train_begin`, and looks `self.train_function` up again for every step, passing it the data
# iterator. tfdist's BackupAndRestore sets the epoch the same way and wraps `train_function` to
# count the batches drawn from the current iterator and, when resuming, to draw the already-trained
# batches without training on them.
#
# Hook 9: the data position. Keras' TFEpochIterator calls `iter()` on the distributed dataset once
# for the symbolic build and then, depending on the input, once per epoch plus once at each epoch
# end, or once for the whole fit (a repeated dataset with `steps_per_epoch`). A tf.data pipeline
# that reshuffles each iteration draws a new order at every `iter()`, so the order of a resumed
# epoch depends on how many iterators came before it. The hook counts them (per TFEpochIterator,
# and remembers the training one `fit` created last), so BackupAndRestore can create the same
# number before the resumed epoch. It only counts; the iterators are Keras' own.
# --------------------------------------------------------------------------------------------
def set_initial_epoch(model, epoch: int | None) -> None:
    """Makes the running (or next) `fit` of `model` start at `epoch` (None: the `initial_epoch` argument)."""
    model._initial_epoch = epoch


_original_epoch_iterator_init = keras_tf_trainer.TFEpochIterator.__init__
_original_get_iterator = keras_tf_trainer.TFEpochIterator._get_iterator
_latest_epoch_iterator = threading.local()


class _CountingDataset:
    """Stands in for an epoch iterator's distributed dataset; counts the iterators made from it."""

    def __init__(self, owner, dataset):
        self._owner, self._dataset = owner, dataset

    def __iter__(self):
        iterator = iter(self._dataset)
        self._owner._tfdist_iterators_created = iterators_created(self._owner) + 1
        return iterator


def _epoch_iterator_init(self, *args, **kwargs):
    _original_epoch_iterator_init(self, *args, **kwargs)
    _latest_epoch_iterator.value = self


def _get_iterator(self):
    return _CountingDataset(self, _original_get_iterator(self))


def latest_epoch_iterator():
    """The Keras TFEpochIterator constructed last in this thread (in `on_train_begin`: fit's), else None."""
    return getattr(_latest_epoch_iterator, "value", None)


def iterators_created(epoch_iterator) -> int:
    """How many iterators `epoch_iterator` has made of its dataset so far."""
    return getattr(epoch_iterator, "_tfdist_iterators_created", 0)


def make_unused_iterators(epoch_iterator, count: int) -> None:
    """Makes `count` iterators of the epoch iterator's dataset and drops them (advances reshuffling seeds)."""
    from tfdist.strategies import model_parallel

    dataset = _original_get_iterator(epoch_iterator)
    if isinstance(dataset, model_parallel._DTensorBatches):  # a generator: its tf.data iterator starts lazily
        dataset = dataset._dataset
    for _ in range(count):
        iter(dataset)
    epoch_iterator._tfdist_iterators_created = iterators_created(epoch_iterator) + count


def build_compiled_state(model, epoch_iterator) -> None:
    """Builds the compiled metrics and losses of `model` from `epoch_iterator`'s batch spec, reading no data.

    Without a distribution strategy Keras builds them when it first traces the train step; a resumed
    `fit` that skips the trained batches restores their state (and asks for their results) first.
    """
    unbuilt = [m for m in (model._compile_metrics, model._compile_loss) if m is not None and not m.built]
    if not unbuilt:
        return
    data_batch = _batch_spec(epoch_iterator)
    if data_batch is None:
        raise CompatError(
            "tfdist hook 'compiled_state_build': the epoch iterator has no dataset with an element spec "
            f"(checked on Keras {CHECKED_ON['keras']}, installed {keras.__version__})."
        )
    with model.distribute_strategy.scope():
        model._symbolic_build(data_batch=data_batch)


_CALLBACK_PATCHES = (
    (keras_tf_trainer.TFEpochIterator, "__init__", _epoch_iterator_init),
    (keras_tf_trainer.TFEpochIterator, "_get_iterator", _get_iterator),
)
_CALLBACK_HOOKS = (
    (
        "fit_resume",
        keras_tf_trainer.TensorFlowTrainer.fit,
        (
            "initial_epoch = self._initial_epoch or initial_epoch",
            "epoch_iterator = TFEpochIterator(",
            "self.make_train_function()\n        callbacks.on_train_begin()",
            "logs = self.train_function(iterator)",
        ),
    ),
    ("epoch_iterator_dataset", _original_get_iterator, ("return self._distributed_dataset",)),
    (
        "epoch_iterator_iter",
        keras.src.trainers.epoch_iterator.EpochIterator._enumerate_iterator,
        ("iter(self._get_iterator())",),
    ),
    (
        "compiled_state_build",
        keras_tf_trainer.TensorFlowTrainer._symbolic_build,
        ("compile_metrics_unbuilt", "compile_loss_unbuilt", "data_batch = tree.map_structure("),
    ),
)


def install_callbacks() -> None:
    """Installs the iterator-counting hook BackupAndRestore needs (idempotent; it only counts)."""
    _install_patches(_CALLBACK_HOOKS, _CALLBACK_PATCHES)


def callbacks_installed() -> bool:
    """True once `install_callbacks()` has patched Keras."""
    return _patched(_CALLBACK_PATCHES)


_HOOKS = _HOOKS + _CALLBACK_HOOKS
