"""tf.distribute's `MirroredExtended`: the private methods tfdist's data-parallel runtime overrides.

The runtime (`tfdist/strategies/_exact.py`) overrides `_call_for_each_replica`
(to give each replica its share of the global batch) and `_use_merge_call` (so
Keras' optimizer code runs directly while gradients are applied in
cross-replica context); PipelineStrategy places a variable's copies through
`_create_variable`'s `colocate_with._devices`. Checked on TensorFlow 2.21.
"""

from __future__ import annotations

from tensorflow.python.distribute import mirrored_strategy

from tfdist._compat._hook import EXACT
from tfdist._compat._hook import hook

HOOKS = (
    hook(
        "replica_call", mirrored_strategy.MirroredExtended._call_for_each_replica, ("call_for_each_replica",), *EXACT
    ),
    hook("merge_call_choice", mirrored_strategy.MirroredExtended._use_merge_call, ("def _use_merge_call",), *EXACT),
    hook(
        "pipeline_variable_creator",
        mirrored_strategy.MirroredExtended._create_variable,
        ("colocate_with._devices",),
        "pipeline",
    ),
)
