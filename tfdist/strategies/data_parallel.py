"""Data-parallel strategies: every replica holds all weights and sees part of each batch."""

from __future__ import annotations

import tensorflow as tf

from tfdist import _compat
from tfdist import _validate
from tfdist import devices as devices_lib
from tfdist.strategies import _exact
from tfdist.strategies import _mirrored
from tfdist.strategies import topology as topology_lib

COMMUNICATION_CHOICES = _mirrored.COMMUNICATION_CHOICES
GRADIENT_DTYPES = _exact.GRADIENT_DTYPES
BATCH_STATISTICS = _exact.BATCH_STATISTICS


class DataParallelStrategy(tf.distribute.MirroredStrategy):
    """Synchronous data parallelism on one host that matches single-device training.

    A `tf.distribute.MirroredStrategy` (Keras accepts it as it is) that also
    makes Keras 3 exact where plain MirroredStrategy is not: a global batch that
    does not split evenly over the replicas is weighted per example (not per
    replica) and never crashes, gradient clipping acts on the all-reduced
    gradient, and `gradient_accumulation_steps` works.

    Args:
        devices: device names to replicate over, e.g. `["GPU:0", "GPU:1"]` or
            `["CPU:0", "CPU:1"]`. Defaults to all GPUs, else all logical CPUs
            (see `tfdist.simulate_devices`).
        communication: how gradients are all-reduced: "auto" ("reduce_to_one"
            on CPUs, the fastest there; TensorFlow's NCCL collectives on GPUs),
            "reduce_to_one" (summed on the first device, copied back),
            "hierarchical" (hierarchical copy), "ring" (ring collectives) or
            "nccl" (NCCL all-reduce, GPUs only). `benchmarks/allreduce.py`
            measures each on the devices at hand.
        gradient_dtype: None (all-reduce gradients in their own dtype), or
            "bfloat16" / "float16": wider float gradients are cast to it for
            the all-reduce (half the bytes to move) and back afterwards;
            weights drift slightly from a float32 all-reduce. The same
            option as `tfdist.MultiWorkerStrategy`'s.
        batch_statistics: what layers that compute from the batch in
            training see: "replica" (the default, as under any
            MirroredStrategy: each replica's part of the global batch, and
            `fit` warns once, naming them) or "global" (the whole global
            batch, as on one device: BatchNormalization's mean and variance
            and KerasHub's MoE load-balancing losses (Mixtral, Qwen-MoE,
            Qwen3-MoE, Qwen3.5-MoE) are computed from sums all-reduced over
            the replicas, each weighted by its examples; one small
            all-reduce per such layer and step). A layer of your own opts in
            with `keras.ops.moments(x, axes, synchronized=True)`, global under
            either setting. The same option as `tfdist.MultiWorkerStrategy`'s.

    Raises:
        ValueError: for an unknown `communication`, `gradient_dtype` or `batch_statistics`, a
            device that does not exist, a repeated device, or "nccl" on
            CPUs.

    Example:

    >>> import keras, numpy as np, tfdist
    >>> strategy = tfdist.DataParallelStrategy(devices=["CPU:0"])
    >>> with strategy.scope():
    ...     model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    ...     model.compile(optimizer="sgd", loss="mse")
    >>> history = model.fit(np.ones((10, 3)), np.ones((10, 1)), batch_size=4, verbose=0)
    >>> strategy.num_replicas_in_sync
    1
    """

    def __init__(
        self,
        *,
        devices: list[str] | None = None,
        communication: str = "auto",
        gradient_dtype: str | None = None,
        batch_statistics: str = "replica",
    ):
        devices = devices_lib.device_list(devices)
        _mirrored.validate_communication(communication, devices)
        _validate.one_of("gradient_dtype", gradient_dtype, GRADIENT_DTYPES)
        _validate.one_of("batch_statistics", batch_statistics, BATCH_STATISTICS)
        _compat.install("data_parallel")
        self._communication = communication
        self._gradient_dtype = gradient_dtype
        self._collective_key_base = _mirrored.next_key_base()
        extended = _mirrored.MirroredExtended(
            self, devices=devices, communication=communication, gradient_dtype=gradient_dtype
        )
        extended._tfdist_batch_statistics = batch_statistics
        _mirrored.init_strategy(self, extended, "MirroredStrategy")

    @property
    def communication(self) -> str:
        """The gradient all-reduce choice this strategy was built with ("auto" included)."""
        return self._communication

    @property
    def resolved_communication(self) -> str:
        """The all-reduce in use: `communication` with "auto" resolved ("reduce_to_one" on CPUs, else "collective")."""
        return self.extended._tfdist_communication

    @property
    def batch_statistics(self) -> str:
        """What BatchNormalization and MoE balancing losses compute from: "replica" or "global" (see the class)."""
        return self.extended._tfdist_batch_statistics

    @property
    def topology(self) -> topology_lib.Topology:
        """One process, one replica per device."""
        return topology_lib.Topology(worker_index=0, num_workers=1, data_parallel_size=self.num_replicas_in_sync)

    def __repr__(self):
        return (
            f"DataParallelStrategy(devices={list(self.extended.worker_devices)!r}, "
            f"communication={self._communication!r}, gradient_dtype={self._gradient_dtype!r}, "
            f"batch_statistics={self.batch_statistics!r})"
        )
