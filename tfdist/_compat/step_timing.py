"""Keras' train function, as `tfdist.callbacks.StepStats` times it: what it relies on, nothing replaced.

`StepStats` builds a second train function around a timed copy of the model's
`train_step` with Keras' own builder, `_make_function(step)` (what
`make_train_function` does with `self.train_step`), and puts it in
`model.train_function` in `on_train_begin`: `fit` builds its train function
before `on_train_begin` and looks `self.train_function` up again for every
step. That function runs its steps in one traced call when handed a tf.data /
tf.distribute iterator (the batch is drawn inside the traced step), and
otherwise draws each batch on the host with `zip(range(steps_per_execution),
iterator)` (ModelParallelStrategy's DTensor batches), where the time spent in
`next()` is the input wait. `step_start_graph` finds where a timestamp marks
the step's start.

Under a multi-worker strategy TensorFlow's distributed iterator draws each
batch with a cross-worker all-reduce of "has a value"
(`input_lib._calculate_replicas_with_values`, for a dataset of unknown or
finite length): a worker whose own batch is ready waits there for the
slowest worker's. While `set_local_input_listener(listener)` is in effect on a thread,
that function also hands `listener` a `timestamp()` taken once this worker's
own batch is ready, before the all-reduce.

`timestamp(after)`: inside a tf.function, TensorFlow's automatic control
dependencies run every stateful op without resource inputs (`Timestamp`,
`py_function`, ...) after the one created before it: a plain
`tf.timestamp()` would wait for every such op traced earlier (another
replica's, the user's) and hold back every one traced later. The timestamp
is taken in a small tf.function called with an unused resource handle (a
read-only resource input), which orders with nothing but `after`. Install with `tfdist._compat.install("step_stats")`.
Checked on Keras 3.15.
"""

from __future__ import annotations

import threading

import tensorflow as tf
from keras.src.backend.tensorflow import trainer as keras_tf_trainer
from tensorflow.python.distribute import input_lib
from tensorflow.python.framework import auto_control_deps
from tensorflow.python.framework import func_graph
from tensorflow.python.ops import control_flow_v2_func_graphs

from tfdist._compat._hook import hook

_trainer = keras_tf_trainer.TensorFlowTrainer
_original_replicas_with_values = input_lib._calculate_replicas_with_values
_listeners = threading.local()
_clock = []  # the unused resource handle that keeps `timestamp()` out of the order of stateful ops


@tf.function(autograph=False)
def _timestamp(unused_resource):
    return tf.timestamp()


def timestamp(after=()):
    """A `tf.timestamp()` taken once the tensors `after` are ready, ordered after nothing else.

    Outside a traced function it is just the time now.
    """
    if tf.executing_eagerly():
        return tf.timestamp()
    if not _clock:
        with tf.init_scope(), tf.device("/device:CPU:0"):
            _clock.append(tf.raw_ops.VarHandleOp(dtype=tf.float64, shape=[], shared_name="tfdist_step_clock"))
    with tf.control_dependencies(list(after)):
        return _timestamp(_clock[0])


def make_train_function(model, step_function):
    """Keras' train function of `model` around `step_function` (a stand-in for `model.train_step`)."""
    return model._make_function(step_function)


def step_start_graph(graph):
    """The graph whose ops with no inputs run when the step `graph` belongs to starts.

    Keras traces `train_step` inside a tf.function (`one_step_on_data`) called
    with the batch from inside the train function (`multi_step_on_iterator`):
    the nested call, and every op in it, waits for the batch. The outermost
    enclosing function graph starts before the batch is drawn, unless a
    control-flow branch or loop body (`steps_per_execution > 1`) comes first:
    its ops run as that branch or iteration starts.
    """
    while (
        isinstance(graph, func_graph.FuncGraph)
        and not isinstance(graph, control_flow_v2_func_graphs.ControlFlowFuncGraph)
        and isinstance(graph.outer_graph, func_graph.FuncGraph)
    ):
        graph = graph.outer_graph
    return graph


def _replicas_with_values(strategy, input_workers, optional_list):
    listener = getattr(_listeners, "local_input", None)
    if listener is None or not strategy.extended._in_multi_worker_mode():
        return _original_replicas_with_values(strategy, input_workers, optional_list)
    listener(timestamp([optional.has_value() for optionals in optional_list for optional in optionals]))
    return _original_replicas_with_values(strategy, input_workers, optional_list)


def set_local_input_listener(listener):
    """Hands `listener(local)` (None: nobody), on this thread, the timestamp of each traced batch's local readiness.

    Returns the listener it replaces.
    """
    previous = getattr(_listeners, "local_input", None)
    _listeners.local_input = listener
    return previous


HOOKS = (
    hook(
        "input_sync",
        _original_replicas_with_values,
        ("v.has_value()", "if strategy.extended._in_multi_worker_mode():", "global_has_values = strategy.reduce("),
        "step_stats",
        patch=(input_lib, "_calculate_replicas_with_values", _replicas_with_values),
    ),
    hook(
        "timestamp_order",
        auto_control_deps.AutomaticControlDependencies,
        ("op_is_stateful(op) and not resource_inputs", "_get_resource_inputs(op)"),
        "step_stats",
    ),
    hook(
        "input_sync_callers",
        input_lib.DistributedIteratorBase,
        ("num_replicas_with_values = _calculate_replicas_with_values(",),
        "step_stats",
    ),
    hook(
        "train_function_builder",
        _trainer.make_train_function,
        ("self.train_function = self._make_function(self.train_step)",),
        "step_stats",
    ),
    hook(
        "train_function_iterators",
        _trainer._make_function,
        (
            "def _make_function(self, step_function):",
            "self.distribute_strategy.run(step_function, args=(data,))",
            "iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)",
            "for step, data in zip(\n                    range(self.steps_per_execution), iterator\n                ):",
        ),
        "step_stats",
    ),
    hook(
        "step_start_graph",
        control_flow_v2_func_graphs,
        ("class ControlFlowFuncGraph(func_graph.FuncGraph):",),
        "step_stats",
    ),
    hook("func_graph_outer_graph", func_graph.FuncGraph, ("def outer_graph(self):",), "step_stats"),
    hook(
        "fit_train_function",
        _trainer.fit,
        (
            "self.make_train_function()\n        callbacks.on_train_begin()",
            "callbacks.on_train_batch_begin(begin_step)\n                    logs = self.train_function(iterator)",
        ),
        "step_stats",
    ),
)
