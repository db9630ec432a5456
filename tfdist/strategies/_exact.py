"""The data-parallel runtime: replicas that together compute the single-device result.

`ExactReplicas` is the `TfdistExtended` of DataParallelStrategy,
MultiWorkerStrategy and PipelineStrategy (mixed into TensorFlow's
MirroredExtended / CollectiveAllReduceExtended). Plain Keras 3 under
MirroredStrategy is wrong or broken in ways this runtime corrects, each with a
hook in `tfdist._compat` that hands the decision here:

1. Loss weighting. Keras scales each replica's mean loss by 1 / replicas, so a
   global batch that splits unevenly weights a replica holding 1 example like
   one holding 3. `_call_for_each_replica` gives each replica its share of the
   global batch (n_replica / n_global, over all workers), which the loss
   scaling hook reads (`_tfdist_replica_share`): the summed gradient is exactly
   the single-device gradient. A replica left without examples (global batch
   smaller than the replica count) runs on a padding copy of one example with
   share 0, its metric updates undone and its outputs dropped (`run_weighted`).
2. Gradient clipping and accumulation. Keras clips each replica's gradient
   before the all-reduce, and its accumulation step calls `merge_call` inside a
   `cond` branch. `_tfdist_apply_gradients` all-reduces first (in the
   strategy's `gradient_dtype`), then runs Keras' own `apply` once in
   cross-replica context (`_use_merge_call` answers False meanwhile), so
   clipping, accumulation, weight decay and EMA behave as on one device.
3. The symbolic build from the element spec and `steps_per_execution > 1`
   traced inline (`_tfdist_inline_steps`) are the trainer hooks' part.
4. XLA. Keras compiles `strategy.run` as one XLA cluster, which cannot reach
   the other replicas' variables ("Trying to access resource ... located in
   device CPU:1 from device CPU:0"). For a model compiled with
   `jit_compile=True` the trainer hook turns that off and each replica's
   train/test step is compiled on its own device (`_tfdist_compiled_step`):
   the forward pass, loss, gradients and metric updates in one XLA cluster per
   replica; the optimizer's `apply` met inside is recorded
   (`_tfdist_defer_apply`) and runs after it in the same replica, so the
   all-reduce and the update are the ones of the uncompiled step.
5. Batch statistics. BatchNormalization and KerasHub's MoE load-balancing losses
   compute from the batch: per replica (Keras' behaviour, `batch_statistics=
   "replica"`, said once at `fit` by a warning naming the layers) or over the
   global batch (`"global"`: `_tfdist_sum_batch_statistics` all-reduces their
   sums, each replica weighted by its real examples; the hooks are in
   `tfdist._compat.batch_statistics`), which equals one device.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref

import tensorflow as tf
from tensorflow.python.autograph.core import ag_ctx
from tensorflow.python.autograph.impl import api as autograph
from tensorflow.python.distribute import values as tf_values
from tensorflow.python.distribute import values as values_lib
from tensorflow.python.util import nest

from tfdist import _validate
from tfdist._compat import batch_statistics
from tfdist._compat import trainer as keras_trainer
from tfdist.strategies import _extended

GRADIENT_DTYPES = (None, "bfloat16", "float16")
BATCH_STATISTICS = ("replica", "global")
# Models already warned about their batch-dependent layers (one warning per model).
_warned_models = weakref.WeakSet()


def wire_dtype(gradient_dtype: str | None) -> tf.DType | None:
    """Checks a strategy's `gradient_dtype` and returns the dtype gradients are all-reduced in.

    Returns None for None (each gradient in its own dtype).

    Raises:
        ValueError: if `gradient_dtype` is not one of `GRADIENT_DTYPES`.

    Example:

    >>> wire_dtype("bfloat16").name
    'bfloat16'
    """
    _validate.one_of("gradient_dtype", gradient_dtype, GRADIENT_DTYPES)
    return None if gradient_dtype is None else tf.as_dtype(gradient_dtype)


# This replica's share of the global batch while its step function runs. MirroredStrategy runs
# each replica's function in its own thread, so this is thread-local.
_replica_state = threading.local()


def current_example_share():
    """This replica's examples / the global batch's examples while a tfdist step runs, else None."""
    return getattr(_replica_state, "share", None)


@contextlib.contextmanager
def _example_share(share):
    previous = current_example_share()
    _replica_state.share = share
    try:
        yield
    finally:
        _replica_state.share = previous


def run_weighted(fn, share, padded, model, *args, **kwargs):
    """Runs a Keras step on part of the global batch: its loss weighted by `share` (its examples /
    the global batch's), and, when `padded` (a filler row standing in for no example), its metric
    updates undone and its batch-sized outputs dropped. `padded=False` skips both."""
    with _example_share(share):
        if padded is False:
            return fn(*args, **kwargs)
        with _undo_metric_updates_if(padded, model):
            outputs = fn(*args, **kwargs)
    return nest.map_structure(lambda t: _drop_padding(t, padded), outputs)


@contextlib.contextmanager
def _undo_metric_updates_if(padded, model):
    """Restores this replica's (local, sync-on-read) metric state afterwards when `padded`."""
    if model is None:
        yield
        return
    variables = list(model.metrics_variables)
    saved = [tf.identity(v.value) for v in variables]
    yield

    def restore():
        for v, value in zip(variables, saved):
            v.assign(value)
        return tf.constant(True)

    tf.cond(padded, restore, lambda: tf.constant(False))


def _drop_padding(value, padded):
    """Drops the rows of a padded replica's batch-sized output (its static batch size is unknown)."""
    if not isinstance(value, tf.Tensor) or not value.shape.rank or value.shape[0] is not None:
        return value
    return tf.cond(padded, lambda: value[:0], lambda: value)


def _as_mirrored(value):
    if isinstance(value, tf_values.PerReplica):
        return tf_values.Mirrored(value.values)
    return value


class ExactReplicas(_extended.TfdistExtended):
    """Mixin for a mirrored `StrategyExtended` whose replicas compute the single-device result.

    Args (keyword, before the extended's own):
        gradient_dtype: None, "bfloat16" or "float16": the dtype wider float
            gradients are all-reduced in (cast back afterwards).
    """

    _tfdist_inline_steps = True
    # Whether a Keras step of a `jit_compile=True` model is compiled per replica (PipelineStrategy
    # compiles per stage instead: a replica's step spans devices).
    _tfdist_compiles_replicas = True
    # One of BATCH_STATISTICS: the part of the batch BatchNormalization and MoE balancing compute from
    # (set by the strategy's constructor).
    _tfdist_batch_statistics = "replica"

    def __init__(self, *args, gradient_dtype: str | None = None, **kwargs):
        self._tfdist_gradient_dtype = wire_dtype(gradient_dtype)
        super().__init__(*args, **kwargs)

    def _tfdist_flags(self):
        """Per-thread step state (created on first use, so the extended copies as TensorFlow's does)."""
        flags = self.__dict__.get("_tfdist_thread_flags")
        if flags is None:
            flags = self.__dict__["_tfdist_thread_flags"] = threading.local()
        return flags

    # ---------------------------------------------------------------- what the hooks ask
    def _tfdist_replica_share(self):
        return current_example_share()

    def _tfdist_apply_gradients(self, grads, apply, *, accumulates=False):
        grads = self._tfdist_accumulate_microbatch(list(grads))
        if grads is None:
            return None
        if accumulates and self._num_replicas_in_sync > 1:
            # Each replica adds its own gradient to its accumulators (tf.distribute's contract: the
            # accumulated gradients are summed over replicas when applied), and all-reduces only on the
            # update step, before Keras clips (`_tfdist_reduce_for_update`).
            with self._tfdist_replica_apply():
                return apply(grads)
        if self._num_replicas_in_sync > 1:
            grads = self._tfdist_all_reduce_present(grads)
        # Even with one replica: Keras' accumulation step would call merge_call inside a cond.

        def apply_once(unused_strategy, reduced_grads):
            reduced_grads = [None if g is None else _as_mirrored(g) for g in reduced_grads]
            with self._tfdist_cross_replica_apply():
                return apply(reduced_grads)

        return tf.distribute.get_replica_context().merge_call(apply_once, args=(grads,))

    def _tfdist_all_reduce_gradients(self, grads):
        """All-reduces (sums) the per-replica gradients; runs in replica context.

        With a `gradient_dtype`, wider float gradients travel in it and are cast back.
        """
        if not grads:
            return []
        wire = self._tfdist_gradient_dtype
        if wire is not None:
            sent = [tf.cast(g, wire) if g.dtype.is_floating and g.dtype.size > wire.size else g for g in grads]
        else:
            sent = grads
        reduced = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, sent)
        return [r if r.dtype == g.dtype else tf.cast(r, g.dtype) for r, g in zip(reduced, grads)]

    def _tfdist_build_eagerly(self, build, owner=None):
        """Runs `build` once per `owner`, outside the traced function, in cross-replica context under this strategy.

        A MirroredVariable created inside a traced step initializes its other replicas from the primary
        inside the graph, which fails at run time; created eagerly it is like any variable built up front.
        The replicas' builds meet in one merge call: a layer every replica shares is built once, and a
        layer each replica creates in its own call (KerasHub's `Add` inside a block's `call`) each.
        """
        strategy = self._container_strategy()

        def eagerly(build):
            with tf.init_scope(), strategy.scope():
                return build()

        context = tf.distribute.get_replica_context()
        if context is None:  # cross-replica context: inside `strategy.scope()`, outside `strategy.run`
            return eagerly(build)

        def merged(unused_strategy, owners, builds):
            builds = builds.values if isinstance(builds, tf.distribute.DistributedValues) else (builds,)
            if isinstance(owners, tf.distribute.DistributedValues):
                owners = owners.values
            else:
                owners = (owners,) * len(builds)
            if owners[0] is None or all(o is owners[0] for o in owners):
                return eagerly(builds[0])
            done = {}
            for o, b in zip(owners, builds, strict=True):
                if id(o) not in done:
                    done[id(o)] = eagerly(b)
            return values_lib.PerReplica(tuple(done[id(o)] for o in owners))

        return context.merge_call(merged, args=(owner, build))

    # ---------------------------------------------------------------- batch statistics
    def _tfdist_global_batch_statistics(self) -> bool:
        return self._tfdist_batch_statistics == "global" and self._num_replicas_in_sync > 1

    def _tfdist_global_batch_losses(self) -> bool:
        return self._tfdist_global_batch_statistics()

    def _tfdist_sum_batch_statistics(self, values):
        """All-reduces (sums) batch statistics over the replicas; a padded replica (no example) adds zeros."""
        if self._num_replicas_in_sync < 2:
            return list(values)
        share = current_example_share()
        if share is not None:
            live = share > 0
            values = [v * tf.cast(live, v.dtype) for v in values]
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, list(values))

    def _tfdist_batch_part(self) -> str | None:
        """What a batch-dependent layer sees of the global batch in a step, when not all of it (else None)."""
        if self._num_replicas_in_sync < 2:
            return None
        return f"each of the {self._num_replicas_in_sync} replicas' part of the global batch"

    def _tfdist_partial_batch_layers(self, model) -> list[str]:
        """The layers of `model` computing from the batch that see only `_tfdist_batch_part()` of it."""
        if self._tfdist_batch_part() is None:
            return []
        return batch_statistics.batch_dependent_layers(
            model, norms=not self._tfdist_global_batch_statistics(), losses=not self._tfdist_global_batch_losses()
        )

    def _tfdist_global_batch_layers(self, model) -> list[str]:
        """The layers of `model` computing from the global batch here (their all-reduces run in the step)."""
        return batch_statistics.batch_dependent_layers(
            model, norms=self._tfdist_global_batch_statistics(), losses=self._tfdist_global_batch_losses()
        )

    def _tfdist_batch_statistics_advice(self) -> str:
        """How to get the one-device result: the strategy's option."""
        name = type(self._container_strategy()).__name__
        return (
            f"For the global batch's statistics, as on one device, build the strategy with "
            f"{name}(batch_statistics='global') (small all-reduces per such layer and step)."
        )

    def _tfdist_warn_batch_dependent(self, model) -> None:
        """Warns once per model when layers of `model` compute from a part of the batch only."""
        if model in _warned_models:
            return
        _warned_models.add(model)
        if self._tfdist_global_batch_losses():
            batch_statistics.install_moe_hooks()
        layers = self._tfdist_partial_batch_layers(model)
        if not layers:
            return
        warnings.warn(
            f"{type(self._container_strategy()).__name__}: {len(layers)} layer(s) of model {model.name!r} compute "
            f"from the batch in training and see {self._tfdist_batch_part()}, not the whole batch as on one device, "
            f"so training differs from one device: {', '.join(layers)}. {self._tfdist_batch_statistics_advice()}",
            UserWarning,
            stacklevel=2,
        )

    # ---------------------------------------------------------------- XLA
    def _tfdist_jit_compile(self, model) -> None:
        # Supported: `_call_for_each_replica` compiles each replica's step, but not around an all-reduce.
        layers = self._tfdist_global_batch_layers(model)
        if layers:
            raise ValueError(
                f"jit_compile=True under {type(self._container_strategy()).__name__}(batch_statistics='global'): "
                f"model {model.name!r} has layers computing from the global batch ({', '.join(layers)}), whose "
                "all-reduce cannot run inside an XLA-compiled step or layer (XLA on CPU/GPU does not compile "
                "TensorFlow's collectives). Compile the model with jit_compile=False, or use "
                "batch_statistics='replica' (each replica's own statistics)."
            )

    def _tfdist_auto_jit(self, model) -> bool:
        # Keras' rule for one device (XLA on accelerators, if every layer supports it), which it turns
        # off under any tf.distribute strategy because of the one-cluster compile this runtime avoids.
        from keras.src.trainers import trainer as keras_trainer_lib

        on_accelerators = all(tf.DeviceSpec.from_string(d).device_type == "GPU" for d in self.worker_devices)
        if self._tfdist_global_batch_layers(model):
            return False  # their all-reduces cannot run inside one device's XLA cluster
        return on_accelerators and keras_trainer_lib.model_supports_jit(model)

    def _tfdist_defer_apply(self, apply, grads) -> bool:
        deferred = getattr(self._tfdist_flags(), "deferred", None)
        if deferred is None:
            return False
        deferred.append((apply, list(grads)))
        return True

    def _tfdist_compiled_step(self, fn):
        """`fn` (one replica's Keras step) compiled with XLA on the replica's device, applies after it.

        Each replica thread traces its own `tf.function(jit_compile=True)` (its variables live on its
        device). The gradients of every `optimizer.apply` met while tracing are outputs of the compiled
        function; the recorded applies then run on them, in order, outside it.
        """

        @autograph.do_not_convert
        @functools.wraps(fn)  # still the model's step to `keras_trainer.keras_step`
        def compiled_step(*args, **kwargs):
            flags = self._tfdist_flags()
            recorded = []

            def body(*a, **kw):
                flags.deferred = []
                try:
                    outputs = fn(*a, **kw)
                    applies = flags.deferred
                except RuntimeError as e:
                    if "`merge_call` called while defining a new graph" not in str(e):
                        raise
                    raise RuntimeError(
                        f"jit_compile=True under {type(self._container_strategy()).__name__}: each replica's "
                        "step is compiled with XLA on its own device, and this step has a cross-replica "
                        "operation other than the optimizer's apply (a synchronized BatchNormalization, global "
                        "batch statistics (batch_statistics='global'), or "
                        "`tf.distribute.get_replica_context().all_reduce` / `merge_call` in a layer or "
                        "`train_step`), which one device's XLA cluster cannot hold. Compile the model with "
                        "jit_compile=False, or move that operation out of the step."
                    ) from e
                finally:
                    flags.deferred = None
                recorded[:] = applies
                grads = [[g for g in grads if g is not None] for _, grads in applies]
                return outputs, grads

            outputs, present = tf.function(body, jit_compile=True, autograph=False)(*args, **kwargs)
            for (apply, traced), grads in zip(recorded, present):
                grads = iter(grads)
                apply([None if g is None else next(grads) for g in traced])
            return outputs

        return compiled_step

    # ---------------------------------------------------------------- one apply per step
    @contextlib.contextmanager
    def _tfdist_cross_replica_apply(self):
        flags = self._tfdist_flags()
        flags.applying = True
        try:
            yield
        finally:
            flags.applying = False

    @contextlib.contextmanager
    def _tfdist_replica_apply(self):
        """Keras' apply run in each replica without merge_call; its update step all-reduces once."""
        flags = self._tfdist_flags()
        flags.local, flags.reduced = True, False
        try:
            with self._tfdist_cross_replica_apply():
                yield
        finally:
            flags.local = flags.reduced = False

    def _tfdist_reduce_for_update(self, grads):
        """The gradients Keras is about to clip and apply: summed over replicas when accumulated locally."""
        flags = self._tfdist_flags()
        if not getattr(flags, "local", False) or flags.reduced:
            return grads
        flags.reduced = True
        return self._tfdist_all_reduce_present(grads)

    def _tfdist_all_reduce_present(self, grads):
        """`grads` with each gradient that is not None all-reduced (summed over replicas), as a new list."""
        grads = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        for i, g in zip(present, self._tfdist_all_reduce_gradients([grads[i] for i in present])):
            grads[i] = g
        return grads

    def _tfdist_gradients_reduced(self) -> bool:
        """Whether this replica's gradients were already all-reduced for the running apply."""
        return getattr(self._tfdist_flags(), "reduced", False)

    def _use_merge_call(self):
        if getattr(self._tfdist_flags(), "applying", False):
            return False
        return super()._use_merge_call()

    # ---------------------------------------------------------------- replicas
    def _call_for_each_replica(self, fn, args, kwargs):
        model, kind = keras_trainer.keras_step(fn)
        if model is not None and kind == "train":
            self._tfdist_warn_batch_dependent(model)
        if self._tfdist_compiles_replicas:
            if model is not None and kind in ("train", "test") and model.jit_compile:
                fn = self._tfdist_compiled_step(fn)
        prepared = self._tfdist_prepare_replicas(fn, args, kwargs or {})
        if prepared is None:
            return super()._call_for_each_replica(fn, args, kwargs)
        args, shares, padded, model = prepared
        fn = autograph.tf_convert(fn, ag_ctx.control_status_ctx(), convert_by_default=False)

        @autograph.do_not_convert
        def weighted(replica_share, replica_padded, *a, **kw):
            return run_weighted(fn, replica_share, replica_padded, model, *a, **kw)

        return super()._call_for_each_replica(weighted, (shares, padded) + tuple(args), kwargs)

    def _tfdist_prepare_replicas(self, fn, args, kwargs):
        """Each replica's share of the global batch; empty replicas padded for Keras steps.

        A global batch smaller than the number of replicas leaves some replicas
        without examples, and several CPU kernels (oneDNN convolutions) fail on
        an empty batch. For Keras' train/test/predict steps such a replica runs
        on one filler row (replica 0's first example, or zeros on a worker with
        no example at all) with loss share 0, its metric updates are undone and
        its outputs dropped, so the step equals one device's.
        """
        batched = [
            leaf
            for leaf in nest.flatten((args, kwargs))
            if isinstance(leaf, tf_values.PerReplica)
            and all(isinstance(p, tf.Tensor) and p.shape.rank for p in leaf.values)
        ]
        # One replica in sync needs no weighting; a multi-worker replica may be alone on its worker.
        if not batched or self._num_replicas_in_sync < 2:
            return None
        devices = self.worker_devices
        counts = []
        for device, part in zip(devices, batched[0].values):
            with tf.device(device):
                counts.append(tf.shape(part)[0])
        model = keras_trainer.keras_step(fn)[0] if not kwargs and len(args) == 1 else None
        if model is not None:
            args = (nest.map_structure(lambda leaf: self._tfdist_pad(leaf, counts), args[0]),)
        total = self._tfdist_global_count(tf.cast(tf.add_n(counts), tf.float32))
        shares, padded = [], []
        for device, count in zip(devices, counts):
            with tf.device(device):
                shares.append(tf.math.divide_no_nan(tf.cast(count, tf.float32), total))
                padded.append(tf.logical_and(model is not None, tf.equal(count, 0)))
        return args, tf_values.PerReplica(shares), tf_values.PerReplica(padded), model

    def _tfdist_pad(self, leaf, counts):
        """Gives each empty local replica of a batched PerReplica leaf one filler row.

        The filler is replica 0's first row when it has one (real data), else a
        row of zeros (a worker whose replicas all got no example).
        """
        if not isinstance(leaf, tf_values.PerReplica) or not leaf.values[0].shape.rank:
            return leaf
        devices = self.worker_devices
        first = leaf.values[0]
        with tf.device(devices[0]):
            zeros = tf.zeros(tf.concat([[1], tf.shape(first)[1:]], axis=0), dtype=first.dtype)
            filler = tf.cond(counts[0] > 0, lambda: first[:1], lambda: zeros)
        parts = []
        for device, count, part in zip(devices, counts, leaf.values):
            with tf.device(device):
                parts.append(tf.cond(count > 0, lambda p=part: p, lambda: filler))
        return tf_values.PerReplica(parts)
