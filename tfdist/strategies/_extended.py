"""`TfdistExtended`: the one interface between tfdist's Keras hooks (`tfdist._compat`) and its strategies.

A hook acts when the running strategy's `extended` is an instance of
`TfdistExtended` (that is the only test: a user's subclass of a tfdist strategy
keeps every fix), and asks it what to do through the methods below. Their
defaults keep Keras' own behaviour; each strategy overrides what it changes.

| method / attribute                | called by the hook on                              | default               |
|-----------------------------------|----------------------------------------------------|-----------------------|
| `_tfdist_replica_share()`         | Keras' loss (un)scaling                            | None: 1 / replicas    |
| `_tfdist_apply_gradients()`       | `optimizer.apply` in replica context               | Keras' apply          |
| `_tfdist_apply_outside_replica()` | `optimizer.apply` outside any replica context      | Keras' apply          |
| `_tfdist_reduce_for_update()`     | Keras' clipping, in replica context                | the gradients as-is   |
| `_tfdist_gradients_reduced()`     | Keras' all-reduce of the update step               | False: Keras reduces  |
| `_tfdist_accumulate_microbatch`   | `LossScaleOptimizer.apply` in replica context      | the gradients as-is   |
| `_tfdist_check_global_batch()`    | the symbolic build (from the element spec)         | accept any batch      |
| `_tfdist_shard_batch()`           | `train/test/predict_on_batch` host inputs          | the inputs as-is      |
| `_tfdist_build_eagerly()`         | a layer / optimizer built inside a traced step     | build in the graph    |
| `_tfdist_inline_steps`            | Keras' multi-step function                         | False: Keras' nesting |
| `_tfdist_call_model()`            | `model(...)` of a model created under the strategy | Keras' call           |
| `_tfdist_defer_apply()`           | `optimizer.apply` inside an XLA-compiled replica   | False: apply there    |
| `_tfdist_jit_compile()`           | a step of a model compiled with `jit_compile=True` | raise: no XLA         |
| `_tfdist_auto_jit()`              | Keras' `jit_compile="auto"`                        | False                 |
| `_tfdist_step_call_context`       | every call of a Keras train/test/predict function  | None: called as is    |
| `_tfdist_distribute_tensor()`     | Keras' activation layout ("<layer>/output" key)    | the tensor as it is   |
| `_tfdist_sparse_operands()`       | Keras' elementwise op meeting an IndexedSlices     | the operands as-is    |
| `_tfdist_defer_variables`         | a Keras variable created in a layer's build        | False: at once        |
| `_tfdist_place_deferred()`        | the end of that layer's build (or a read before)   | `create()`            |
| `_tfdist_global_batch_statistics()` | BatchNormalization's moments                     | False: per replica    |
| `_tfdist_sum_batch_statistics()`  | synchronized moments, global batch statistics      | Keras' all-reduce     |
| `_tfdist_global_batch_losses()`   | KerasHub MoE balancing losses                      | False: per replica    |
| `_tfdist_batch_loss()`            | that loss, from its sums                           | over the global batch |
| `_tfdist_device_copies()`         | `tfdist.check`, reading a variable on each device  | `device_copies()`     |
| `_tfdist_place_plain_inputs()`    | plain tensors into a function of DTensor variables | (DTensor strategies)  |
| `_tfdist_plain_outputs()`         | that function's outputs                            | (DTensor strategies)  |
| `_tfdist_spmd`                    | top-k's gradient, Keras' one_hot (being traced)    | False: TF's, Keras'   |

Outside a replica context (`in_replica()` is None) is where a custom loop without
`strategy.run` calls the model and the optimizer (DTensor style), in the
strategy's scope or outside it; the strategy is then the one the model or
optimizer was created under.

Two more are the strategies' own vocabulary, used by their runtimes and tools
(benchmarks, the advisor): `_tfdist_global_count` and `_tfdist_all_reduce_gradients`.

Example:

>>> import tensorflow as tf
>>> extended_of(tf.distribute.get_strategy()) is None  # the default strategy is not tfdist's
True
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor


class TfdistExtended:
    """Mixin for the `tf.distribute.StrategyExtended` of every tfdist strategy; the hooks call only this."""

    # steps_per_execution > 1: whether Keras' per-step tf.function is traced inline into its loop
    # (MirroredStrategy fails on the nested function at run time).
    _tfdist_inline_steps = False
    # A context-manager factory each call of a Keras train/test/predict function runs in (None: none).
    _tfdist_step_call_context = None
    # jit_compile=True: whether one replica's whole step can be one XLA cluster (on one device).
    _tfdist_compiles_replicas = False
    # Whether the variables a layer's build creates wait for the end of the build (tfdist/_compat/deferred_variables).
    _tfdist_defer_variables = False
    # Whether steps run as one DTensor SPMD program (ops it expands wrongly are replaced: _compat/spmd_ops).
    _tfdist_spmd = False

    def _tfdist_replica_share(self):
        """This replica's examples / the global batch's while a step runs (a scalar tensor), else None.

        None keeps Keras' loss scaling by 1 / `num_replicas_in_sync`.
        """
        return None

    def _tfdist_global_count(self, local_count):
        """The examples of this step over all workers, given this worker's `local_count`."""
        return local_count

    def _tfdist_all_reduce_gradients(self, grads):
        """Sums per-replica gradients over all replicas (replica context); returns them in their dtypes."""
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, list(grads))

    def _tfdist_accumulate_microbatch(self, grads):
        """Within a micro-batched step: None until the last micro-batch, then the sum; else `grads`."""
        return grads

    def _tfdist_apply_gradients(self, grads, apply, *, accumulates=False):
        """Applies `grads` from replica context; `apply(grads)` is Keras' own (cross-replica safe) apply.

        `accumulates`: the optimizer has `gradient_accumulation_steps`.
        """
        del accumulates
        return apply(grads)

    def _tfdist_reduce_for_update(self, grads):
        """The gradients Keras' optimizer is about to clip and apply (replica context); default as they are."""
        return grads

    def _tfdist_gradients_reduced(self) -> bool:
        """Whether Keras' own all-reduce of the update step is to be skipped (already done)."""
        return False

    def _tfdist_apply_outside_replica(self, grads, apply):
        """Applies `grads` outside any replica context (a custom loop without `strategy.run`).

        `apply(grads)` is Keras' own apply; by default it runs as Keras would run it there.
        """
        return apply(grads)

    def _tfdist_call_model(self, model, call, args, kwargs):
        """Calls `model` (a Keras model created under this strategy) as `call(*args, **kwargs)`, Keras' own call."""
        del model
        return call(*args, **kwargs)

    def _tfdist_check_global_batch(self, batch_size) -> None:
        """Raises ValueError when `fit`'s global `batch_size` (None: unknown) cannot be used."""
        del batch_size

    def _tfdist_build_eagerly(self, build, owner=None):
        """Runs `build` (the first build of `owner`, a layer or optimizer, inside a traced step); returns its result."""
        del owner
        return build()

    def _tfdist_place_deferred(self, root, create) -> None:
        """The build of layer `root` ended (or one of its variables is read): `create()` creates its variables.

        Called only when `_tfdist_defer_variables` is true, for the variables of
        `root`'s build (its own and its sublayers') that are still uninitialized.
        """
        del root
        create()

    def _tfdist_shard_batch(self, structure):
        """Host inputs of `train_on_batch` / `test_on_batch` / `predict_on_batch`, as the step takes them."""
        return structure

    def _tfdist_defer_apply(self, apply, grads) -> bool:
        """Inside an XLA-compiled replica step: records `apply(grads)` to run after it and returns True.

        The all-reduce of an optimizer's apply cannot run inside one device's XLA cluster; a strategy
        that compiles replica steps (`_tfdist_jit_compile`) runs the recorded applies after the compiled
        part, in the same replica. False (the default): apply where it is called.
        """
        del apply, grads
        return False

    def _tfdist_jit_compile(self, model) -> None:
        """Called when a step of `model` (compiled with `jit_compile=True`) is built; raises if unsupported.

        A strategy that supports XLA compiles the steps itself; Keras' own compilation of the
        whole `strategy.run` (one XLA cluster over every device) is then turned off.
        """
        raise ValueError(
            f"{type(self._container_strategy()).__name__} does not compile steps with XLA: model "
            f"{model.name!r} was compiled with jit_compile=True. Compile it with jit_compile=False."
        )

    def _tfdist_distribute_tensor(self, tensor, layout):
        """A layer's output for which the Keras distribution's LayoutMap has the `TensorLayout` `layout`.

        Only a strategy whose tensors have layouts (DTensor) can act on it; by default the output is
        returned as it is (a layout never changes values).
        """
        del layout
        return tensor

    def _tfdist_sparse_operands(self, densify, x1, x2):
        """The operands of a Keras elementwise op (`add`, `multiply`, `divide`, ...) of which one is an IndexedSlices.

        `densify`: Keras sums the IndexedSlices into a dense tensor (against a dense operand). A strategy whose
        tensors have layouts (DTensor) lays them out so that it can run the op; by default they are returned as
        they are.
        """
        del densify
        return x1, x2

    def _tfdist_global_batch_statistics(self) -> bool:
        """Whether BatchNormalization's moments in training are the global batch's; False: each replica
        its own part's."""
        return False

    def _tfdist_sum_batch_statistics(self, values):
        """Sums per-replica batch statistics (a list of tensors: sums and counts) over the global batch.

        Called in replica context by the moments of `keras.ops.moments(..., synchronized=True)` and,
        when `_tfdist_global_batch_statistics()`, of BatchNormalization. Gradients flow back through
        the sum. Default: Keras' own all-reduce (SUM over replicas).
        """
        return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, list(values))

    def _tfdist_global_batch_losses(self) -> bool:
        """Whether loss terms computed from the batch's statistics (KerasHub's MoE load balancing) are
        the global batch's; False: each replica's (and micro-batch's) own, as Keras computes them."""
        return False

    def _tfdist_batch_loss(self, sums, loss):
        """This replica's term of a loss computed from sums over the batch, when `_tfdist_global_batch_losses()`.

        `sums`: this replica's local sums (tensors, gradients flowing back through them); `loss`: the loss as
        a function of the global sums. Default: `loss` of the sums summed over the replicas
        (`_tfdist_sum_batch_statistics`).
        """
        return loss(self._tfdist_sum_batch_statistics(sums))

    def _tfdist_auto_jit(self, model) -> bool:
        """What Keras' `jit_compile="auto"` resolves to for `model` under this strategy (Keras: False)."""
        del model
        return False


    def _tfdist_device_copies(self, value) -> list[tuple[str, tuple, np.ndarray]]:
        """Each device's copy of `value` (a variable of this strategy, eagerly): `[(device, index, array)]`.

        `index` is the tuple of slices of the whole value that the device holds (all of it for a copy).
        """
        return device_copies(value)


def device_copies(value) -> list[tuple[str, tuple, np.ndarray]]:
    """Each device's copy of a variable or tensor on the host: `[(device, index, array)]`, read eagerly.

    A mirrored value (`.values`) gives each component whole; a DTensor each
    local shard with the slices of the whole value it holds; anything else one
    whole copy. This is what every device would compute with, not a gathered
    or primary-replica read.

    Example:

    >>> [(index, array.tolist()) for _, index, array in device_copies(tf.Variable([1.0, 2.0]))]
    [((slice(None, None, None),), [1.0, 2.0])]
    """
    value = getattr(value, "value", value) if not isinstance(value, (tf.Tensor, tf.Variable)) else value
    components = getattr(value, "values", None)
    if isinstance(components, (tuple, list)):
        return [(c.device, (slice(None),) * c.shape.rank, np.asarray(c.numpy())) for c in components]
    tensor = value.read_value() if isinstance(value, tf.Variable) else tf.convert_to_tensor(value)
    if not dtensor.is_dtensor(tensor):
        return [(tensor.device, (slice(None),) * tensor.shape.rank, np.asarray(tensor.numpy()))]
    layout = dtensor.fetch_layout(tensor)
    mesh = layout.mesh
    copies = []
    for device, location, part in zip(mesh.local_devices(), mesh.local_device_locations(), dtensor.unpack(tensor)):
        index = []
        for spec, size in zip(layout.sharding_specs, part.shape):
            start = location[spec] * size if spec in location else 0
            index.append(slice(start, start + size))
        copies.append((device, tuple(index), np.asarray(part.numpy())))
    return copies


def extended_of(strategy) -> TfdistExtended | None:
    """`strategy.extended` when it is a `TfdistExtended`, else None."""
    extended = getattr(strategy, "extended", None)
    return extended if isinstance(extended, TfdistExtended) else None


def in_replica() -> TfdistExtended | None:
    """The running strategy's `TfdistExtended` while in a replica context, else None."""
    if tf.distribute.get_replica_context() is None:
        return None
    return extended_of(tf.distribute.get_strategy())
