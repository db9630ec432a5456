"""Model parallelism: Keras 3 weights split over a DTensor device mesh.

`ModelParallelStrategy` is a `tf.distribute.Strategy` whose variables are
DTensor variables (`DVariable`s). Layout rules on each variable's Keras path
decide which dimensions are split over which mesh axis; the batch is split over
the batch axis. The model runs as ONE global SPMD program (DTensor inserts the
collectives), so Keras sees a single replica (`num_replicas_in_sync == 1`) and
computes the loss, gradients and metrics of the global batch as on one device.

Read it top to bottom:

* `strategy.py`: `ModelParallelStrategy`. Its arguments (`mesh`, `rules`,
  `devices`, `batch_axis`) are checked there, the mesh is built
  (`tfdist.placement.mesh.make_mesh`), `tfdist._compat.install("model_parallel")`
  is the one hook call, and all settings go to the runtime's constructor.
  `placement_report` (a `tfdist.placement.report.PlacementReport`) too.
* `runtime.py`: `ModelParallelExtended`, the `tf.distribute` extension points.
  `scope()` -> `_create_variable`: each tf.Variable Keras creates becomes a
  `ShardedVariable` with the layout its rule gives its Keras path (the path of
  the Keras variable being initialized, from `tfdist._compat.variables`, so it
  is right for subclassed models built after their name scopes are gone);
  optimizer slots take their variable's layout (Keras creates them under
  `colocate_vars_with`); scalars are replicated. `experimental_distribute_dataset`
  -> an iterable of batch-sharded DTensor batches (DTensor cannot consume a
  tf.data iterator inside a traced step, so Keras takes its Python-loop path).
  `run` -> `_call_for_each_replica`: packs eager inputs into batch-sharded
  DTensors and returns outputs replicated, so Keras can read them on the host.
  `_tfdist_shard_batch` is what the `*_on_batch` hook shards host inputs with.
  Custom loops without `run`: `_tfdist_call_model` calls a model created
  under the strategy in its scope (eager host inputs batch-sharded, outputs
  host-readable) and, once the outermost model is built, warns about rules
  that matched none of its weights; `_tfdist_apply_outside_replica` runs
  Keras' optimizer apply in the scope and a replica context, as `run` would.
* `variables.py`: `ShardedVariable` / `GatheredVariable` and `shard_value`.
"""

from tfdist.placement.report import PlacementReport
from tfdist.placement.report import VariablePlacement
from tfdist.strategies.model_parallel import strategy
from tfdist.strategies.model_parallel.strategy import COMBINE_ALL_REDUCES_ENV
from tfdist.strategies.model_parallel.strategy import ModelParallelStrategy
from tfdist.strategies.model_parallel.strategy import ensure_safe_dtensor_env
from tfdist.strategies.model_parallel.variables import GatheredVariable
from tfdist.strategies.model_parallel.variables import ShardedVariable
from tfdist.strategies.model_parallel.variables import shard_value

__all__ = [
    "COMBINE_ALL_REDUCES_ENV",
    "GatheredVariable",
    "ModelParallelStrategy",
    "PlacementReport",
    "ShardedVariable",
    "VariablePlacement",
    "ensure_safe_dtensor_env",
    "shard_value",
    "strategy",
]
