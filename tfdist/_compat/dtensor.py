"""DTensor variable reads, and the function-call options of ModelParallelStrategy's steps.

`GatheredVariable` (a DVariable stored split, read whole) overrides TensorFlow's
`BaseResourceVariable._read_variable_op`, which `value()` and tensor conversion
go through.

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

from tensorflow.core.protobuf import config_pb2
from tensorflow.core.protobuf import rewriter_config_pb2
from tensorflow.experimental import dtensor
from tensorflow.python.eager import context

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

HOOKS = (
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
