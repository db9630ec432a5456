"""Data-parallel strategies: every replica holds all weights and sees part of each batch."""

from __future__ import annotations

import itertools

import tensorflow as tf
from tensorflow.python.distribute import collective_util
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import mirrored_strategy

from tfdist import devices as devices_lib
from tfdist.strategies import _keras_compat
from tfdist.strategies import topology as topology_lib

COMMUNICATION_CHOICES = ("auto", "nccl", "ring", "hierarchical")
GRADIENT_DTYPES = (None, "bfloat16", "float16")
_GPU_ONLY = ("nccl", "hierarchical")
# Collective group/instance keys start at a strategy's key base. TensorFlow gives every
# MirroredStrategy the base 0, so two strategies in one process (a notebook, a test suite)
# reuse keys and their all-reduces mix ("Shape mismatch in the collective instance").
# Each tfdist strategy gets a base of its own, far from 0.
_KEY_BASES = itertools.count(start=10_000_000, step=10_000_000)


def _validate_communication(communication, devices):
    if communication not in COMMUNICATION_CHOICES:
        raise ValueError(
            f"Invalid value for argument `communication`. Received: communication={communication!r}. "
            f"Expected one of {COMMUNICATION_CHOICES}."
        )
    if communication in _GPU_ONLY:
        not_gpu = [d for d in devices if "GPU" not in d.upper()]
        if not_gpu:
            raise ValueError(
                f"communication={communication!r} needs GPU devices, but these are not GPUs: {not_gpu}. "
                "Use communication='auto' or 'ring' on CPUs."
            )


def wire_dtype(gradient_dtype: str | None) -> tf.DType | None:
    """Checks a strategy's `gradient_dtype` and returns the dtype gradients are all-reduced in.

    Returns None for None (each gradient in its own dtype).

    Raises:
        ValueError: if `gradient_dtype` is not one of `GRADIENT_DTYPES`.

    Example:

    >>> wire_dtype("bfloat16").name
    'bfloat16'
    """
    if gradient_dtype not in GRADIENT_DTYPES:
        raise ValueError(
            f"Invalid value for argument `gradient_dtype`. Received: gradient_dtype={gradient_dtype!r}. "
            f"Expected one of {GRADIENT_DTYPES}."
        )
    return None if gradient_dtype is None else tf.as_dtype(gradient_dtype)


class _DataParallelExtended(_keras_compat.ExactReplicaMixin, mirrored_strategy.MirroredExtended):
    """MirroredExtended with tfdist's exact loss weighting and gradient application."""

    def __init__(self, container_strategy, devices, communication):
        cross_ops = {
            "auto": None,
            "ring": None,
            "nccl": cross_device_ops_lib.NcclAllReduce(),
            "hierarchical": cross_device_ops_lib.HierarchicalCopyAllReduce(),
        }[communication]
        super().__init__(container_strategy, devices=devices, cross_device_ops=cross_ops)
        if communication == "ring":
            self._communication_options = collective_util.Options(
                implementation=collective_util.CommunicationImplementation.RING
            )
            self._collective_ops = cross_device_ops_lib.CollectiveAllReduce(
                devices=self._devices,
                group_size=len(self._devices),
                options=self._communication_options,
                collective_keys=self._collective_keys,
            )
            self._cross_device_ops = self._collective_ops


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
        communication: how gradients are all-reduced: "auto" (TensorFlow's
            choice: NCCL collectives on GPUs, ring collectives on CPUs), "ring"
            (ring collectives), "nccl" (NCCL all-reduce, GPUs only) or
            "hierarchical" (hierarchical copy, GPUs only).
        gradient_dtype: None (all-reduce gradients in their own dtype), or
            "bfloat16" / "float16": wider float gradients are cast to it for
            the all-reduce (half the bytes to move) and back afterwards;
            weights drift slightly from a float32 all-reduce. The same
            option as `tfdist.MultiWorkerStrategy`'s.

    Raises:
        ValueError: for an unknown `communication` or `gradient_dtype`, a
            device that does not exist, a repeated device, or a GPU-only
            communication on CPUs.

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
    ):
        devices = devices_lib.device_list(devices)
        _validate_communication(communication, devices)
        wire = wire_dtype(gradient_dtype)
        _keras_compat.install()
        self._communication = communication
        self._gradient_dtype = gradient_dtype
        self._collective_key_base = next(_KEY_BASES)
        # MirroredStrategy.__init__ only builds a MirroredExtended; build ours instead.
        extended = _DataParallelExtended(self, devices=devices, communication=communication)
        extended._tfdist_gradient_dtype = wire
        distribute_lib.Strategy.__init__(self, extended)

    @property
    def communication(self) -> str:
        """The gradient all-reduce choice this strategy was built with."""
        return self._communication

    @property
    def topology(self) -> topology_lib.Topology:
        """One process, one replica per device."""
        return topology_lib.Topology(worker_index=0, num_workers=1, data_parallel_size=self.num_replicas_in_sync)

    def __repr__(self):
        return (
            f"DataParallelStrategy(devices={list(self.extended.worker_devices)!r}, "
            f"communication={self._communication!r}, gradient_dtype={self._gradient_dtype!r})"
        )
