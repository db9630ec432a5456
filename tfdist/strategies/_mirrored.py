"""What tfdist's mirrored strategies share: collective key bases, communication choices, construction.

TensorFlow's `MirroredStrategy.__init__` and `MultiWorkerMirroredStrategy.__init__`
each build their own extended; tfdist's strategies build theirs (with the
settings as constructor arguments) and hand it to `init_strategy`, which does
the rest of what those constructors do.
"""

from __future__ import annotations

import itertools

import tensorflow as tf
from tensorflow.python.distribute import collective_util
from tensorflow.python.distribute import cross_device_ops as cross_device_ops_lib
from tensorflow.python.distribute import device_util
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import mirrored_strategy

from tfdist import _validate
from tfdist.strategies import _exact

COMMUNICATION_CHOICES = ("auto", "ring", "reduce_to_one", "hierarchical", "nccl")
_GPU_ONLY = ("nccl",)
# Collective group/instance keys start at a strategy's key base. TensorFlow gives every
# MirroredStrategy the base 0, so two strategies in one process (a notebook, a test suite)
# reuse keys and their all-reduces mix ("Shape mismatch in the collective instance").
# Each tfdist single-host strategy gets a base of its own, far from 0.
_KEY_BASES = itertools.count(start=10_000_000, step=10_000_000)


def validate_communication(communication, devices) -> str:
    """Checks a single-host `communication` choice against the devices; returns it.

    Raises:
        ValueError: for a choice not in `COMMUNICATION_CHOICES`, or a GPU-only one on other devices.
    """
    _validate.one_of("communication", communication, COMMUNICATION_CHOICES)
    if communication in _GPU_ONLY:
        not_gpu = [d for d in devices if "GPU" not in d.upper()]
        if not_gpu:
            raise ValueError(
                f"communication={communication!r} needs GPU devices, but these are not GPUs: {not_gpu}. "
                "Use communication='auto', 'reduce_to_one', 'hierarchical' or 'ring' on CPUs."
            )
    return communication


def resolve_communication(communication: str, devices) -> str:
    """The all-reduce `communication` stands for on `devices`: "auto" resolved, any other choice as it is.

    "auto" is "reduce_to_one" when no device is a GPU (one host's CPU devices share its memory: summing
    on one device and copying back moves each byte once, where a ring moves it 2(N-1)/N times in
    N-1 dependent rounds; `benchmarks/allreduce.py` measures both), else "collective": TensorFlow's
    own choice, NCCL collectives on GPUs.

    Example:

    >>> resolve_communication("auto", ["/device:CPU:0", "/device:CPU:1"])
    'reduce_to_one'
    >>> resolve_communication("auto", ["/device:GPU:0", "/device:GPU:1"])
    'collective'
    >>> resolve_communication("ring", ["/device:CPU:0", "/device:CPU:1"])
    'ring'
    """
    if communication != "auto":
        return communication
    return "collective" if any("GPU" in d.upper() for d in devices) else "reduce_to_one"


def init_strategy(strategy: tf.distribute.Strategy, extended, name: str) -> None:
    """Finishes constructing `strategy` around `extended`, as TensorFlow's mirrored constructors do."""
    distribute_lib.Strategy.__init__(strategy, extended)
    distribute_lib.distribution_strategy_gauge.get_cell("V2").set(name)


def next_key_base() -> int:
    """A collective key base no other tfdist strategy of this process uses."""
    return next(_KEY_BASES)


class MirroredExtended(_exact.ExactReplicas, mirrored_strategy.MirroredExtended):
    """MirroredExtended over one host's devices with the exact runtime and a `communication` choice.

    Args:
        container_strategy: the strategy (with its `_collective_key_base` set).
        devices: the replicas' devices.
        communication: one of `COMMUNICATION_CHOICES` (checked by `validate_communication`).
        gradient_dtype: see `tfdist.strategies._exact.ExactReplicas`.
    """

    def __init__(self, container_strategy, *, devices, communication: str, gradient_dtype: str | None = None):
        resolved = resolve_communication(communication, [device_util.canonicalize(d) for d in devices])
        cross_ops = {
            "collective": None,
            "ring": None,
            "reduce_to_one": cross_device_ops_lib.ReductionToOneDevice(),
            "nccl": cross_device_ops_lib.NcclAllReduce(),
            "hierarchical": cross_device_ops_lib.HierarchicalCopyAllReduce(),
        }[resolved]
        self._tfdist_communication = resolved
        super().__init__(container_strategy, devices=devices, cross_device_ops=cross_ops, gradient_dtype=gradient_dtype)
        if resolved == "ring":
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

    def _get_cross_device_ops(self, value):
        # Without merge_call (the update step of a locally accumulating optimizer, or XLA) an all-reduce
        # runs in each replica and needs collective ops whatever `communication` chose; TensorFlow
        # then logs a warning meant for XLA users. The choice itself holds everywhere else.
        if not self._use_merge_call():
            return self._collective_ops
        return super()._get_cross_device_ops(value)
