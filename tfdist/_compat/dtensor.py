"""DTensor variable reads: the one read path ModelParallelStrategy's GatheredVariable overrides.

`GatheredVariable` (a DVariable stored split, read whole) overrides TensorFlow's
`BaseResourceVariable._read_variable_op`, which `value()` and tensor conversion
go through. Checked on TensorFlow 2.21.
"""

from __future__ import annotations

from tensorflow.experimental import dtensor

from tfdist._compat._hook import hook

HOOKS = (
    hook("variable_read", dtensor.DVariable.value, ("self._read_variable_op()",), "model_parallel"),
    hook("variable_read_op", dtensor.DVariable._read_variable_op, ("read_variable_op(",), "model_parallel"),
    hook("variable_to_tensor", dtensor.DVariable._dense_var_to_tensor, ("return self.value()",), "model_parallel"),
)
