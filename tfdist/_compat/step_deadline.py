"""TensorFlow's `AtomicFunction.call_flat`: the deadline on distributed steps (MultiWorkerStrategy's `timeout`).

Every eager call of a traced function goes through `AtomicFunction.call_flat`;
while a deadline is set (`set_step_deadline`, a `tfdist.strategies._deadline.StepDeadline`),
calls of functions that contain collective ops are timed by it, and while a
flight recorder runs (`tfdist.flight.current()`) each is recorded by it. The
eager all-reduce of `CollectiveAllReduce` (a sync-on-read variable read outside
a replica, such as Keras' metric results at an epoch's end; an eager
`strategy.reduce`) runs collective ops without a traced function: it is timed
and recorded ("all-reduce") the same way. Checked on TensorFlow 2.21.
"""

from __future__ import annotations

import contextlib
import threading

from tensorflow.python.distribute import cross_device_ops
from tensorflow.python.eager import context
from tensorflow.python.eager.polymorphic_function import atomic_function as tf_atomic_function

from tfdist import flight
from tfdist._compat._hook import hook

_original_call_flat = tf_atomic_function.AtomicFunction.call_flat
_step_deadline = None
_every_function = False  # time every eagerly called function, not only those with collective ops (DTensor)
_lock = threading.Lock()
_collective_functions: dict = {}


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


_NOTHING = contextlib.nullcontext()


def _call_flat(self, *args):
    deadline, recorder = _step_deadline, flight.current()
    if (deadline is None and recorder is None) or not self._bound_context.executing_eagerly():
        return _original_call_flat(self, *args)
    if not _every_function and not _has_collectives(self):
        return _original_call_flat(self, *args)
    with (
        _NOTHING if recorder is None else recorder.collective(self.name),
        _NOTHING if deadline is None else deadline.running(),
    ):
        outputs = _original_call_flat(self, *args)
        if _every_function:
            # DTensor's parallel devices run a call asynchronously: the wait for a peer comes later, when the
            # outputs are read. Wait for them here, inside the timed call.
            self._bound_context.sync_executors()
        return outputs


_all_reduce = cross_device_ops.CollectiveAllReduce
_original_all_reduce_values = _all_reduce._all_reduce_per_replica_values


def _all_reduce_per_replica_values(self, reduce_op, per_replica_values, options):
    if (_step_deadline is None and flight.current() is None) or not context.executing_eagerly():
        return _original_all_reduce_values(self, reduce_op, per_replica_values, options)
    with timed("all-reduce"):
        return _original_all_reduce_values(self, reduce_op, per_replica_values, options)


HOOK = hook(
    "step_deadline",
    _original_call_flat,
    ("if self._bound_context.executing_eagerly():", ".call_function("),
    "multi_worker",
    "model_parallel",
    patch=(tf_atomic_function.AtomicFunction, "call_flat", _call_flat),
)
EAGER_ALL_REDUCE_HOOK = hook(
    "eager_all_reduce_deadline",
    _original_all_reduce_values,
    ("if context.executing_eagerly():", "pool.map(thread_fn", "self._all_reduce("),
    "multi_worker",
    patch=(_all_reduce, "_all_reduce_per_replica_values", _all_reduce_per_replica_values),
)
HOOKS = (HOOK, EAGER_ALL_REDUCE_HOOK)


@contextlib.contextmanager
def timed(name: str):
    """Times an eager distributed operation (`name`, for the flight recorder) by the deadline, and records it."""
    deadline = _step_deadline
    with flight.collective(name), _NOTHING if deadline is None else deadline.running():
        yield


def set_step_deadline(deadline, *, every_function: bool = False) -> None:
    """Times calls of functions with collectives by `deadline` (a `StepDeadline`; None: untimed).

    With `every_function`, every eagerly called traced function is timed: a
    multi-process DTensor program holds no collective op before DTensor
    expands it, so the collectives are not visible in its definition.
    """
    global _step_deadline, _every_function
    with _lock:
        _every_function = bool(every_function) and deadline is not None
        if deadline is not None:
            for h in HOOKS:
                h.check()
                h.apply()
        if _step_deadline is not None and _step_deadline is not deadline:
            _step_deadline.close()
        _step_deadline = deadline
