"""TensorFlow's eager/tape gradient function: gradients built next to their forward ops.

`tf.GradientTape` builds each gradient op in the device scope of the
`tape.gradient` call, so every backward op would land on one device. TF has
`colocate_gradients_with_ops` for `tf.gradients` only; for tapes, the hook
re-registers the tape's gradient function with a wrapper that, while
`layer_call.stage_devices` is active (a PipelineStrategy step), enters the
forward op's device (the device of its incoming gradient when the tape hands
over neither the op's inputs nor its outputs: BiasAdd's gradient). The tape sums
the gradients of a tensor several ops read (a residual stream) with its
vspace's `aggregate_fn`, outside any gradient function: while staging, the sum
runs where most of those gradients are. A tf.function call (an XLA-compiled stage layer) records a
backward function of its own on the tape, not through that registry: while
staging, `_DelayedRewriteGradientFunctions._backward` (graph building) and
`_TapeGradientFunctions._wrap_backward_function` return one that calls the
backward function on the forward call's device. Checked on
TensorFlow 2.21.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import backprop as tf_backprop
from tensorflow.python.eager.polymorphic_function import concrete_function as tf_concrete_function

from tfdist._compat import layer_call
from tfdist._compat._hook import hook

_original_gradient_function = tf_backprop._gradient_function


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


def _gradient_device(gradients) -> str:
    """The device most of `gradients` (tensors, IndexedSlices or None) are on; the first such on a tie."""
    devices = [
        t.device
        for g in gradients or ()
        for t in _graph_tensors([g.values if isinstance(g, tf.IndexedSlices) else g])
        if t.device
    ]
    return max(devices, key=devices.count) if devices else ""


def _colocated_gradient_function(
    op_name, attr_tuple, num_inputs, inputs, outputs, out_grads, skip_input_indices, forward_pass_name_scope
):
    args = (op_name, attr_tuple, num_inputs, inputs, outputs, out_grads, skip_input_indices, forward_pass_name_scope)
    device = ""
    if layer_call.staging():
        device = _forward_device(op_name, inputs, outputs) or _gradient_device(out_grads)
    if not device:
        return _original_gradient_function(*args)
    with tf.device(device):
        return _original_gradient_function(*args)


_original_vspace = tf_backprop._default_vspace


def _colocated_aggregate(gradients):
    device = _gradient_device(gradients) if layer_call.staging() else ""
    if not device:
        return _original_vspace.aggregate_fn(gradients)
    with tf.device(device):
        return _original_vspace.aggregate_fn(gradients)


_colocated_vspace = _original_vspace._replace(aggregate_fn=_colocated_aggregate)


_delayed_functions = tf_concrete_function._DelayedRewriteGradientFunctions
_tape_functions = tf_concrete_function._TapeGradientFunctions
_original_delayed_backward = _delayed_functions._backward
_original_wrap_backward_function = _tape_functions._wrap_backward_function


def _on_forward_device(backward_function, outputs):
    """`backward_function`, called on the device of the call op producing `outputs` while staging."""
    device = outputs[0].op.device if layer_call.staging() and outputs and hasattr(outputs[0], "op") else ""
    if not device:
        return backward_function

    def on_forward_device(*args):
        with tf.device(device):
            return backward_function(*args)

    return on_forward_device


def _delayed_backward(self, outputs):
    backward_function, recorded = _original_delayed_backward(self, outputs)
    return _on_forward_device(backward_function, outputs), recorded


def _wrap_backward_function(self, forward_graph, backward, outputs):
    backward_function, recorded = _original_wrap_backward_function(self, forward_graph, backward, outputs)
    return _on_forward_device(backward_function, outputs), recorded


HOOKS = (
    hook(
        "gradient_function",
        _original_gradient_function,
        ("mock_op = _MockOp(", "return grad_fn(mock_op, *out_grads)"),
        "pipeline",
        patch=(tf_backprop, "_gradient_function", _colocated_gradient_function),
        after=lambda: pywrap_tfe.TFE_Py_RegisterGradientFunction(_colocated_gradient_function),
    ),
    hook(
        "function_gradient_delayed",
        _original_delayed_backward,
        ("def _backward_function(*args):", "return _backward_function, outputs"),
        "pipeline",
        patch=(_delayed_functions, "_backward", _delayed_backward),
    ),
    hook(
        "function_gradient",
        _original_wrap_backward_function,
        ("def _backward_function_wrapper(*args):", "return _backward_function_wrapper, recorded_outputs"),
        "pipeline",
        patch=(_tape_functions, "_wrap_backward_function", _wrap_backward_function),
    ),
    hook("gradient_registration", tf_backprop, ("TFE_Py_RegisterGradientFunction(_gradient_function)",), "pipeline"),
    hook(
        "gradient_aggregation",
        tf_backprop,
        ("aggregate_fn=_aggregate_grads", "TFE_Py_RegisterVSpace(_default_vspace)"),
        "pipeline",
        patch=(tf_backprop, "_default_vspace", _colocated_vspace),
        after=lambda: pywrap_tfe.TFE_Py_RegisterVSpace(_colocated_vspace),
    ),
)
