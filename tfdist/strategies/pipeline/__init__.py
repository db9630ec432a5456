"""Pipeline parallelism: consecutive layers on different devices, micro-batches flowing through them.

Read it top to bottom:

* `strategy.py`: `PipelineStrategy`. Its arguments (`stages`, `microbatches`,
  `placement`, `cost`, `replicas`, `devices`, `communication`) are checked
  there, explicit placement rules are compiled once
  (`tfdist.placement.pipeline.StageRules`), the device grid is laid out,
  `tfdist._compat.install("pipeline")` is the one hook call, and all settings
  go to the runtime's constructor.
* `runtime.py`: `PipelineExtended`, the data-parallel runtime plus stage
  placement of variables, the plan (from `tfdist.placement.pipeline`), and
  the micro-batched step.
* `microbatches.py`: splitting a replica's batch into micro-batches and summing
  their gradients.

The layer calls a plan cuts (`stage_units`: nested functional models opened),
the plan and its costs (`balance`, `even_split`, `partition`, `layer_flops`,
`layer_seconds`, `PipelinePlan`, `SharedWeights`, `plan_explicit`) are
`tfdist.placement.pipeline`.

Example:

>>> import tfdist
>>> from tfdist.strategies.pipeline import PipelineStrategy
>>> PipelineStrategy is tfdist.PipelineStrategy
True
"""

from tfdist.strategies.pipeline import strategy
from tfdist.strategies.pipeline.strategy import PipelineStrategy

__all__ = ["PipelineStrategy", "strategy"]
