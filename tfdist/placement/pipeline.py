"""Pipeline stages: which contiguous run of a model's layers each stage owns.

A pipeline splits a Keras model's top-level layers (in the order data flows
through them) into `stages` contiguous runs. Activations go from one stage to
the next; a layer's weights and its computation live on its stage's device.

A plan comes from explicit rules (`plan_explicit`: layer-name regex -> stage)
or from the balancer (`balance`), which chooses the cuts that minimize the
largest stage cost, the cost of a layer being its parameters, its estimated
FLOPs, or its measured forward+backward time.

Example:

>>> import keras
>>> from tfdist.placement import pipeline
>>> model = keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8, name=f"d{i}") for i in range(4)])
>>> plan = pipeline.balance(model, stages=2, cost="params")
>>> plan.layers
(('d0', 'd1'), ('d2', 'd3'))
>>> plan.stage_of("d3")
1
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import statistics
import string
import time
from collections.abc import Mapping
from collections.abc import Sequence

from tfdist import _validate

COSTS = ("params", "flops", "time")


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """Which layers each pipeline stage owns, with the figures behind the choice.

    Attributes:
        layers: per stage, the names of its top-level layers in data-flow order.
        cost: what the stages were balanced on: "params", "flops", "time", or
            "explicit" (a user's placement rules).
        layer_costs: the balancing cost of each layer (parameters for "explicit").
        params: per stage, the number of parameters.
        bytes: per stage, the bytes of its weights.
        seconds: per stage, the measured forward+backward seconds of one
            (micro-)batch when the cost is "time", else None.
    """

    layers: tuple[tuple[str, ...], ...]
    cost: str
    layer_costs: Mapping[str, float]
    params: tuple[int, ...]
    bytes: tuple[int, ...]
    seconds: tuple[float, ...] | None = None

    @property
    def stages(self) -> int:
        return len(self.layers)

    def stage_of(self, layer_name: str) -> int:
        """The stage that owns the top-level layer `layer_name`."""
        for stage, names in enumerate(self.layers):
            if layer_name in names:
                return stage
        known = [n for names in self.layers for n in names]
        raise KeyError(f"Layer {layer_name!r} is in no stage of this plan; its layers are {known}.")

    @property
    def stage_costs(self) -> tuple[float, ...]:
        """Per stage, the sum of its layers' balancing cost."""
        return _per_stage(self.layer_costs, self.layers)

    @property
    def imbalance(self) -> float:
        """Largest stage cost / mean stage cost (1.0 is perfectly balanced)."""
        costs = self.stage_costs
        mean = sum(costs) / len(costs)
        return max(costs) / mean if mean else 1.0

    def timed(self, model, *, batch_size: int = 8, rounds: int = 3) -> PipelinePlan:
        """This plan with each stage's forward+backward seconds measured (layer by layer, on zeros
        of `batch_size` rows; median of `rounds`), for `report()`."""
        seconds = {layer.name: layer_seconds(model, layer, batch_size, rounds) for layer in stage_units(model)}
        return dataclasses.replace(self, seconds=_per_stage(seconds, self.layers))

    @property
    def placement(self) -> dict[str, int]:
        """The plan as explicit placement rules (one exact-name regex per layer), to pin it."""
        return {re.escape(n): s for s, names in enumerate(self.layers) for n in names}

    def report(self) -> str:
        """A table of the stages: layers, parameters, bytes, cost share (and time when measured)."""
        total = sum(self.stage_costs) or 1.0
        head = "| stage | layers | parameters | MiB | cost share |"
        rule = "|---|---|---|---|---|"
        if self.seconds is not None:
            head += " ms per batch |"
            rule += "---|"
        rows = []
        for s, names in enumerate(self.layers):
            span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]} ({len(names)})"
            row = (
                f"| {s} | {span} | {self.params[s]:,} | {self.bytes[s] / 2**20:.2f} | "
                f"{self.stage_costs[s] / total:.1%} |"
            )
            if self.seconds is not None:
                row += f" {1e3 * self.seconds[s]:.2f} |"
            rows.append(row)
        how = "Placed by explicit rules; parameters" if self.cost == "explicit" else f"Balanced on {self.cost}"
        footer = f"\n{how}: max/mean stage cost {self.imbalance:.2f}."
        return "\n".join([head, rule, *rows]) + footer


def _per_stage(per_layer: Mapping[str, float], layers) -> tuple:
    """Per stage, the sum of `per_layer` over the stage's layer names."""
    return tuple(sum(per_layer[n] for n in names) for names in layers)


# --------------------------------------------------------------------------------------------
# The model as a chain of top-level layers.
# --------------------------------------------------------------------------------------------
def stage_units(model) -> list:
    """The model's top-level layers in data-flow (topological) order, without input layers.

    Raises:
        ValueError: for a model that is not built (its layers' order and shapes are unknown).
    """
    import keras

    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built, so its layers cannot be assigned to pipeline stages. "
            "Give it an input shape first (keras.Input(...) as its first layer, or model.build(shape))."
        )
    return [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]


def _graph(model):
    """The Functional graph behind `model` (a Sequential's inner one), or None for a plain chain."""
    graph = getattr(model, "_functional", None) or model
    return graph if hasattr(graph, "_nodes_by_depth") else None


def _nodes(model, layer):
    graph = _graph(model)
    if graph is None:
        return []
    nodes = [n for depth in graph._nodes_by_depth.values() for n in depth]
    return [n for n in nodes if n.operation is layer]


def unit_parents(model, units) -> dict[int, set[int]]:
    """For each unit index, the indices of the units whose outputs it consumes."""
    index = {id(layer): i for i, layer in enumerate(units)}
    if _graph(model) is None:  # a Sequential without an Input: a chain
        return {i: ({i - 1} if i else set()) for i in range(len(units))}
    parents = {}
    for i, layer in enumerate(units):
        found = set()
        for node in _nodes(model, layer):
            for parent in node.parent_nodes:
                j = index.get(id(parent.operation))
                if j is not None:
                    found.add(j)
        parents[i] = found
    return parents


def _params(layer) -> int:
    return int(sum(_size(w.shape) for w in layer.weights))


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _bytes(layer) -> int:
    import numpy as np

    return int(sum(_size(w.shape) * np.dtype(w.dtype).itemsize for w in layer.weights))


# --------------------------------------------------------------------------------------------
# Explicit placement.
# --------------------------------------------------------------------------------------------
class StageRules:
    """Explicit placement rules, validated and compiled once: a regex fully matching a top-level
    layer name -> its stage. Both the plan (`plan_explicit`) and a strategy placing variables as
    they are created (`stage_of_path`) match layer names with `stages_of`.

    Args:
        placement: a non-empty dict mapping a layer-name regex to a stage.
        stages: the number of stages.

    Raises:
        ValueError: not a non-empty dict, a rule that is not a regex, a stage outside [0, stages).

    Example:

    >>> rules = StageRules({"d[0-1]": 0, "d[2-5]": 1}, stages=2)
    >>> rules.stages_of("d3"), rules.stage_of_path("mlp/d1/kernel")
    ([1], 0)
    """

    def __init__(self, placement: Mapping[str, int], stages: int):
        stages = _validate.integer("stages", stages)
        if not isinstance(placement, Mapping) or not placement:
            raise _validate.invalid(
                "placement",
                placement,
                "'auto' or a non-empty dict mapping a layer-name regex to a stage, e.g. "
                "{'dense_[0-2]': 0, 'dense_[3-5]': 1}",
            )
        rules = []
        for pattern, stage in placement.items():
            try:
                compiled = re.compile(pattern)
            except (re.error, TypeError) as e:
                raise ValueError(f"Placement rule {pattern!r} is not a valid regular expression: {e}.") from e
            if not _validate.is_integer(stage, minimum=0, maximum=stages - 1):
                raise ValueError(
                    f"Placement rule {pattern!r} -> {stage!r}: the stage must be an integer in [0, {stages}) "
                    f"for stages={stages}."
                )
            rules.append((pattern, compiled, stage))
        self.stages = stages
        self.rules: tuple[tuple[str, re.Pattern, int], ...] = tuple(rules)

    @property
    def patterns(self) -> list[str]:
        return [p for p, _, _ in self.rules]

    def stages_of(self, layer_name: str) -> list[int]:
        """The stages of the rules that fully match `layer_name`, sorted (empty: no rule)."""
        return sorted({stage for _, compiled, stage in self.rules if compiled.fullmatch(layer_name)})

    def stage_of_path(self, path: str | None) -> int | None:
        """The stage of a variable from its Keras path: the first path component (outermost layer)
        that the rules give exactly one stage; None when none does."""
        for part in (path or "").split("/")[:-1]:
            hits = self.stages_of(part)
            if len(hits) == 1:
                return hits[0]
        return None


def plan_explicit(model, placement: Mapping[str, int] | StageRules, stages: int) -> PipelinePlan:
    """A plan from rules mapping a regex (full match on a top-level layer name) to a stage.

    Every layer with weights must match exactly one stage. A layer without
    weights that matches no rule joins the latest stage among its inputs.

    Raises:
        ValueError: a rule that is not a regex, names a stage outside
            [0, stages) or matches no layer; a layer with weights matched by no
            rule or by rules of two stages; a stage left without layers; an
            assignment the data flow cannot follow (a layer on an earlier stage
            than a layer it reads from); weights shared across stages.
    """
    rules = placement if isinstance(placement, StageRules) else StageRules(placement, stages)
    units = stage_units(model)
    names = [layer.name for layer in units]
    for pattern, compiled, _ in rules.rules:
        if not any(compiled.fullmatch(n) for n in names):
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.3)
            raise ValueError(
                f"Placement rule {pattern!r} matches no layer of model {model.name!r} (rules match whole "
                f"top-level layer names). Layers: {names}." + (f" Did you mean {close}?" if close else "")
            )
    parents = unit_parents(model, units)
    assigned: list[int | None] = []
    for i, layer in enumerate(units):
        hits = rules.stages_of(layer.name)
        if len(hits) > 1:
            raise ValueError(
                f"Layer {layer.name!r} is matched by placement rules of stages {hits}; each layer belongs to "
                "one stage. Make the rules exclusive."
            )
        if hits:
            assigned.append(hits[0])
        elif layer.weights:
            raise ValueError(
                f"Layer {layer.name!r} (with {_params(layer):,} parameters) is matched by no placement rule, "
                f"so it has no stage. Rules: {rules.patterns}. Add a rule for it."
            )
        else:
            assigned.append(max((assigned[j] for j in parents[i]), default=0))
    return _plan_from_assignment(model, units, assigned, stages, cost="explicit", costs=None)


def _plan_from_assignment(model, units, assigned, stages, *, cost, costs, seconds=None) -> PipelinePlan:
    names = [layer.name for layer in units]
    empty = [s for s in range(stages) if s not in assigned]
    if empty:
        raise ValueError(
            f"Pipeline stages {empty} of {stages} own no layer of model {model.name!r}: every stage needs at "
            f"least one layer (the model has {len(units)}: {names})."
        )
    for i, parent_indices in unit_parents(model, units).items():
        for j in sorted(parent_indices):
            if assigned[j] > assigned[i]:
                raise ValueError(
                    f"Layer {names[i]!r} (stage {assigned[i]}) reads the output of layer {names[j]!r} "
                    f"(stage {assigned[j]}): activations would flow back from stage {assigned[j]} to "
                    f"stage {assigned[i]}, so the model's graph cannot be cut there. Stages must follow the "
                    "data flow: give each layer a stage no earlier than the layers it reads from."
                )
    owners: dict[int, set[int]] = {}
    for layer, stage in zip(units, assigned):
        for w in layer.weights:
            owners.setdefault(id(w), set()).add(stage)
    for layer in units:
        for w in layer.weights:
            if len(owners[id(w)]) > 1:
                raise ValueError(
                    f"Weight {w.path!r} of layer {layer.name!r} is shared by layers on stages "
                    f"{sorted(owners[id(w)])}; a weight lives on one stage. Put the layers that share it on "
                    "one stage."
                )
    costs = costs or {layer.name: float(_params(layer)) for layer in units}
    per_stage = [tuple(n for n, s in zip(names, assigned) if s == k) for k in range(stages)]
    params = _per_stage({u.name: _params(u) for u in units}, per_stage)
    nbytes = _per_stage({u.name: _bytes(u) for u in units}, per_stage)
    if seconds is not None:
        seconds = _per_stage(seconds, per_stage)
    return PipelinePlan(tuple(per_stage), cost, dict(costs), params, nbytes, seconds)


# --------------------------------------------------------------------------------------------
# The balancer.
# --------------------------------------------------------------------------------------------
def partition(costs: Sequence[float], stages: int) -> list[int]:
    """Stage index of each item: contiguous runs, minimizing the largest run's sum.

    Dynamic programming over cut points, O(stages * n^2); ties go to the
    earliest cut. Every stage gets at least one item.

    >>> partition([4, 1, 1, 1, 1], 2)
    [0, 1, 1, 1, 1]
    """
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"Cannot split {n} items into {stages} non-empty contiguous stages.")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: the smallest possible largest-stage cost of items[:i] in k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = value, j
    assignment = [0] * n
    i = n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        assignment[j:i] = [k - 1] * (i - j)
        i = j
    return assignment


def even_split(model, stages: int) -> PipelinePlan:
    """The naive plan: an equal number of layers per stage (the first stages take one more)."""
    units = stage_units(model)
    _check_stage_count(model, units, stages)
    per, extra = divmod(len(units), stages)
    assigned = [s for s in range(stages) for _ in range(per + (s < extra))]
    return _plan_from_assignment(model, units, assigned, stages, cost="params", costs=None)


def balance(model, stages: int, cost: str = "params", *, batch_size: int = 8, rounds: int = 3) -> PipelinePlan:
    """Splits `model` into `stages` contiguous stages minimizing the largest stage cost.

    Args:
        model: a built Keras Sequential or functional model.
        stages: the number of pipeline stages.
        cost: "params" (parameters per layer), "flops" (estimated from each
            layer's traced forward pass) or "time" (each layer's forward and
            backward pass timed on zeros of its input shape).
        batch_size: the (micro-)batch size for "flops" and "time".
        rounds: timed repetitions per layer for "time" (the median is used).

    Returns:
        The `PipelinePlan`.

    Raises:
        ValueError: an unknown `cost`, more stages than layers, an unbuilt model.
    """
    _validate.one_of("cost", cost, COSTS)
    stages = _validate.integer("stages", stages)
    batch_size = _validate.integer("batch_size", batch_size)
    rounds = _validate.integer("rounds", rounds)
    units = stage_units(model)
    _check_stage_count(model, units, stages)
    seconds = None
    if cost == "params":
        costs = {layer.name: float(_params(layer)) for layer in units}
    elif cost == "flops":
        costs = {layer.name: float(layer_flops(model, layer, batch_size)) for layer in units}
    else:
        seconds = {layer.name: layer_seconds(model, layer, batch_size, rounds) for layer in units}
        costs = dict(seconds)
    assigned = partition([costs[layer.name] for layer in units], stages)
    return _plan_from_assignment(model, units, assigned, stages, cost=cost, costs=costs, seconds=seconds)


def _check_stage_count(model, units, stages):
    if stages > len(units):
        raise ValueError(
            f"stages={stages} is more than the {len(units)} top-level layers of model {model.name!r} "
            f"({[u.name for u in units]}); each stage needs at least one layer. Use stages <= {len(units)}."
        )


def _sample_inputs(model, layer, batch_size):
    """Arguments for one call of `layer` as in `model`'s graph, filled with zeros of `batch_size` rows."""
    import tensorflow as tf

    nodes = _nodes(model, layer)
    if not nodes:
        raise ValueError(
            f"Layer {layer.name!r} has no call recorded in model {model.name!r}'s graph, so its input shape is "
            "unknown; build the model with keras.Input(...) to balance on flops or time."
        )
    arguments = nodes[0].arguments

    def zeros(kt):
        shape = [batch_size if i == 0 and d is None else (d or 1) for i, d in enumerate(kt.shape)]
        return tf.zeros(shape, dtype=kt.dtype)

    return arguments.fill_in({id(kt): zeros(kt) for kt in arguments.keras_tensors})


def layer_seconds(model, layer, batch_size: int, rounds: int = 3) -> float:
    """Median seconds of `layer`'s forward and backward pass on a batch of zeros."""
    import tensorflow as tf

    args, kwargs = _sample_inputs(model, layer, batch_size)
    inputs = [t for t in tf.nest.flatten((args, kwargs)) if isinstance(t, tf.Tensor) and t.dtype.is_floating]
    if _has_training_arg(layer):
        kwargs = {**kwargs, "training": True}

    def step():
        with tf.GradientTape() as tape:
            tape.watch(inputs)
            out = layer(*args, **kwargs)
            total = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in tf.nest.flatten(out)])
        grads = tape.gradient(total, list(layer.trainable_weights) + inputs)
        dense = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]
        return tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in dense]) if dense else total

    step = tf.function(step).get_concrete_function()  # one trace per layer, no retracing warnings
    step()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        step().numpy()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _has_training_arg(layer) -> bool:
    return bool(getattr(layer, "_call_has_training_arg", False))


def layer_flops(model, layer, batch_size: int) -> int:
    """Estimated FLOPs of `layer`'s forward pass on `batch_size` rows (matmuls, convolutions, einsums x2;
    other ops one per output element)."""
    import tensorflow as tf

    args, kwargs = _sample_inputs(model, layer, batch_size)
    concrete = tf.function(lambda: layer(*args, **kwargs)).get_concrete_function()
    return sum(_op_flops(op) for op in concrete.graph.get_operations())


def _elements(tensor) -> int:
    shape = tensor.shape
    if shape.rank is None or any(d is None for d in shape):
        return 0
    return _size(shape)


def _op_flops(op) -> int:
    if op.type in ("Placeholder", "Const", "ReadVariableOp", "Identity", "NoOp", "Shape", "Reshape"):
        return 0
    if not op.outputs:
        return 0
    out = _elements(op.outputs[0])
    if op.type == "MatMul":
        a = op.inputs[0].shape
        k = a[0] if op.get_attr("transpose_a") else a[-1]
        return 2 * out * int(k or 1)
    if op.type.startswith("BatchMatMul"):
        a = op.inputs[0].shape
        k = a[-2] if op.get_attr("adj_x") else a[-1]
        return 2 * out * int(k or 1)
    if op.type == "Einsum":
        equation = op.get_attr("equation").decode()
        sizes = {}
        for term, tensor in zip(equation.split("->")[0].split(","), op.inputs):
            for letter, d in zip(term.replace("...", ""), tensor.shape[-len(term.replace("...", "")):]):
                if letter in string.ascii_letters and d is not None:
                    sizes[letter] = int(d)
        total = 1
        for d in sizes.values():
            total *= d
        return 2 * total
    if op.type in ("Conv2D", "Conv1D", "Conv3D", "DepthwiseConv2dNative"):
        kernel = op.inputs[1].shape
        per_output = _size(kernel[:-1]) if op.type != "DepthwiseConv2dNative" else _size(kernel[:-2])
        return 2 * out * per_output
    return out
