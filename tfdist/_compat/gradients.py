"""TensorFlow's eager/tape gradient function: gradients built next to their forward ops.

`tf.GradientTape` builds each gradient op in the device scope of the
`tape.gradient` call, so every backward op would land on one device. TF has
`colocate_gradients_with_ops` for `tf.gradients` only; for tapes, the hook
re-registers the tape's gradient function with a wrapper that, while
`layer_call.stage_devices` is active (a PipelineStrategy step), enters the
forward op's device. Checked on TensorFlow 2.21.
"""

from __future__ import annotations

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import backprop as tf_backprop

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


def _colocated_gradient_function(
    op_name, attr_tuple, num_inputs, inputs, outputs, out_grads, skip_input_indices, forward_pass_name_scope
):
    args = (op_name, attr_tuple, num_inputs, inputs, outputs, out_grads, skip_input_indices, forward_pass_name_scope)
    device = _forward_device(op_name, inputs, outputs) if layer_call.staging() else ""
    if not device:
        return _original_gradient_function(*args)
    with tf.device(device):
        return _original_gradient_function(*args)


HOOKS = (
    hook(
        "gradient_function",
        _original_gradient_function,
        ("mock_op = _MockOp(", "return grad_fn(mock_op, *out_grads)"),
        "pipeline",
        patch=(tf_backprop, "_gradient_function", _colocated_gradient_function),
        after=lambda: pywrap_tfe.TFE_Py_RegisterGradientFunction(_colocated_gradient_function),
    ),
    hook("gradient_registration", tf_backprop, ("TFE_Py_RegisterGradientFunction(_gradient_function)",), "pipeline"),
)
