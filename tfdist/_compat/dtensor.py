"""DTensor variable reads, plain tensors into DTensor programs, and the call options of ModelParallelStrategy's steps.

`GatheredVariable` (a DVariable stored split, read whole) overrides TensorFlow's
`BaseResourceVariable._read_variable_op`, which `value()` and tensor conversion
go through.

`ConcreteFunction._call_flat` (every call of a traced function): a function
that reads DTensor variables refuses plain tensors ("got a regular tensor for
input 0 ... but was expecting a DTensor"), as KerasHub's `generate` passes them
to its traced step, and as a user's `tf.function` may. While a strategy owns
the mesh of those variables (`register_mesh`), its
`_tfdist_place_plain_inputs` packs the plain eager inputs onto the mesh, and
the outputs come back as plain tensors (`_tfdist_plain_outputs`; DTensors,
replicated, while a gradient tape may record the call). Calls whose inputs
are all DTensors, and functions of no such variables, run unchanged.

`no_memory_optimizer()`: the Keras steps of ModelParallelStrategy are called
with Grappler's memory optimizer off (through the eager context's per-thread
function-call options; `tf.config.optimizer` cannot set it). On each
SPMD-expanded per-device graph the pass changes nothing (0 nodes, 0 edges),
takes 0.5-0.6 s at the first step, and its static cost estimate logs
"op_level_cost_estimator.cc: Incompatible Matrix dimensions" at error level,
3 lines per device. Checked on TensorFlow 2.21.
"""

from __future__ import annotations

import contextlib
import weakref

import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.core.protobuf import rewriter_config_pb2
from tensorflow.experimental import dtensor
from tensorflow.python.eager import context
from tensorflow.python.eager import record
from tensorflow.python.eager.polymorphic_function import concrete_function as tf_concrete_function
from tensorflow.python.framework import ops as tf_ops

from tfdist._compat._hook import hook

_configs: dict = {}


def _without_memory_optimizer(options: context.FunctionCallOptions) -> context.FunctionCallOptions:
    key = (options.executor_type, options.config_proto_serialized)
    if key not in _configs:
        config = config_pb2.ConfigProto.FromString(options.config_proto_serialized)
        config.graph_options.rewrite_options.memory_optimization = rewriter_config_pb2.RewriterConfig.NO_MEM_OPT
        _configs[key] = context.FunctionCallOptions(executor_type=options.executor_type, config_proto=config)
    return _configs[key]


@contextlib.contextmanager
def no_memory_optimizer():
    """Calls of traced functions on this thread meanwhile run without Grappler's memory optimizer."""
    ctx = context.context()
    saved = ctx._thread_local_data.function_call_options
    ctx.function_call_options = _without_memory_optimizer(ctx.function_call_options)
    try:
        yield
    finally:
        ctx._thread_local_data.function_call_options = saved

_mesh_owners: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # mesh string -> its strategy's extended
_function_owners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ConcreteFunction -> extended or None
_original_call_flat = tf_concrete_function.ConcreteFunction._call_flat
_NOT_DATA = (tf.resource, tf.variant)


def register_mesh(mesh, extended) -> None:
    """Makes `extended` (a DTensor strategy's) place plain inputs of functions that read variables on `mesh`."""
    _mesh_owners[mesh.to_string()] = extended


def _plain(tensor) -> bool:
    return isinstance(tensor, tf_ops.EagerTensor) and tensor.dtype not in _NOT_DATA and not dtensor.is_dtensor(tensor)


def _owner(function, captured_inputs):
    """The extended whose mesh holds the DTensors `function` captures (its variables), or None."""
    try:
        return _function_owners[function]
    except KeyError:
        pass
    owner = None
    for captured in captured_inputs:
        if isinstance(captured, tf_ops.EagerTensor) and dtensor.is_dtensor(captured):
            owner = _mesh_owners.get(dtensor.fetch_layout(captured).mesh.to_string())
            break
    _function_owners[function] = owner
    return owner


def _call_flat(self, tensor_inputs, captured_inputs):
    if not _mesh_owners or not context.executing_eagerly():
        return _original_call_flat(self, tensor_inputs, captured_inputs)
    plain = [i for i, tensor in enumerate(tensor_inputs) if _plain(tensor)]
    owner = _owner(self, captured_inputs) if plain else None
    if owner is None:
        return _original_call_flat(self, tensor_inputs, captured_inputs)
    tensor_inputs = list(tensor_inputs)
    placed = owner._tfdist_place_plain_inputs([tensor_inputs[i] for i in plain])
    for i, tensor in zip(plain, placed):
        tensor_inputs[i] = tensor
    with no_memory_optimizer():  # as for Keras' steps (below): no cost-estimate noise, no wasted pass
        outputs = _original_call_flat(self, tensor_inputs, captured_inputs)
    return owner._tfdist_plain_outputs(outputs, recorded=record.could_possibly_record())


HOOKS = (
    hook(
        "plain_inputs",
        _original_call_flat,
        ("args = tensor_inputs + captured_inputs", "return self.function_type.pack_output(flat_outputs)"),
        "model_parallel",
        patch=(tf_concrete_function.ConcreteFunction, "_call_flat", _call_flat),
    ),
    hook("variable_read", dtensor.DVariable.value, ("self._read_variable_op()",), "model_parallel"),
    hook("variable_read_op", dtensor.DVariable._read_variable_op, ("read_variable_op(",), "model_parallel"),
    hook("variable_to_tensor", dtensor.DVariable._dense_var_to_tensor, ("return self.value()",), "model_parallel"),
    hook(
        "function_call_options",
        context.Context.function_call_options.fget,
        ("self._thread_local_data.function_call_options",),
        "model_parallel",
    ),
)
