"""`PipelineStrategy`: the public class; its arguments are checked here and handed to the runtime."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import tensorflow as tf

from tfdist import _compat
from tfdist import _validate
from tfdist import devices as devices_lib
from tfdist.placement import pipeline as pipeline_lib
from tfdist.strategies import _exact
from tfdist.strategies import _mirrored
from tfdist.strategies import topology as topology_lib
from tfdist.strategies.pipeline.runtime import PipelineExtended


class _DropMessage(logging.Filter):
    """Drops one TensorFlow log message that is expected, and only noise, under a pipeline."""

    def __init__(self, text):
        super().__init__()
        self.text = text

    def filter(self, record):
        return self.text not in record.getMessage()


# A pipeline's gradients live on their stages' devices, so TensorFlow's batched all-reduce, which
# needs one destination device set, falls back to one all-reduce per gradient and says so.
_LOG_FILTER = _DropMessage("is not supported if destinations are different")


class PipelineStrategy(tf.distribute.MirroredStrategy):
    """Pipeline parallelism: each stage of consecutive layers on its own device, micro-batched.

    The model's layer calls are split into `stages` contiguous stages (by
    explicit rules, or by a balancer). A functional model used as a layer (a
    KerasHub backbone, a nested `keras.Model` or `Sequential`) is opened: its
    own layers are cut, recursively, so a `GPT2CausalLM` (top level: the
    backbone and the output projection) is split between its transformer
    layers (`tfdist.placement.pipeline.stage_units` names each call by its
    path, "gpt2_backbone/transformer_layer_0"). A stage's weights, their optimizer
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

    Weights used on two stages (GPT-2's token embedding, which is also its
    output projection) live on one of them: the latest, and every call using
    them runs there (the embedding lookup on the last stage). TensorFlow then
    moves that call's inputs and outputs, not the weights: per step and
    replica, the token ids there (B*T*4 bytes for B sequences of T tokens),
    their embeddings back (B*T*H*4 for width H) and the embeddings' gradient
    there again (B*T*H*4), whatever the number of micro-batches. There is one
    variable and one optimizer state, its gradients from both uses sum where
    it lives, exactly as on one device, and `model.save` writes it once. The
    moved call's computation is that stage's too (for GPT-2 a gather; the
    balancer charges it there).
    Megatron's alternative, a copy on each stage whose gradients are
    all-reduced, moves 2*V*H*4 bytes (V the vocabulary) per step and holds the
    weight and its optimizer slots twice; at GPT-2's V=50257 it moves more
    whenever B*T < V. `strategy.plan.shared` and `plan.report()` say which
    weights are shared and which calls moved.

    Works with `model.fit` / `evaluate` / `predict`, callbacks and
    `model.save` (a saved model loads on one device). The model must be a
    built Sequential or functional model (give it a `keras.Input`). With
    `placement="auto"` the weights are created on stage 0's devices and moved
    to their stages when the first step is traced; explicit rules place each
    weight of a top-level layer where it belongs as it is created (those of
    layers inside nested models, whose paths lack the model's name, are moved
    as with "auto").

    Args:
        stages: the number of pipeline stages (devices per replica).
        microbatches: micro-batches per replica batch; a global batch must be
            a multiple of `microbatches * replicas` (a smaller final batch is
            split as evenly as it goes, exactly).
        placement: "auto" (the balancer splits the layer calls into
            `stages` runs minimizing the largest stage cost) or a dict mapping
            a regex to a stage, e.g. `{"dense_[0-2]": 0, "dense_[3-5]": 1}`.
            A rule fully matches a call's path: the names of the models it is
            nested in and its layer's, "/"-joined
            (`"gpt2_backbone/transformer_layer_[0-5]"`); a rule naming a nested
            model places every call inside it unless a rule names the call;
            ":k" names a layer's k-th further call in one graph. Layers
            without weights that match no rule join the latest stage among
            their inputs. A rule matching nothing is an error listing the
            valid names.
        cost: what "auto" balances: "params", "flops" or "time" (see
            `tfdist.placement.pipeline.balance`).
        replicas: copies of the pipeline trained data-parallel.
        devices: `stages * replicas` device names, replica-major; default: the
            first `stages * replicas` GPUs, else logical CPUs.
        communication: the all-reduce across replicas, as in
            `DataParallelStrategy`.
        batch_statistics: what layers that compute from the batch in
            training see. "replica" (the default): each micro-batch's own
            statistics, as in every GPipe implementation (`fit` warns once,
            naming the layers). "global": KerasHub's MoE load-balancing
            losses (Mixtral, Qwen-MoE, Qwen3-MoE, Qwen3.5-MoE) are computed
            from the per-expert sums of every micro-batch and replica, as on
            one device: the last micro-batch adds the whole step's loss, and
            the earlier micro-batches' part of its gradient comes from one
            more backward pass through their routers' inputs at the end of
            the step. BatchNormalization normalizes each micro-batch with its
            own moments either way (a micro-batch's forward pass cannot wait
            for the others'); with microbatches=1 and replicas > 1, "global"
            makes its moments the global batch's, as
            `DataParallelStrategy(batch_statistics="global")` does.

    Raises:
        ValueError: invalid arguments (each message names the argument and
            the valid choices), too few devices. Errors about the model
            (more stages than layers, rules matching nothing or leaving a
            layer without a stage, stages against the data flow) are raised
            when the first step is traced.

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
        batch_statistics: str = "replica",
    ):
        stages = _validate.integer("stages", stages)
        microbatches = _validate.integer("microbatches", microbatches)
        replicas = _validate.integer("replicas", replicas)
        _validate.one_of("cost", cost, pipeline_lib.COSTS)
        _validate.one_of("batch_statistics", batch_statistics, _exact.BATCH_STATISTICS)
        if isinstance(placement, str) and placement != "auto" or not isinstance(placement, (str, Mapping)):
            raise _validate.invalid(
                "placement",
                placement,
                "'auto' or a dict mapping a layer-path regex to a stage, e.g. {'dense_[0-2]': 0, 'dense_[3-5]': 1}",
            )
        rules = None if isinstance(placement, str) else pipeline_lib.StageRules(placement, stages)
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
                raise _validate.invalid(
                    "devices",
                    devices,
                    f"a list of stages x replicas = {stages} x {replicas} = {needed} device names (replica-major)",
                )
            devices = devices_lib.device_list(devices)
        _mirrored.validate_communication(communication, devices)
        _compat.install("pipeline")
        if _LOG_FILTER not in tf.get_logger().filters:
            tf.get_logger().addFilter(_LOG_FILTER)
        grid = [[devices[r * stages + s] for r in range(replicas)] for s in range(stages)]
        self._stages, self._microbatches, self._replicas = stages, microbatches, replicas
        self._collective_key_base = _mirrored.next_key_base()
        extended = PipelineExtended(
            self, grid=grid, microbatches=microbatches, rules=rules, cost=cost, communication=communication
        )
        extended._tfdist_batch_statistics = batch_statistics
        _mirrored.init_strategy(self, extended, "MirroredStrategy")

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
    def batch_statistics(self) -> str:
        """What MoE balancing losses (and, with one micro-batch, BatchNormalization) compute from (see the class)."""
        return self.extended._tfdist_batch_statistics

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
            f"replicas={self._replicas}, devices={[d for row in zip(*self.extended._grid) for d in row]!r}, "
            f"batch_statistics={self.batch_statistics!r})"
        )
