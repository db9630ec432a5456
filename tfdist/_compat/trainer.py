"""Keras' TensorFlow trainer: the symbolic build, the multi-step function, step identification,
the multi-worker reduction of step outputs, and `*_on_batch` inputs.

* Symbolic build. Keras builds the model on the replica-MEAN of a first batch
  drawn from an extra iterator: that crashes (`AddN`) when the first batch
  splits unevenly, and the extra pass reshuffles a `shuffle()`d dataset, so
  training sees another order than on one device. Under a tfdist strategy the
  model is built from the distributed dataset's element spec (shapes and
  dtypes, which is all the build uses), reading no data, after the strategy's
  `_tfdist_check_global_batch`.
* `steps_per_execution > 1`: Keras runs its nested `one_step_on_data`
  tf.function inside a cond inside a while loop; with distributed inputs that
  fails at run time under any MirroredStrategy ("You must feed a value for
  placeholder tensor 'while/cond/Placeholder'"). Under a strategy with
  `_tfdist_inline_steps` the step is traced inline (same ops, no nesting).
* XLA. Keras compiles `one_step_on_data` (the whole `strategy.run`) as one
  XLA cluster: under any MirroredStrategy that fails ("Trying to access
  resource ... located in device CPU:1 from device CPU:0"), and DTensor
  ignores it. For a model with `jit_compile=True` the strategy's
  `_tfdist_jit_compile` decides (it compiles each replica's step itself, or
  raises) and Keras' compilation of the whole function is off. Keras'
  `jit_compile="auto"` asks `_tfdist_auto_jit` (Keras turns XLA off under any
  tf.distribute strategy).
* `keras_step(fn)`: which model's train/test/predict step `fn` is. While a
  flight recorder runs (a multi-process job, `tfdist.flight`), every call of
  a Keras train/test/predict function is recorded as a step of its kind.
* Multi-worker: Keras' `reduce_per_replica` reduces the "mean" of step outputs
  (scalar metric results) with `strategy.reduce(..., axis=0)`, which fails on
  scalars ("Invalid reduction dimension 0"). Under a tfdist multi-worker
  strategy it takes the element-wise mean over all replicas (axis=None).
* A dataset the strategy distributed already (`experimental_distribute_dataset`,
  `distribute_datasets_from_function`) given to `fit`/`evaluate`/`predict`:
  its element spec is per replica, where Keras' `batch_size` reads one
  TensorSpec (`AttributeError: 'PerReplicaSpec' object has no attribute
  'shape'`); the global batch is computed from a replica's. Keras recognizes
  tf.distribute's datasets by class name, so a DTensor strategy's
  (a `tf.distribute.DistributedDataset` of tfdist's) was "Unrecognized data
  type"; it is taken as a distributed dataset, which Keras' epoch iterator
  iterates as it is.
* `train_on_batch` / `test_on_batch` / `predict_on_batch` hand host arrays to
  the traced step; they first go through the strategy's `_tfdist_shard_batch`
  (a DTensor program refuses non-DTensor inputs), class weights turned into
  sample weights first, as Keras would.

Checked on TensorFlow 2.21 / Keras 3.15.
"""

from __future__ import annotations

import contextlib
import threading

import keras
import tensorflow as tf
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from keras.src.trainers import data_adapters as keras_data_adapters
from keras.src.trainers.data_adapters import tf_dataset_adapter
from tensorflow.python.distribute import values as tf_values
from tensorflow.python.util import nest
from tensorflow.python.util import tf_decorator

from tfdist import flight
from tfdist._compat._hook import EXACT
from tfdist._compat._hook import hook
from tfdist._compat._hook import missing_spec_error
from tfdist.strategies import _extended

_trainer = keras_tf_trainer.TensorFlowTrainer
_TFDatasetAdapter = tf_dataset_adapter.TFDatasetAdapter


# ------------------------------------------------------------------ symbolic build
def batch_spec(epoch_iterator):
    """One replica's batch as TensorSpecs, from a Keras epoch iterator's distributed dataset (None without one)."""
    spec = getattr(getattr(epoch_iterator, "_distributed_dataset", None), "element_spec", None)
    if spec is None:
        return None

    def one_replica(leaf):
        if isinstance(leaf, tf_values.PerReplicaSpec):
            return leaf._value_specs[0]
        return leaf

    return nest.map_structure(one_replica, spec)


def global_batch_size(data_adapter, strategy):
    """The global batch size of a Keras data adapter's batches (None: not static).

    Keras' `batch_size` reads the first element spec's leading dimension; a
    dataset the strategy already distributed (`experimental_distribute_dataset`,
    `distribute_datasets_from_function`) has one spec per replica instead: the
    global batch is then a replica's static batch times the replicas in sync
    (None unless every replica's is the same).
    """
    if not isinstance(data_adapter, _TFDatasetAdapter):  # an adapter of arrays or generators: batches made here
        return data_adapter.batch_size
    first = nest.flatten(data_adapter.get_tf_dataset().element_spec)[0]
    if not isinstance(first, tf_values.PerReplicaSpec):
        return data_adapter.batch_size
    sizes = {spec.shape[0] if spec.shape.rank else None for spec in first._value_specs}
    size = sizes.pop() if len(sizes) == 1 else None
    return None if size is None else size * strategy.num_replicas_in_sync


_original_maybe_symbolic_build = _trainer._maybe_symbolic_build


def _maybe_symbolic_build(self, iterator=None, data_batch=None):
    strategy = self._distribute_strategy
    extended = _extended.extended_of(strategy)
    if extended is None or iterator is None:
        return _original_maybe_symbolic_build(self, iterator=iterator, data_batch=data_batch)
    data_batch = batch_spec(iterator)
    if data_batch is None:
        raise missing_spec_error("symbolic_build", "distributed dataset")
    extended._tfdist_check_global_batch(global_batch_size(iterator.data_adapter, strategy))
    with strategy.scope():
        self._symbolic_build(data_batch=data_batch)


# ------------------------------------------------------------------ datasets the strategy distributed
_original_is_tf_dataset = keras_data_adapters.is_tf_dataset


def _is_tf_dataset(x):
    return _original_is_tf_dataset(x) or isinstance(x, tf.distribute.DistributedDataset)


# ------------------------------------------------------------------ steps_per_execution > 1
_original_make_function = _trainer._make_function
_make_function_lock = threading.Lock()


class _StepTensorFlow:
    """Stands in for the `tf` module inside Keras' trainer while it builds a step function.

    Its `tf.function` of `one_step_on_data` returns the function itself (`inline`), or a
    tf.function without Keras' `jit_compile`.
    """

    def __init__(self, *, inline: bool):
        self._inline = inline

    def __getattr__(self, name):
        return getattr(tf, name)

    def function(self, func=None, **kwargs):
        if func is not None and getattr(func, "__name__", "") == "one_step_on_data":
            if self._inline:
                return func
            kwargs["jit_compile"] = False
        return tf.function(func, **kwargs) if func is not None else tf.function(**kwargs)


def _build_with_step_tf(build, *, inline: bool):
    """Runs `build()` (Keras building a step function) with `_StepTensorFlow` as its `tf`, one build at a time."""
    with _make_function_lock:
        keras_tf_trainer.tf = _StepTensorFlow(inline=inline)
        try:
            return build()
        finally:
            keras_tf_trainer.tf = tf


class _CalledIn:
    """A Keras step function whose every call is recorded by the flight recorder (`tfdist.flight`) as a `kind`
    step, and runs inside the strategy's `_tfdist_step_call_context()` when it has one."""

    def __init__(self, function, call_context, kind):
        self._function = function
        self._call_context = call_context or contextlib.nullcontext
        self._kind = kind

    def __call__(self, *args, **kwargs):
        with flight.keras_step(self._kind), self._call_context():
            return self._function(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._function, name)


def _called_in_context(extended, function, kind):
    if function is None or isinstance(function, _CalledIn):
        return function
    if extended._tfdist_step_call_context is None and flight.current() is None:
        return function
    return _CalledIn(function, extended._tfdist_step_call_context, kind)


def _make_function(self, step_function):
    extended = _extended.extended_of(self._distribute_strategy)
    if extended is None:
        return _original_make_function(self, step_function)
    compiled = not self.run_eagerly and bool(self.jit_compile)
    if compiled:
        extended._tfdist_jit_compile(self)
    inline = extended._tfdist_inline_steps and self.steps_per_execution > 1
    kind = keras_step(step_function)[1] or "keras"
    if not inline and not compiled:
        return _called_in_context(extended, _original_make_function(self, step_function), kind)
    return _called_in_context(
        extended, _build_with_step_tf(lambda: _original_make_function(self, step_function), inline=inline), kind
    )


# ------------------------------------------------------------------ XLA: predict, "auto"
_original_make_predict_function = _trainer.make_predict_function
_original_resolve_auto_jit_compile = _trainer._resolve_auto_jit_compile


def _make_predict_function(self, force=False):
    extended = _extended.extended_of(self._distribute_strategy)
    if extended is None:
        return _original_make_predict_function(self, force=force)
    _make_predict_function_of(self, extended, force)
    self.predict_function = _called_in_context(extended, self.predict_function, "predict")
    return self.predict_function


def _make_predict_function_of(self, extended, force):
    # Keras compiles the predict step inside `strategy.run` (per replica) already; a strategy that
    # cannot compile says so here, one whose replicas span devices gets it uncompiled.
    if self.run_eagerly or not self.jit_compile:
        return _original_make_predict_function(self, force=force)
    extended._tfdist_jit_compile(self)
    if extended._tfdist_compiles_replicas:
        return _original_make_predict_function(self, force=force)
    # A replica spans devices: the strategy compiles parts of it.
    return _build_with_step_tf(lambda: _original_make_predict_function(self, force=force), inline=False)


def _resolve_auto_jit_compile(self):
    extended = _extended.extended_of(self._distribute_strategy)
    if extended is None:
        return _original_resolve_auto_jit_compile(self)
    return extended._tfdist_auto_jit(self)


# ------------------------------------------------------------------ which step is running
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


# ------------------------------------------------------------------ multi-worker step outputs
_original_reduce_per_replica = keras_tf_trainer.reduce_per_replica


def _reduce_per_replica(values, strategy, reduction):
    if (
        reduction not in ("auto", "mean")
        or _extended.extended_of(strategy) is None
        or not keras_tf_trainer._collective_all_reduce_multi_worker(strategy)
    ):
        return _original_reduce_per_replica(values, strategy, reduction)
    return nest.map_structure(lambda v: strategy.reduce(tf.distribute.ReduceOp.MEAN, v, axis=None), values)


# ------------------------------------------------------------------ *_on_batch inputs
_original_train_on_batch = _trainer.train_on_batch
_original_test_on_batch = _trainer.test_on_batch
_original_predict_on_batch = _trainer.predict_on_batch


def _train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False):
    extended = _extended.extended_of(self.distribute_strategy)
    if extended is not None:
        if class_weight is not None and sample_weight is None:
            sample_weight = keras.src.trainers.data_adapters.data_adapter_utils.class_weight_to_sample_weights(
                y, class_weight
            )
            class_weight = None
        x, y, sample_weight = extended._tfdist_shard_batch((x, y, sample_weight))
    return _original_train_on_batch(self, x, y, sample_weight, class_weight, return_dict)


def _test_on_batch(self, x, y=None, sample_weight=None, return_dict=False):
    extended = _extended.extended_of(self.distribute_strategy)
    if extended is not None:
        x, y, sample_weight = extended._tfdist_shard_batch((x, y, sample_weight))
    return _original_test_on_batch(self, x, y, sample_weight, return_dict)


def _predict_on_batch(self, x):
    extended = _extended.extended_of(self.distribute_strategy)
    return _original_predict_on_batch(self, x if extended is None else extended._tfdist_shard_batch(x))


_ALL = (*EXACT, "model_parallel")
HOOKS = (
    hook(
        "symbolic_build",
        _original_maybe_symbolic_build,
        ('self.distribute_strategy.reduce(', '"MEAN"', "self._symbolic_build(data_batch=data_batch)"),
        *_ALL,
        patch=(_trainer, "_maybe_symbolic_build", _maybe_symbolic_build),
    ),
    hook(
        "distributed_dataset_batch_size",
        _TFDatasetAdapter.batch_size.fget,
        ("first_element_spec.shape[0]",),
        *_ALL,
    ),
    hook(
        "distributed_dataset_input",
        _original_is_tf_dataset,
        ('"DistributedDataset",',),
        "model_parallel",
        patch=(keras_data_adapters, "is_tf_dataset", _is_tf_dataset),
    ),
    hook(
        "distributed_dataset_adapter",
        keras_data_adapters.get_data_adapter,
        ("elif is_tf_dataset(x):", "return TFDatasetAdapter("),
        "model_parallel",
    ),
    hook(
        "distributed_dataset_epochs",
        keras_tf_trainer.TFEpochIterator.__init__,
        ("if not isinstance(dataset, tf.distribute.DistributedDataset):",),
        "model_parallel",
    ),
    hook(
        "epoch_iterator_dataset",
        keras_tf_trainer.TFEpochIterator.__init__,
        ("self._distributed_dataset = dataset",),
        *_ALL,
    ),
    hook(
        "inline_step",
        _original_make_function,
        (
            "def one_step_on_data(data):",
            "one_step_on_data = tf.function(",
            "jit_compile=self.jit_compile",
            "tf.while_loop(",
        ),
        *_ALL,
        patch=(_trainer, "_make_function", _make_function),
    ),
    hook(
        "predict_jit",
        _original_make_predict_function,
        ("if not self.run_eagerly and self.jit_compile:", "jit_compile=True", "distribute_strategy.run("),
        *_ALL,
        patch=(_trainer, "make_predict_function", _make_predict_function),
    ),
    hook(
        "auto_jit",
        _original_resolve_auto_jit_compile,
        ("if self._distribute_strategy:", "model_supports_jit(self)"),
        *_ALL,
        patch=(_trainer, "_resolve_auto_jit_compile", _resolve_auto_jit_compile),
    ),
    hook(
        "predict_closure",
        _trainer.make_predict_function,
        ("def one_step_on_data(data):", "return self.predict_step(data)", "distribute_strategy.run("),
        *EXACT,
    ),
    hook(
        "multi_worker_reduce",
        _original_reduce_per_replica,
        ("_collective_all_reduce_multi_worker(strategy)", 'strategy.reduce("MEAN", v, axis=0)'),
        "multi_worker",
        patch=(keras_tf_trainer, "reduce_per_replica", _reduce_per_replica),
    ),
    hook(
        "multi_worker_check",
        keras_tf_trainer._collective_all_reduce_multi_worker,
        ("_in_multi_worker_mode()",),
        "multi_worker",
    ),
    hook(
        "train_on_batch",
        _original_train_on_batch,
        ("def data():", "self.train_function(data())"),
        "model_parallel",
        patch=(_trainer, "train_on_batch", _train_on_batch),
    ),
    hook(
        "test_on_batch",
        _original_test_on_batch,
        ("def data():", "self.test_function(data())"),
        "model_parallel",
        patch=(_trainer, "test_on_batch", _test_on_batch),
    ),
    hook(
        "predict_on_batch",
        _original_predict_on_batch,
        ("self.predict_function([(x,)])",),
        "model_parallel",
        patch=(_trainer, "predict_on_batch", _predict_on_batch),
    ),
)
