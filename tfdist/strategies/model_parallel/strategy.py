"""`ModelParallelStrategy`: the public class; its arguments are checked here and handed to the runtime."""

from __future__ import annotations

import math
import os
import warnings

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor
from tensorflow.python.distribute import distribute_lib

from tfdist import _compat
from tfdist import _validate
from tfdist import cluster as cluster_lib
from tfdist import flight
from tfdist._compat import step_deadline
from tfdist.placement import attributes as attributes_lib
from tfdist.placement import mesh as mesh_lib
from tfdist.placement.report import PlacementReport
from tfdist.placement.report import VariablePlacement
from tfdist.placement.rules import LayoutRules
from tfdist.strategies import multi_worker
from tfdist.strategies import topology as topology_lib
from tfdist.strategies.model_parallel import multi_process
from tfdist.strategies.model_parallel.runtime import ModelParallelExtended
from tfdist.strategies.model_parallel.variables import GatheredVariable
from tfdist.strategies.model_parallel.variables import spec_of

COMBINE_ALL_REDUCES_ENV = "DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"


def ensure_safe_dtensor_env() -> None:
    """Disables DTensor's all-reduce combining pass, which corrupts Adam updates.

    On TensorFlow 2.21 the pass makes Adam silently wrong (measured on a
    transformer block, 2x4 mesh: weights off by 0.07 and the loss by 1-3% after
    8 steps, no error). DTensor reads the variable when it compiles a program,
    not when TensorFlow loads, so setting it here, before any DTensor
    computation, is enough (tested with TensorFlow imported first).

    Raises:
        RuntimeError: if the variable is set to anything but "0".
    """
    value = os.environ.setdefault(COMBINE_ALL_REDUCES_ENV, "0")
    if value != "0":
        raise RuntimeError(
            f"{COMBINE_ALL_REDUCES_ENV}={value!r} is set. DTensor's all-reduce combining pass silently "
            "corrupts optimizer updates (Adam) on TensorFlow 2.21; ModelParallelStrategy refuses to run "
            f"with it. Unset the variable or set {COMBINE_ALL_REDUCES_ENV}=0 before starting Python."
        )


class ModelParallelStrategy(distribute_lib.Strategy):
    """Trains a Keras 3 model whose weights are split over a mesh of devices.

    Build the model under `scope()`; then `fit`, `evaluate`, `predict`,
    `save`, `keras.saving.load_model`, `get_weights` and `set_weights` work as
    on one device, with numpy or tf.data input. Each weight is placed by the
    first (and only) layout rule matching its Keras path; unmatched weights and
    scalars are replicated; optimizer slots follow their weight. The batch is
    split over `batch_axis` (data parallelism over the model-parallel groups).
    A weight a rule splits over `batch_axis` too (FSDP-style, as KerasHub's
    layout maps split weights over the data axis) is stored so and gathered
    over that axis for each use (DTensor computes no matmul whose operands
    split the contracting dimension over different axes).

    The model runs as one global program: losses, gradients and metrics are
    those of the global batch, as on one device, and `num_replicas_in_sync` is 1.
    Checkpoints (`.keras`, `.weights.h5`, `tf.train.Checkpoint`) hold whole
    tensors, so they load onto another mesh shape or one device.

    Custom loops work with `strategy.run` and without it (DTensor style:
    `tf.GradientTape` and `optimizer.apply_gradients` in a `tf.function`, in
    the scope or after it): a model created under the scope builds its
    variables under it wherever it is first called. A traced step takes
    DTensor batches, from `shard_batch((x, y))` or
    `experimental_distribute_dataset`, or plain tensors: any traced function
    that reads this mesh's variables (KerasHub's `generate`, a user's
    `tf.function`) packs its plain tensor arguments onto the mesh (split on
    the batch axis where their leading dimension is the batch) and returns
    plain tensors; an eager `model(x)` takes numpy or tensors and returns
    host-readable outputs. Once a model is built,
    the rules that matched none of its weights are named in one warning.

    Across processes (one per host): in a cluster (`cluster`, else
    `TF_CONFIG` or Slurm through `tfdist.cluster.resolve`, as for
    `MultiWorkerStrategy`, e.g. under `tfdist-launch`) the mesh spans every
    process' devices, process r holding global devices `[r * L, (r + 1) * L)`
    of L each; the first mesh axis varies slowest, so over 2 hosts x 4
    devices `{"batch": 2, "model": 4}` splits the model within each host and
    the batch across hosts, and `{"batch": 1, "model": 8}` splits the model
    across hosts. tfdist sets DTensor's environment (`DTENSOR_*`) from the
    cluster. Construct the strategy first thing, before any TensorFlow op
    (`tfdist.simulate_devices` may come before it). Every process runs the
    same program: each reads the whole dataset and keeps its rows of every
    global batch (`sharding`), processes with the same batch rows get the
    same examples, and `fit` / `evaluate` / `predict` / `save` /
    `get_weights` must be called on every process (reading a split weight is
    a collective). Files: every process saves; Keras' `ModelCheckpoint` /
    `BackupAndRestore` and tfdist's callbacks let one process write each
    shared directory (a shared file system such as NFS, or one directory per
    host), the others writing to a scratch directory; a plain `model.save`
    gives each process its own path (worker 0's is the file to keep).
    Failures are bounded: a lost peer fails the others after
    `heartbeat_timeout` (TensorFlow's coordination service; a watchdog
    process ends this one 10 s later if TensorFlow did not), a step longer
    than `timeout` ends the process, and peers that never come end it after
    `join_timeout`.

    A batch that the batch axis does not divide (a dataset's last batch) is
    computed whole on every device: the same result, in a step traced for it.

    Limits: random ops (dropout) draw other numbers than on one device; each
    variable's initial value is computed whole on the host, then split.

    Args:
        mesh: mesh axis name -> size; the product must equal the number of
            devices. Default: the mesh of `rules` when it is a
            `keras.distribution.LayoutMap`, else `{"batch": 2, "model": 4}`. `{"model": 8}` is pure
            model parallelism, `{"batch": 8}` pure data parallelism.
        rules: layout rules, e.g. `tfdist.layouts.transformer()`: a
            `tfdist.layouts.LayoutRules`, a list of `(regex, spec)` pairs, or a
            `keras.distribution.LayoutMap` (such as KerasHub's
            `GemmaBackbone.get_layout_map(device_mesh)`; its keys keep Keras'
            matching, see `tfdist.layouts.LayoutRules`). None means every weight
            is replicated. Keras' own `set_distribution(ModelParallel(...))`
            builds this strategy from its LayoutMap after
            `tfdist.use_keras_distribution()`.
        devices: device names; defaults to all GPUs, else all logical CPUs.
        batch_axis: the mesh axis that splits each batch. When the mesh has no
            axis of this name (e.g. `{"model": 8}` with the default "batch"),
            each device sees the whole batch. None: never split batches.
        cluster: a `tfdist.cluster.Cluster` whose processes share the mesh;
            defaults to `tfdist.cluster.resolve()` (TF_CONFIG, then Slurm).
            None found, or one process: this process alone.
        timeout: across processes, seconds one distributed call (a step, a
            gather of a split weight) may run before the process is ended;
            None: no bound.
        heartbeat_timeout: across processes, seconds without a heartbeat after
            which a peer counts as lost. At exit each process also waits up
            to twice this for the others to reach their end, so that none
            takes its server down under a peer's last collective.
        join_timeout: across processes, seconds to wait at start-up for all
            of them; defaults to what `tfdist-launch --join_timeout` set, else
            300.
        sharding: across processes, how a `tf.data.Dataset` is split: "auto"
            or "data" (each process reads all and keeps its rows of each
            global batch; "auto" warns with a `DataShardingWarning`), "off"
            (each process' dataset yields only its rows), or "file" (refused
            across processes: the processes must agree on every batch size).
            A policy set on the dataset's options wins.

    Raises:
        ValueError: for a bad mesh, a mesh whose size differs from the device
            count (of all processes), a LayoutMap whose DeviceMesh differs from
            `mesh`, a mesh in which a process' devices do
            not fill whole rows, a rule naming an axis the mesh lacks or a layer's output
            (an activation layout such as "d2/output": rules place weights;
            activations follow them and the batch axis), or a `batch_axis`
            (other than the default) that the mesh lacks.
        RuntimeError: if DTensor's all-reduce combining pass is enabled
            (`DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION` other than "0"),
            which corrupts Adam updates; across processes, if TensorFlow's
            runtime already started, or the peers do not join in time.
        tfdist.cluster.ClusterError: for an invalid cluster description, or
            `DTENSOR_*` variables set by hand that disagree with the cluster.

    Example:

    >>> import keras, numpy as np, tfdist
    >>> strategy = tfdist.ModelParallelStrategy(
    ...     mesh={"batch": 1, "model": 1}, devices=["CPU:0"],
    ...     rules=[(r"dense/kernel$", (None, "model"))])
    >>> with strategy.scope():
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="dense")])
    ...     model.compile(optimizer="adam", loss="mse")
    >>> history = model.fit(np.ones((8, 4)), np.ones((8, 2)), batch_size=4, verbose=0)
    >>> strategy.placement_report(model, print_fn=None).variables[0].spec
    (None, 'model')
    """

    def __init__(
        self,
        *,
        mesh: dict[str, int] | None = None,
        rules: LayoutRules | list | None = None,
        devices: list[str] | None = None,
        batch_axis: str | None = "batch",
        cluster: cluster_lib.Cluster | None = None,
        timeout: float | None = multi_worker.DEFAULT_TIMEOUT,
        heartbeat_timeout: float = multi_worker.DEFAULT_HEARTBEAT_TIMEOUT,
        join_timeout: float | None = None,
        sharding: str = "auto",
    ):
        self._start(
            mesh=mesh,
            rules=rules,
            devices=devices,
            batch_axis=batch_axis,
            cluster=cluster,
            timeout=timeout,
            heartbeat_timeout=heartbeat_timeout,
            join_timeout=join_timeout,
            sharding=sharding,
        )

    @staticmethod
    def _resolve_cluster(cluster):
        """`cluster`, else the one `tfdist.cluster.resolve()` finds; None for one process."""
        if cluster is None:
            cluster = cluster_lib.resolve()
        elif not isinstance(cluster, cluster_lib.Cluster):
            raise _validate.invalid("cluster", cluster, "a tfdist.cluster.Cluster (see tfdist.cluster.resolve) or None")
        return None if cluster is not None and cluster.num_workers == 1 else cluster

    def _start(
        self, *, mesh, rules, devices, batch_axis, cluster, timeout, heartbeat_timeout, join_timeout, sharding,
        auto_shard=None,
    ):
        """Checks the arguments, joins the cluster, builds the mesh and the runtime (shared with subclasses)."""
        ensure_safe_dtensor_env()
        _validate.one_of("sharding", sharding, multi_worker.SHARDING_CHOICES)
        timeout = _validate.positive_number("timeout", timeout, allow_none=True, unit="seconds")
        heartbeat_timeout = _validate.positive_number("heartbeat_timeout", heartbeat_timeout, unit="seconds")
        if join_timeout is None:
            join_timeout = cluster_lib.join_timeout() or multi_worker.DEFAULT_JOIN_TIMEOUT
        join_timeout = _validate.positive_number("join_timeout", join_timeout, unit="seconds")
        cluster = self._resolve_cluster(cluster)
        rules = LayoutRules(rules if rules is not None else ())
        if mesh is None:
            mesh = dict(rules.mesh) if rules.mesh is not None else {"batch": 2, "model": 4}
        axes = mesh_lib.validate_axes(mesh)
        if rules.mesh is not None and dict(rules.mesh) != dict(axes):
            raise ValueError(
                f"The LayoutMap's DeviceMesh {rules.mesh!r} (axis name -> size) differs from the strategy's mesh "
                f"{dict(axes)!r}. Give the strategy the same mesh, or mesh=None to take the LayoutMap's."
            )
        rules.check_axes(axes)
        if batch_axis is not None:
            if not isinstance(batch_axis, str):
                raise ValueError(f"`batch_axis` must be a mesh axis name or None; got {batch_axis!r}.")
            if batch_axis not in axes:
                if batch_axis != "batch":
                    raise ValueError(
                        f"batch_axis={batch_axis!r} is not an axis of the mesh {axes!r}. "
                        f"Valid choices: {list(axes)} or None (every device sees the whole batch)."
                    )
                batch_axis = None
        self._cluster = cluster
        self._timeout = timeout
        if cluster is None:
            dmesh = mesh_lib.make_mesh(axes, devices)
            _compat.install("model_parallel")
        else:
            device_type = "GPU" if devices is None and tf.config.list_physical_devices("GPU") else "CPU"
            multi_process.check_environment(cluster)
            multi_process.check_mesh(axes, multi_process.planned_local_devices(devices), cluster)
            recorder = flight.start(cluster)
            with multi_worker._keep_sigterm_handler(), flight.phase("barrier", "join"):
                multi_process.initialize(
                    cluster,
                    heartbeat_timeout=heartbeat_timeout,
                    join_timeout=join_timeout,
                    device_type=device_type,
                    bounded_join=multi_worker._bounded_join,
                )
            dmesh = multi_process.make_mesh(axes, multi_process.local_devices(devices, cluster), cluster)
            _compat.install("model_parallel")
            self._watchdog = multi_process.ProcessWatchdog(
                cluster, timeout=timeout, heartbeat_timeout=heartbeat_timeout, on_stop=recorder.report
            )
            step_deadline.set_step_deadline(self._watchdog, every_function=True)
            multi_worker._leave_together(cluster, heartbeat_timeout, multi_process.WHO)
        super().__init__(
            ModelParallelExtended(
                self,
                mesh=dmesh,
                rules=rules,
                batch_axis=batch_axis,
                cluster=cluster,
                sharding=sharding,
                auto_shard=auto_shard,
            )
        )

    @property
    def mesh(self) -> dtensor.Mesh:
        """The DTensor mesh."""
        return self.extended.mesh

    @property
    def mesh_shape(self) -> dict[str, int]:
        """Axis name -> size."""
        return dict(self.extended._axes)

    @property
    def rules(self) -> LayoutRules:
        return self.extended.rules

    @property
    def batch_axis(self) -> str | None:
        """The mesh axis that splits batches, or None when every device sees the whole batch."""
        return self.extended.batch_axis

    @property
    def cluster(self) -> cluster_lib.Cluster | None:
        """The cluster whose processes share the mesh (None for one process)."""
        return self._cluster

    @property
    def topology(self) -> topology_lib.Topology:
        """This process' index and the number of processes; each global batch is split over the batch axis."""
        size = self.mesh_shape[self.batch_axis] if self.batch_axis else 1
        cluster = self._cluster
        return topology_lib.Topology(
            worker_index=cluster.rank if cluster else 0,
            num_workers=cluster.num_workers if cluster else 1,
            data_parallel_size=size,
        )

    def shard_batch(self, structure):
        """Packs host tensors/arrays into DTensors split on the batch axis (for custom loops)."""
        return self.extended.shard_batch(structure)

    def placement_report(self, model, *, print_fn=print) -> PlacementReport:
        """Where each variable of `model` (and of its optimizer) lives, and bytes per device.

        Args:
            model: a Keras model built under this strategy's scope.
            print_fn: called with the table as text; None to print nothing.

        Returns:
            A `PlacementReport`: per variable path, shape, spec, bytes in all
            and on each device, and the rule or role that chose its layout;
            totals per device; rules that matched nothing and variables whose
            layout differs from what their rule gives (both also issued as a
            warning).

        Raises:
            ValueError: if a variable of `model` was not created under this
                strategy's scope.
        """
        variables, seen = [], set()
        optimizer = getattr(model, "optimizer", None)
        optimizer_variables = list(optimizer.variables) if optimizer is not None else []
        for v in list(model.weights) + optimizer_variables:
            if id(v) not in seen:
                seen.add(id(v))
                variables.append(v)
        axes = self.extended._axes
        rows = []
        for v in variables:
            backing = getattr(v, "value", v)
            if not isinstance(backing, dtensor.DVariable) or backing.layout.mesh != self.mesh:
                raise ValueError(
                    f"Variable {v.path!r} was not created under this ModelParallelStrategy's scope. "
                    "Build the model (and compile it) inside `with strategy.scope():`."
                )
            spec = spec_of(backing.layout)
            shape = tuple(int(d) for d in v.shape)
            itemsize = np.dtype(backing.dtype.as_numpy_dtype).itemsize
            total = math.prod(shape) * itemsize
            split = math.prod(axes[a] for a in spec if a is not None)
            gathered = isinstance(backing, GatheredVariable)
            note = getattr(backing, "_tfdist_note", "")
            chosen_by = getattr(backing, "_tfdist_chosen_by", "")
            rows.append(
                VariablePlacement(
                    v.path, shape, backing.dtype.name, spec, total, total // split, gathered, note, chosen_by
                )
            )
        per_device = sum(r.bytes_per_device for r in rows)
        by_path = {r.path: r for r in rows}
        attribute_paths = attributes_lib.attribute_paths(model)
        misplaced = []
        for w in model.weights:
            # Placed as trainable or not when created (a layer frozen later keeps its variables where they are).
            backing = getattr(w, "value", w)
            created_trainable = getattr(backing, "trainable", w.trainable)
            role = getattr(backing, "_tfdist_role", None)
            expected = self.extended.plan(
                w.path, by_path[w.path].shape, trainable=created_trainable, role=role,
                attribute_path=attribute_paths.get(id(w)),
            )[0]
            if expected != by_path[w.path].spec:
                misplaced.append((w.path, expected, by_path[w.path].spec))
        report = PlacementReport(
            mesh=dict(axes),
            variables=tuple(rows),
            bytes_per_device={d: per_device for d in self.mesh.local_devices()},
            unmatched_rules=tuple(self.extended.unmatched_rules(model)),
            misplaced=tuple(misplaced),
        )
        if print_fn is not None:
            print_fn(report.table())
        if report.problems():
            warnings.warn("ModelParallelStrategy placement: " + "; ".join(report.problems()), stacklevel=2)
        return report

    def __repr__(self):
        processes = f", processes={self._cluster.num_workers}" if self._cluster else ""
        return (
            f"ModelParallelStrategy(mesh={self.mesh_shape!r}, rules={self.rules!r}, batch_axis={self.batch_axis!r}"
            f"{processes})"
        )
