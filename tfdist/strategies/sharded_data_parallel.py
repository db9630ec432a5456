"""`ShardedDataParallelStrategy`: data parallelism whose weights and optimizer state are split (ZeRO / FSDP)."""

from __future__ import annotations

from tfdist import _validate
from tfdist import cluster as cluster_lib
from tfdist.placement import mesh as mesh_lib
from tfdist.placement.rules import LayoutRules
from tfdist.strategies import multi_worker
from tfdist.strategies.model_parallel import multi_process
from tfdist.strategies.model_parallel.auto_shard import DEFAULT_MIN_SIZE
from tfdist.strategies.model_parallel.auto_shard import MODES
from tfdist.strategies.model_parallel.auto_shard import AutoShard
from tfdist.strategies.model_parallel.strategy import ModelParallelStrategy


class ShardedDataParallelStrategy(ModelParallelStrategy):
    """Data parallelism with the model's state split over the data-parallel devices (ZeRO-1, ZeRO-3 / FSDP).

    Each batch is split over the `axis` devices as under
    `DataParallelStrategy`, and the training is the same as on one device;
    what changes is what each device keeps. No layout rules to write: every
    trainable variable is split over `axis` on its largest dimension that
    the axis size divides.

    * `shard="weights"` (ZeRO-3, PyTorch's FSDP `fully_shard`): weights and
      optimizer slots are stored split; each step all-gathers a weight for
      its use in the forward and backward pass, and its gradient comes back
      reduce-scattered, so each device updates its part. Persistent bytes per
      device: 1/N of the model's state.
    * `shard="optimizer"` (ZeRO-1): weights stay whole on every device;
      optimizer slots are split, each device updates its part of each weight
      and the new weight is all-gathered. With Adam in float32: 4 + 8/N bytes
      per parameter instead of 12.

    Variables with fewer than `min_size` elements, variables with no
    dimension divisible by the axis size, and non-trainable ones (BatchNorm
    statistics, as FSDP leaves buffers) stay replicated over `axis`;
    `placement_report` gives each variable's split dimension or the reason.

    On a 2-D mesh such as `{"batch": 2, "model": 4}` with
    `rules=tfdist.layouts.transformer()`, the rules split weights over the
    model axis (tensor parallelism) and the sharding splits what they keep
    whole over `axis` (FSDP x tensor parallelism). A rule may not use
    `axis` itself.

    It is a `ModelParallelStrategy` (one global SPMD program on a DTensor
    mesh): `fit` / `evaluate` / `predict`, custom loops, checkpoints that hold
    whole tensors (they load on one device and on any other mesh), tfdist's
    callbacks, and processes across hosts (`cluster`) work as described there.

    Args:
        shard: "weights" (ZeRO-3 / FSDP) or "optimizer" (ZeRO-1).
        mesh: mesh axis name -> size; default `{axis: number of devices}` (of
            all processes). Must have `axis`.
        rules: layout rules for the other mesh axes (see
            `ModelParallelStrategy`); None: none.
        axis: the mesh axis that splits batches and, automatically, variables.
        min_size: variables with fewer elements stay replicated over `axis`
            (a gather per use costs more than their bytes save).
        devices: device names; defaults to all GPUs, else all logical CPUs.
        cluster, timeout, heartbeat_timeout, join_timeout, sharding: across
            processes, as for `ModelParallelStrategy`.

    Raises:
        ValueError: for a `shard` mode that does not exist, a mesh without
            `axis`, a rule that uses `axis`, a bad `min_size`, and what
            `ModelParallelStrategy` refuses.

    Example:

    >>> import keras, numpy as np, tfdist
    >>> strategy = tfdist.ShardedDataParallelStrategy(shard="weights", devices=["CPU:0"], min_size=4)
    >>> with strategy.scope():
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="dense")])
    ...     model.compile(optimizer="adam", loss="mse")
    >>> history = model.fit(np.ones((8, 4)), np.ones((8, 2)), batch_size=4, verbose=0)
    >>> strategy.placement_report(model, print_fn=None).variables[0].note
    "split dim 0 over 'batch'"
    """

    def __init__(
        self,
        *,
        shard: str = "weights",
        mesh: dict[str, int] | None = None,
        rules: LayoutRules | list | None = None,
        axis: str = "batch",
        min_size: int = DEFAULT_MIN_SIZE,
        devices: list[str] | None = None,
        cluster: cluster_lib.Cluster | None = None,
        timeout: float | None = multi_worker.DEFAULT_TIMEOUT,
        heartbeat_timeout: float = multi_worker.DEFAULT_HEARTBEAT_TIMEOUT,
        join_timeout: float | None = None,
        sharding: str = "auto",
    ):
        _validate.one_of("shard", shard, MODES, where=" of ShardedDataParallelStrategy")
        if not isinstance(axis, str) or not axis:
            raise _validate.invalid("axis", axis, "a mesh axis name such as 'batch'")
        if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
            raise _validate.invalid("min_size", min_size, "an int >= 1 (elements)")
        cluster = self._resolve_cluster(cluster)
        rules = LayoutRules(rules if rules is not None else ())
        if mesh is None and rules.mesh is not None:
            mesh = dict(rules.mesh)
        if mesh is None:
            processes = cluster.num_workers if cluster is not None else 1
            mesh = {axis: multi_process.planned_local_devices(devices) * processes}
        mesh = mesh_lib.validate_axes(mesh)
        if axis not in mesh:
            raise ValueError(
                f"The mesh {mesh!r} has no axis {axis!r} for ShardedDataParallelStrategy to split batches and "
                f"variables over. Valid choices for `axis`: {list(mesh)}; or add {axis!r} to the mesh."
            )
        for rule in rules:
            if axis in rule.axes:
                raise ValueError(
                    f"Layout rule {rule} uses mesh axis {axis!r}, the axis ShardedDataParallelStrategy splits "
                    f"variables over itself. A rule may use only the other mesh axes "
                    f"({[a for a in mesh if a != axis]}); the data axis then splits a dimension the rule keeps "
                    "whole."
                )
        self._auto_shard = AutoShard(mode=shard, axis=axis, size=mesh[axis], min_size=min_size)
        self._start(
            mesh=mesh,
            rules=rules,
            devices=devices,
            batch_axis=axis,
            cluster=cluster,
            timeout=timeout,
            heartbeat_timeout=heartbeat_timeout,
            join_timeout=join_timeout,
            sharding=sharding,
            auto_shard=self._auto_shard,
        )

    @property
    def shard(self) -> str:
        """"weights" (ZeRO-3 / FSDP) or "optimizer" (ZeRO-1)."""
        return self._auto_shard.mode

    @property
    def min_size(self) -> int:
        """Variables with fewer elements stay replicated over the data axis."""
        return self._auto_shard.min_size

    def __repr__(self):
        processes = f", processes={self._cluster.num_workers}" if self._cluster else ""
        return (
            f"ShardedDataParallelStrategy(shard={self.shard!r}, mesh={self.mesh_shape!r}, rules={self.rules!r}, "
            f"axis={self.batch_axis!r}{processes})"
        )
