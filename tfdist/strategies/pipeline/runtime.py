"""The pipeline runtime: each replica runs a pipeline of stages over micro-batches.

`PipelineExtended` is the data-parallel runtime (`tfdist.strategies._mirrored.MirroredExtended`,
one replica per stage-0 device) plus:

* variables: with explicit rules a variable is created on its stage's devices
  (`_create_variable`, from its Keras path); with "auto" it is created on stage
  0 and moved, with its optimizer slots, when the first step is traced
  (`_prepare` -> `_place_weights`);
* the plan: `tfdist.placement.pipeline.plan_explicit` or `balance`, once per model;
* the calls: `tfdist.placement.pipeline.stage_units`, the layer calls of the
  model's graph with nested functional models (a backbone) opened, recursively;
  calls sharing weights (a tied embedding) all run on the stage holding them;
* steps (`_call_for_each_replica`): each replica's Keras step runs with its
  layer calls on their stages' devices (`tfdist._compat.layer_call.stage_devices`,
  the one hook call) over `microbatches` micro-batches, each weighted by its
  share of the global batch (`_run_microbatches`); the optimizer hook asks
  `_tfdist_accumulate_microbatch`, which sums the micro-batch gradients and
  hands the sum to the all-reduce and Keras' apply once, at the last;
* XLA (`jit_compile=True`): a replica's step spans its stages' devices, so it
  is not one XLA cluster; each staged layer's call (and its gradient) is
  compiled on its stage's device instead (`layer_call.compiled_stages`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import tensorflow as tf
from tensorflow.python.autograph.core import ag_ctx
from tensorflow.python.autograph.impl import api as autograph
from tensorflow.python.distribute import values_util
from tensorflow.python.util import nest

from tfdist._compat import layer_call
from tfdist._compat import optimizer as keras_optimizer
from tfdist._compat import trainer as keras_trainer
from tfdist._compat import variables as keras_variables
from tfdist._compat._hook import thread_local_scope
from tfdist.placement import pipeline as pipeline_lib
from tfdist.strategies import _exact
from tfdist.strategies import _mirrored
from tfdist.strategies.pipeline import microbatches as microbatches_lib


class _StageDevices:
    """Stands for a variable in `colocate_with`: MirroredExtended creates copies on its `_devices`."""

    def __init__(self, devices):
        self._devices = tuple(devices)


def _var_devices(variable) -> tuple:
    values = getattr(variable, "values", None)
    return tuple(v.device for v in values) if values is not None else (variable.device,)


def _xla_stages(compiled: bool):
    return layer_call.compiled_stages() if compiled else contextlib.nullcontext()


class PipelineExtended(_mirrored.MirroredExtended):
    """Data-parallel extended whose replicas each run a pipeline of stages over micro-batches.

    Replica r's stage s runs on `grid[s][r]`; the replicas' stage-0 devices are
    the strategy's worker devices (they receive the input batches).

    Args:
        container_strategy: the PipelineStrategy.
        grid: `[stage][replica]` -> device name.
        microbatches: micro-batches per replica batch.
        rules: compiled explicit placement (`tfdist.placement.pipeline.StageRules`), or None for the balancer.
        cost: what the balancer balances ("params", "flops" or "time").
        communication: the all-reduce across replicas (see `tfdist.strategies._mirrored`).
    """

    _tfdist_compiles_replicas = False  # XLA per staged layer, on its stage's device

    def __init__(self, container_strategy, *, grid, microbatches, rules, cost, communication):
        super().__init__(container_strategy, devices=list(grid[0]), communication=communication)
        self._grid = grid
        self._microbatches = microbatches
        self._rules = rules
        self._cost = cost
        self._plan = None
        self._model_id = None
        self._layer_devices = None  # per replica: {Unit.key (a call's node, or its layer): device}
        self._placing = threading.local()
        # id(optimizer slot tf.Variable) -> weak reference to the variable it was colocated with
        self._colocated = {}

    # ---------------------------------------------------------------- variables
    def _create_variable(self, next_creator, **kwargs):
        colocate_with = kwargs.get("colocate_with")
        if colocate_with is None:
            devices = getattr(self._placing, "devices", None)
            if devices is None and self._rules is not None:
                stage = self._rules.stage_of_path(keras_variables.variable_path(kwargs.get("name") or ""))
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
        with self._container_strategy().scope(), thread_local_scope(self._placing, "devices", devices):
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
        """Puts every weight of each stage's calls (and their optimizer slots) on the stage's devices.

        A weight several calls use is on the one stage that runs them all (`PipelinePlan.shared`).
        """
        moved = {}  # id(old tf.Variable) -> (old, new); holds the old ones until their slots follow
        for unit in units:
            devices = tuple(self._grid[plan.stage_of(unit.name)])
            for weight in unit.layer.weights:
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
            keras_optimizer.rekey(optimizer)
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
            plan = pipeline_lib.plan_explicit(model, self._rules, stages)
        with tf.init_scope():
            self._place_weights(model, plan, units)
        self._layer_devices = [
            {unit.key: self._grid[plan.stage_of(unit.name)][r] for unit in units} for r in range(len(self._grid[0]))
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

    # ---------------------------------------------------------------- batch statistics
    def _tfdist_global_batch_statistics(self) -> bool:
        # BatchNormalization normalizes the activations a micro-batch's forward pass goes on with: global moments
        # would have to wait for the later micro-batches. With one micro-batch, across the replicas as DP does.
        return self._microbatches == 1 and super()._tfdist_global_batch_statistics()

    def _tfdist_global_batch_losses(self) -> bool:
        return self._tfdist_batch_statistics == "global" and len(self._grid[0]) * self._microbatches > 1

    def _tfdist_batch_loss(self, sums, loss):
        losses = getattr(self._tfdist_flags(), "batch_losses", None)
        if losses is None:  # one micro-batch: over the replicas, as data parallelism does
            return super()._tfdist_batch_loss(sums, loss)
        return losses.add(sums, loss)

    def _tfdist_batch_part(self) -> str | None:
        replicas = len(self._grid[0])
        if replicas * self._microbatches < 2:
            return None
        if self._microbatches == 1:
            return super()._tfdist_batch_part()
        return (
            f"one micro-batch (1/{self._microbatches} of each of the {replicas} replicas' part of the global batch; "
            "every GPipe schedule computes batch statistics per micro-batch)"
        )

    def _tfdist_batch_statistics_advice(self) -> str:
        if self._microbatches == 1:
            return super()._tfdist_batch_statistics_advice()
        return (
            "PipelineStrategy(batch_statistics='global') makes MoE load-balancing losses the global batch's; "
            "BatchNormalization's moments cannot be (a micro-batch's forward pass cannot wait for the others'): "
            "for the one-device result use microbatches=1, a per-example normalization (LayerNormalization, "
            "GroupNormalization), or DataParallelStrategy(batch_statistics='global')."
        )

    # ---------------------------------------------------------------- steps
    def _tfdist_accumulate_microbatch(self, grads):
        """Sums gradients over the step's micro-batches: None until the last, then the sum."""
        accumulator = getattr(self._tfdist_flags(), "microbatch", None)
        return grads if accumulator is None else accumulator.add(grads)

    def _call_for_each_replica(self, fn, args, kwargs):
        model, kind = keras_trainer.keras_step(fn)
        if model is not None:
            self._prepare(model, self._microbatch_size_hint(args))
        if self._layer_devices is None:
            return super()._call_for_each_replica(fn, args, kwargs)
        fn = autograph.tf_convert(fn, ag_ctx.control_status_ctx(), convert_by_default=False)

        compiled = model is not None and not model.run_eagerly and bool(model.jit_compile)

        @functools.wraps(fn)
        def staged(*a, **kw):
            r = values_util.get_current_replica_id_as_int() or 0
            with layer_call.stage_devices(self._layer_devices[r]), _xla_stages(compiled):
                if model is None or self._microbatches == 1 or not a or kw:
                    with tf.device(self._grid[-1][r]):
                        return fn(*a, **kw)
                return self._run_microbatches(fn, model, kind, r, a[0])

        return super()._call_for_each_replica(autograph.do_not_convert(staged), args, kwargs)

    def _run_microbatches(self, fn, model, kind, r, data):
        m_count = self._microbatches
        batched = microbatches_lib.batched_tensors(data)
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
            parts = [microbatches_lib.split(data, m, m_count, n, static) for m in range(m_count)]
        base_share = _exact.current_example_share()
        flags = self._tfdist_flags()
        losses = None
        if kind in ("train", "test") and self._tfdist_global_batch_losses():
            replica_share = 1.0 if base_share is None else tf.cast(base_share, tf.float32)
            variables = model.trainable_weights if kind == "train" else None
            losses = microbatches_lib.BatchLosses(replica_share, replicas=len(self._grid[0]), variables=variables)
        outputs = []
        with tf.device(self._grid[-1][r]):
            flags.microbatch = microbatches_lib.Accumulator(losses)
            flags.batch_losses = losses
            try:
                with losses.recording() if losses is not None else contextlib.nullcontext():
                    for m, (part, count, padded) in enumerate(parts):
                        share = tf.math.divide_no_nan(tf.cast(count, tf.float32), tf.cast(n, tf.float32))
                        if base_share is not None:
                            share = share * tf.cast(base_share, tf.float32)
                        flags.microbatch.last = m == m_count - 1
                        if losses is not None:
                            losses.begin(share, last=m == m_count - 1)
                        outputs.append(_exact.run_weighted(fn, share, padded, model, part))
            finally:
                flags.microbatch = flags.batch_losses = None
        if kind == "predict":
            return nest.map_structure(lambda *o: tf.concat(o, axis=0), *outputs)
        return outputs[-1]
