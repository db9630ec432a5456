"""Where this process stands in a distributed run: `Topology`, and `of(strategy)` for any strategy.

Callbacks (checkpoints, sync checks, throughput, warmup) ask this instead of
guessing from a strategy's attributes. tfdist's strategies say it themselves
(their `topology` property); any other `tf.distribute.Strategy` is read
from TensorFlow's public API.

Example:

>>> import tensorflow as tf
>>> from tfdist.strategies import topology
>>> topology.of(tf.distribute.get_strategy())
Topology(worker_index=0, num_workers=1, data_parallel_size=1)
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Topology:
    """This process' place in the run.

    Attributes:
        worker_index: this process' index among the workers (0 is the chief).
        num_workers: how many processes train together.
        data_parallel_size: how many ways each global batch is split (replicas
            in sync, or the batch-axis size of a mesh).
    """

    worker_index: int
    num_workers: int
    data_parallel_size: int

    @property
    def is_chief(self) -> bool:
        """Whether this process writes shared files (worker 0)."""
        return self.worker_index == 0


def of(strategy) -> Topology:
    """The `Topology` of this process under `strategy` (a tfdist strategy or any tf.distribute one)."""
    own = getattr(strategy, "topology", None)
    if isinstance(own, Topology):
        return own
    resolver = getattr(strategy, "cluster_resolver", None)  # MultiWorkerMirroredStrategy and TPU strategies
    num_workers, index = 1, 0
    if resolver is not None and resolver.task_type is not None:
        spec = resolver.cluster_spec().as_dict()
        workers = [job for job in ("chief", "worker") if job in spec]
        num_workers = sum(len(spec[job]) for job in workers)
        index = int(resolver.task_id or 0) + (len(spec.get("chief", ())) if resolver.task_type == "worker" else 0)
    return Topology(worker_index=index, num_workers=num_workers, data_parallel_size=strategy.num_replicas_in_sync)
