"""Pipeline parallelism: consecutive layers on different devices, micro-batches flowing through them."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Mapping

import tensorflow as tf
from tensorflow.python.autograph.core import ag_ctx
from tensorflow.python.autograph.impl import api as autograph
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.distribute import values_util
from tensorflow.python.util import nest

from tfdist import _validate
from tfdist import devices as devices_lib
from tfdist.placement import pipeline as pipeline_lib
from tfdist.strategies import _keras_compat
from tfdist.strategies import data_parallel
from tfdist.strategies import topology as topology_lib


class _StageDevices:
    """Stands for a variable in `colocate_with`: MirroredExtended creates copies on its `_devices`."""

    def __init__(self, devices):
        self._devices = tuple(devices)


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        # Stay sparse: optimizers update only the rows a sparse gradient touches (Keras' Adam does),
        # so a densified sum would train differently from one device's whole-batch gradient.
        return tf.IndexedSlices(
            tf.concat([a.values, b.values], axis=0), tf.concat([a.indices, b.indices], axis=0), a.dense_shape
        )
    if isinstance(a, tf.IndexedSlices) or isinstance(b, tf.IndexedSlices):
        return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)
    return a + b


def _var_devices(variable) -> tuple:
    values = getattr(variable, "values", None)
    return tuple(v.device for v in values) if values is not None else (variable.device,)


class _PipelineExtended(data_parallel._DataParallelExtended):
    """Data-parallel extended whose replicas each run a pipeline of stages over micro-batches.

    Replica r's stage s runs on `grid[s][r]`; the replicas' stage-0 devices are
    the strategy's worker devices (they receive the input batches).
    """

    def __init__(self, container_strategy, *, grid, microbatches, placement, cost, communication):
        super().__init__(container_strategy, devices=[d for d in grid[0]], communication=communication)
        self._grid = grid
        self._microbatches = microbatches
        self._placement = placement
        self._rules = None if placement == "auto" else pipeline_lib.compile_placement(placement, len(grid))
        self._cost = cost
        self._plan = None
        self._model_id = None
        self._layer_devices = None  # per replica: {id(layer): device}
        self._placing = threading.local()
        # id(optimizer slot tf.Variable) -> weak reference to the variable it was colocated with
        self._colocated = {}

    # ---------------------------------------------------------------- variables
    def _stage_of_path(self, path: str | None):
        if self._rules is None or not path:
            return None
        for part in path.split("/")[:-1]:
            stages = {stage for _, compiled, stage in self._rules if compiled.fullmatch(part)}
            if len(stages) == 1:
                return stages.pop()
        return None

    def _create_variable(self, next_creator, **kwargs):
        colocate_with = kwargs.get("colocate_with")
        if colocate_with is None:
            devices = getattr(self._placing, "devices", None)
            if devices is None:
                stage = self._stage_of_path(_keras_compat.variable_path(kwargs.get("name") or ""))
                devices = None if stage is None else self._grid[stage]
            if devices is not None:
                kwargs["colocate_with"] = _StageDevices(devices)
        variable = super()._create_variable(next_creator, **kwargs)
        if colocate_with is not None and not isinstance(colocate_with, _StageDevices):
            self._colocated[id(variable)] = weakref.ref(colocate_with)
        return variable

    def _recreate(self, keras_variable, devices):
        """Moves a Keras variable's value to a new variable with copies on `devices`."""
        old = keras_variable.value
        with self._container_strategy().scope(), _keras_compat.thread_local_scope(self._placing, "devices", devices):
            new = tf.Variable(
                initial_value=tf.identity(old.read_value()),
                trainable=old.trainable,
                name=old.name.split(":")[0],
                dtype=old.dtype,
                aggregation=old.aggregation,
                synchronization=old.synchronization,
            )
        keras_variable._initialize(new)
        return old, new

    def _place_weights(self, model, plan, units):
        """Puts every weight of each stage's layers (and their optimizer slots) on the stage's devices."""
        moved = {}  # id(old tf.Variable) -> (old, new); holds the old ones until their slots follow
        for layer in units:
            devices = tuple(self._grid[plan.stage_of(layer.name)])
            for weight in layer.weights:
                if _var_devices(weight.value) != devices and id(weight.value) not in moved:
                    old, new = self._recreate(weight, devices)
                    moved[id(old)] = (old, new)
        optimizer = getattr(model, "optimizer", None)
        if moved and optimizer is not None and getattr(optimizer, "built", False):
            for slot in optimizer.variables:
                owner = self._colocated.get(id(slot.value), lambda: None)()
                if owner is not None and id(owner) in moved:
                    new_owner = moved[id(owner)][1]
                    _, new = self._recreate(slot, _var_devices(new_owner))
                    self._colocated[id(new)] = weakref.ref(new_owner)
            _keras_compat.rekey_optimizer(optimizer)
        moved.clear()
        self._colocated = {k: ref for k, ref in self._colocated.items() if ref() is not None}

    # ---------------------------------------------------------------- plan
    def _prepare(self, model, batch_size):
        if self._model_id == id(model):
            return
        units = pipeline_lib.stage_units(model)
        stages = len(self._grid)
        if self._rules is None:
            plan = pipeline_lib.balance(model, stages, self._cost, batch_size=batch_size)
        else:
            plan = pipeline_lib.plan_explicit(model, self._placement, stages)
        with tf.init_scope():
            self._place_weights(model, plan, units)
        self._layer_devices = [
            {id(layer): self._grid[plan.stage_of(layer.name)][r] for layer in units}
            for r in range(len(self._grid[0]))
        ]
        self._plan = plan
        self._model_id = id(model)

    def _microbatch_size_hint(self, args) -> int:
        """A replica's micro-batch size from the step's static input shape (8 when unknown)."""
        for leaf in nest.flatten(args):
            shape = getattr(getattr(leaf, "values", (leaf,))[0], "shape", None)
            if shape is not None and shape.rank and shape[0] is not None:
                return max(1, shape[0] // self._microbatches)
        return 8

    def _tfdist_check_global_batch(self, batch_size):
        """Raises unless each replica's share of a `batch_size` global batch splits into equal micro-batches."""
        parts = self._microbatches * len(self._grid[0])
        if batch_size is not None and batch_size % parts:
            divisors = [m for m in range(1, batch_size + 1) if batch_size % (m * len(self._grid[0])) == 0]
            raise ValueError(
                f"microbatches={self._microbatches} does not divide the global batch of {batch_size} examples "
                f"over {len(self._grid[0])} replica(s) ({batch_size} / {len(self._grid[0])} / "
                f"{self._microbatches} is not whole). Use a global batch that is a multiple of {parts}, or "
                f"microbatches in {divisors}."
            )

    # ---------------------------------------------------------------- steps
    def _tfdist_accumulate_microbatch(self, grads):
        """Sums gradients over the step's micro-batches: None until the last, then the sum."""
        state = getattr(self._tfdist_flags(), "microbatch", None)
        if state is None or state["applied"]:  # not micro-batching, or an optimizer inside one
            return grads
        if state["sum"] is not None:
            grads = [_add(a, g) for a, g in zip(state["sum"], grads)]
        if not state["last"]:
            state["sum"] = grads
            return None
        state["sum"], state["applied"] = None, True
        return grads

    def _call_for_each_replica(self, fn, args, kwargs):
        model, kind = _keras_compat.keras_step(fn)
        if model is not None:
            self._prepare(model, self._microbatch_size_hint(args))
        if self._layer_devices is None:
            return super()._call_for_each_replica(fn, args, kwargs)
        fn = autograph.tf_convert(fn, ag_ctx.control_status_ctx(), convert_by_default=False)

        @functools.wraps(fn)
        def staged(*a, **kw):
            r = values_util.get_current_replica_id_as_int() or 0
            with _keras_compat.stage_devices(self._layer_devices[r]):
                if model is None or self._microbatches == 1 or not a or kw:
                    with tf.device(self._grid[-1][r]):
                        return fn(*a, **kw)
                return self._run_microbatches(fn, model, kind, r, a[0])

        return super()._call_for_each_replica(autograph.do_not_convert(staged), args, kwargs)

    def _run_microbatches(self, fn, model, kind, r, data):
        m_count = self._microbatches
        batched = [t for t in nest.flatten(data) if isinstance(t, tf.Tensor) and t.shape.rank]
        if not batched:
            raise ValueError("PipelineStrategy: a Keras step received no batched tensor to split into micro-batches.")
        static = batched[0].shape[0]
        if static is not None and static % m_count:
            raise ValueError(
                f"microbatches={m_count} does not divide this replica's batch of {static} examples. Use a "
                f"batch that is a multiple of {m_count * len(self._grid[0])} (microbatches x replicas)."
            )
        with tf.device(self._grid[0][r]):
            n = tf.shape(batched[0])[0]
            parts = [self._microbatch(data, m, n, static) for m in range(m_count)]
        base_share = _keras_compat.current_example_share()
        flags = self._tfdist_flags()
        outputs = []
        with tf.device(self._grid[-1][r]):
            flags.microbatch = {"sum": None, "last": False, "applied": False}
            try:
                for m, (part, count, padded) in enumerate(parts):
                    share = tf.math.divide_no_nan(tf.cast(count, tf.float32), tf.cast(n, tf.float32))
                    if base_share is not None:
                        share = share * tf.cast(base_share, tf.float32)
                    flags.microbatch["last"] = m == m_count - 1
                    outputs.append(_keras_compat.run_weighted(fn, share, padded, model, part))
            finally:
                flags.microbatch = None
        if kind == "predict":
            return nest.map_structure(lambda *o: tf.concat(o, axis=0), *outputs)
        return outputs[-1]

    def _microbatch(self, data, m, n, static):
        """Micro-batch `m` of `data`: (its structure, its example count, whether it is a filler)."""
        m_count = self._microbatches
        if static is not None:
            size = static // m_count
            part = nest.map_structure(lambda t: t[m * size : (m + 1) * size] if _batched(t) else t, data)
            return part, size, False
        base, extra = n // m_count, n % m_count
        start = m * base + tf.minimum(m, extra)
        size = base + tf.cast(m < extra, n.dtype)

        def take(t):
            if not _batched(t):
                return t
            return tf.cond(size > 0, lambda: t[start : start + size], lambda: t[:1])

        return nest.map_structure(take, data), size, tf.equal(size, 0)


def _batched(t) -> bool:
    return isinstance(t, tf.Tensor) and bool(t.shape.rank)


class PipelineStrategy(tf.distribute.MirroredStrategy):
    """Pipeline parallelism: each stage of consecutive layers on its own device, micro-batched.

    The model's top-level layers are split into `stages` contiguous stages
    (by explicit rules, or by a balancer). A stage's weights, their optimizer
    slots and its forward and backward computation live on the stage's device;
    activations cross from stage to stage inside one traced step, where
    TensorFlow inserts the transfers. Each global batch is split into
    `microbatches` micro-batches that flow through the stages, so stage 1 works
    on micro-batch 1 while stage 2 works on micro-batch 0; the gradients of all
    micro-batches are summed and applied once, so a step equals one device's
    step on the whole batch.

    Schedule: GPipe. All micro-batches are in one dataflow graph; each op runs
    as soon as its inputs are ready, so forward passes overlap across stages
    and a micro-batch's backward pass starts when its loss is ready. Every
    micro-batch's activations may be alive until its backward pass (GPipe's
    memory profile); 1F1B would cap them at `stages` micro-batches, but needs
    an imposed op order that TensorFlow's executor does not offer without
    serializing the stages, so it is not implemented.

    With `replicas > 1` the pipeline is replicated (hybrid parallelism): replica
    r runs its own copy of the stages on `devices[r * stages:(r + 1) * stages]`,
    sees `1 / replicas` of each global batch, and the stages' gradients are
    all-reduced across replicas as in `DataParallelStrategy`.

    Works with `model.fit` / `evaluate` / `predict`, callbacks and
    `model.save` (a saved model loads on one device). The model must be a
    built Sequential or functional model (give it a `keras.Input`). With
    `placement="auto"` the weights are created on stage 0's devices and moved
    to their stages when the first step is traced; explicit rules place each
    weight where it belongs as it is created.

    Args:
        stages: the number of pipeline stages (devices per replica).
        microbatches: micro-batches per replica batch; a global batch must be
            a multiple of `microbatches * replicas` (a smaller final batch is
            split as evenly as it goes, exactly).
        placement: "auto" (the balancer splits the layers into `stages` runs
            minimizing the largest stage cost) or a dict mapping a regex that
            fully matches top-level layer names to a stage, e.g.
            `{"dense_[0-2]": 0, "dense_[3-5]": 1}`. Layers without weights
            that match no rule join the latest stage among their inputs.
        cost: what "auto" balances: "params", "flops" or "time" (see
            `tfdist.placement.pipeline.balance`).
        replicas: copies of the pipeline trained data-parallel.
        devices: `stages * replicas` device names, replica-major; default: the
            first `stages * replicas` GPUs, else logical CPUs.
        communication: the all-reduce across replicas, as in
            `DataParallelStrategy`.

    Raises:
        ValueError: invalid arguments (each message names the argument and
            the valid choices), too few devices. Errors about the model
            (more stages than layers, rules matching nothing or leaving a
            layer without a stage, stages against the data flow, weights
            shared across stages) are raised when the first step is traced.

    Example:

    >>> import keras, numpy as np, tfdist
    >>> strategy = tfdist.PipelineStrategy(stages=1, microbatches=2, devices=["CPU:0"])
    >>> with strategy.scope():
    ...     model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    ...     model.compile(optimizer="sgd", loss="mse")
    >>> history = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0)
    >>> strategy.plan.layers
    (('dense', 'dense_1'),)
    """

    def __init__(
        self,
        *,
        stages: int,
        microbatches: int,
        placement: str | Mapping[str, int] = "auto",
        cost: str = "params",
        replicas: int = 1,
        devices: list[str] | None = None,
        communication: str = "auto",
    ):
        stages = _validate.integer("stages", stages)
        microbatches = _validate.integer("microbatches", microbatches)
        replicas = _validate.integer("replicas", replicas)
        if cost not in pipeline_lib.COSTS:
            raise ValueError(
                f"Invalid value for argument `cost`. Received: cost={cost!r}. Expected one of {pipeline_lib.COSTS}."
            )
        if isinstance(placement, str) and placement != "auto" or not isinstance(placement, (str, Mapping)):
            raise ValueError(
                f"Invalid value for argument `placement`. Received: placement={placement!r}. Expected 'auto' or "
                "a dict mapping a layer-name regex to a stage, e.g. {'dense_[0-2]': 0, 'dense_[3-5]': 1}."
            )
        if not isinstance(placement, str):
            pipeline_lib.compile_placement(placement, stages)
        needed = stages * replicas
        if devices is None:
            available = devices_lib.default_devices()
            if len(available) < needed:
                raise ValueError(
                    f"stages={stages} x replicas={replicas} needs {needed} devices, but only {len(available)} "
                    f"are available: {available}. Use fewer stages, or more devices (tfdist.simulate_devices)."
                )
            devices = available[:needed]
        else:
            if isinstance(devices, str) or len(list(devices)) != needed:
                raise ValueError(
                    f"Invalid value for argument `devices`. Received: devices={devices!r}. Expected a list of "
                    f"stages x replicas = {stages} x {replicas} = {needed} device names (replica-major)."
                )
            devices = devices_lib.device_list(devices)
        data_parallel._validate_communication(communication, devices)
        _keras_compat.install_pipeline()
        grid = [[devices[r * stages + s] for r in range(replicas)] for s in range(stages)]
        self._stages, self._microbatches, self._replicas = stages, microbatches, replicas
        self._collective_key_base = next(data_parallel._KEY_BASES)
        distribute_lib.Strategy.__init__(
            self,
            _PipelineExtended(
                self,
                grid=grid,
                microbatches=microbatches,
                placement=placement,
                cost=cost,
                communication=communication,
            ),
        )

    @property
    def stages(self) -> int:
        return self._stages

    @property
    def microbatches(self) -> int:
        return self._microbatches

    @property
    def replicas(self) -> int:
        return self._replicas

    @property
    def topology(self) -> topology_lib.Topology:
        """One process; each global batch is split over the `replicas` stage rows."""
        return topology_lib.Topology(worker_index=0, num_workers=1, data_parallel_size=self._replicas)

    @property
    def stage_devices(self) -> list[list[str]]:
        """`[stage][replica]` -> device name."""
        return [list(row) for row in self.extended._grid]

    @property
    def plan(self) -> pipeline_lib.PipelinePlan | None:
        """The stage plan of the model placed by the first traced step (None before)."""
        return self.extended._plan

    def __repr__(self):
        return (
            f"PipelineStrategy(stages={self._stages}, microbatches={self._microbatches}, "
            f"replicas={self._replicas}, devices={[d for row in zip(*self.extended._grid) for d in row]!r})"
        )
