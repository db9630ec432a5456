"""Pipeline stages: which contiguous run of a model's layer calls each stage owns.

A pipeline splits a Keras model's layer calls (in the order data flows through
them) into `stages` contiguous runs. Activations go from one stage to the
next; a layer's weights and its computation live on its stage's device.

The calls are those of the model's graph, with every functional model used as
a layer (a backbone, a nested `keras.Model` or `Sequential`, called once)
replaced by its own calls, recursively: a KerasHub `GPT2CausalLM` (its top
level is the `GPT2Backbone` and the output projection) is cut between its
transformer layers. Each call is named by its path (`stage_units`):
"gpt2_backbone/transformer_layer_0" (the enclosing models' names and the
layer's, "/"-joined), with ":k" for the k-th further call of one layer in one
graph ("shared:1").

Weights used by calls on two or more stages (an LM's token embedding, also its
output projection) live on one stage: the latest of them. Every call using
them runs there (`SharedWeights`): TensorFlow moves that call's inputs and
outputs across stages, not the weights, so the weights have one copy and one
optimizer state and their gradients sum where they live, as on one device.

A plan comes from explicit rules (`plan_explicit`: path regex -> stage) or
from the balancer (`balance`), which chooses the cuts that minimize the
largest stage cost, the cost of a call being its parameters, its estimated
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
class SharedWeights:
    """Weights used by several layer calls, and where they live.

    Attributes:
        weights: the weights' paths.
        calls: the names of the calls using them (directly, or through a
            call sharing other weights with them), in data-flow order.
        placed: per call, the stage its place in the data flow gives it
            (the balancer's cut or the placement rules).
        stage: the stage holding the weights and running every call of
            `calls`: the latest of `placed`.
    """

    weights: tuple[str, ...]
    calls: tuple[str, ...]
    placed: tuple[int, ...]
    stage: int

    @property
    def moved(self) -> tuple[str, ...]:
        """The calls that run on `stage` although the data flow places them earlier."""
        return tuple(c for c, s in zip(self.calls, self.placed) if s != self.stage)


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """Which layer calls each pipeline stage owns, with the figures behind the choice.

    Attributes:
        layers: per stage, the names (paths, see `stage_units`) of the calls
            it runs, in data-flow order.
        cost: what the stages were balanced on: "params", "flops", "time", or
            "explicit" (a user's placement rules).
        layer_costs: the balancing cost of each call (parameters for
            "explicit"); the calls that share weights are charged together
            to the last of them.
        params: per stage, the number of parameters it holds.
        bytes: per stage, the bytes of its weights.
        seconds: per stage, the measured forward+backward seconds of one
            (micro-)batch when the cost is "time", else None.
        shared: the weights used by calls the data flow places on different
            stages, and the one stage that holds them (see `SharedWeights`).
    """

    layers: tuple[tuple[str, ...], ...]
    cost: str
    layer_costs: Mapping[str, float]
    params: tuple[int, ...]
    bytes: tuple[int, ...]
    seconds: tuple[float, ...] | None = None
    shared: tuple[SharedWeights, ...] = ()

    @property
    def stages(self) -> int:
        return len(self.layers)

    def stage_of(self, layer_name: str) -> int:
        """The stage that runs the call `layer_name` (a path, see `stage_units`) and holds its weights."""
        for stage, names in enumerate(self.layers):
            if layer_name in names:
                return stage
        known = [n for names in self.layers for n in names]
        raise KeyError(f"Layer {layer_name!r} is in no stage of this plan; its layers are {known}.")

    @property
    def stage_costs(self) -> tuple[float, ...]:
        """Per stage, the sum of its calls' balancing cost."""
        return _per_stage(self.layer_costs, self.layers)

    @property
    def imbalance(self) -> float:
        """Largest stage cost / mean stage cost (1.0 is perfectly balanced)."""
        costs = self.stage_costs
        mean = sum(costs) / len(costs)
        return max(costs) / mean if mean else 1.0

    def timed(self, model, *, batch_size: int = 8, rounds: int = 3) -> PipelinePlan:
        """This plan with each stage's forward+backward seconds measured (call by call, on zeros
        of `batch_size` rows; median of `rounds`), for `report()`."""
        seconds = {unit.name: _unit_seconds(unit, batch_size, rounds) for unit in stage_units(model)}
        return dataclasses.replace(self, seconds=_per_stage(seconds, self.layers))

    @property
    def placement(self) -> dict[str, int]:
        """The plan as explicit placement rules (one exact-path regex per call), to pin it."""
        placed = {c: s for group in self.shared for c, s in zip(group.calls, group.placed)}
        return {re.escape(n): placed.get(n, s) for s, names in enumerate(self.layers) for n in names}

    def report(self) -> str:
        """A table of the stages: calls, parameters, bytes, cost share (and time when measured); then
        the weights shared across stages and where they live."""
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
        lines = [head, rule, *rows, f"\n{how}: max/mean stage cost {self.imbalance:.2f}."]
        for group in self.shared:
            uses = ", ".join(f"{c} (stage {s})" for c, s in zip(group.calls, group.placed))
            lines.append(
                f"Shared weights {', '.join(group.weights)}: used by {uses}; held by stage {group.stage}, which "
                f"runs {', '.join(group.moved)} too (its inputs and outputs cross stages, not the weights)."
            )
        return "\n".join(lines)


def _per_stage(per_layer: Mapping[str, float], layers) -> tuple:
    """Per stage, the sum of `per_layer` over the stage's call names."""
    return tuple(sum(per_layer[n] for n in names) for names in layers)


# --------------------------------------------------------------------------------------------
# The model as a chain of layer calls.
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class Unit:
    """One call of a layer in a model's flattened graph: what a pipeline stage owns.

    Attributes:
        name: the call's path: the names of the functional models it is nested
            in and the layer's, "/"-joined ("gpt2_backbone/transformer_layer_0"),
            with ":k" for the layer's k-th further call in the same graph.
        layer: the layer called.
        node: the call's node in its graph (None in a Sequential without an
            Input, whose layers are called in turn).
        parents: the indices of the calls whose outputs it reads.
        containers: the paths of the functional models it is nested in,
            innermost first.
    """

    name: str
    layer: object
    node: object
    parents: frozenset
    containers: tuple[str, ...] = ()

    @property
    def key(self) -> int:
        """What the pipeline runtime places by: the node's id (one call), else the layer's."""
        return id(self.node) if self.node is not None else id(self.layer)

    @property
    def base_name(self) -> str:
        """`name` without its ":k" call index: the path of the layer, which rules name for all its calls."""
        return re.sub(r":\d+$", "", self.name)


def _graph(model):
    """The Functional graph behind `model` (a Sequential's inner one), or None for a plain chain."""
    graph = getattr(model, "_functional", None) or model
    return graph if hasattr(graph, "_nodes_by_depth") else None


def stage_units(model) -> list[Unit]:
    """The model's layer calls in data-flow (topological) order, without input layers.

    A functional model (Functional or Sequential with an input) called once as a
    layer is replaced by its own calls, recursively; one called more than once,
    and a subclassed model, is one call.

    Raises:
        ValueError: for a model that is not built (its layers' order and shapes are unknown).

    Example:

    >>> import keras
    >>> inputs = keras.Input((4,))
    >>> backbone = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="a")], name="backbone")
    >>> model = keras.Model(inputs, keras.layers.Dense(2, name="head")(backbone(inputs)))
    >>> [unit.name for unit in stage_units(model)]
    ['backbone/a', 'head']
    """
    import keras

    if not model.built:
        raise ValueError(
            f"Model {model.name!r} is not built, so its layers cannot be assigned to pipeline stages. "
            "Give it an input shape first (keras.Input(...) as its first layer, or model.build(shape))."
        )
    graph = _graph(model)
    if graph is None:  # a Sequential without an Input: a chain
        layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
        return [Unit(layer.name, layer, None, frozenset({i - 1} if i else ())) for i, layer in enumerate(layers)]
    units: list[Unit] = []
    _flatten(graph, "", (), {}, units)
    return units


def _graph_nodes(graph) -> list:
    """The nodes of a Functional graph in the order Keras runs them (deepest first)."""
    return [n for depth in sorted(graph._nodes_by_depth, reverse=True) for n in graph._nodes_by_depth[depth]]


def _flatten(graph, prefix: str, containers: tuple, producers: dict, units: list) -> None:
    """Appends the calls of `graph` to `units`; `producers` maps id(KerasTensor) -> indices of the units
    whose outputs it depends on (the graph's inputs already mapped by the caller)."""
    import keras

    nodes = _graph_nodes(graph)
    in_graph = {id(n) for n in nodes}
    for node in nodes:
        operation = node.operation
        sources = frozenset().union(*(producers.get(id(t), frozenset()) for t in node.arguments.keras_tensors))
        if node.is_input or isinstance(operation, keras.layers.InputLayer):
            continue
        if not isinstance(operation, keras.layers.Layer):  # a keras.ops call: no weights, its inputs pass through
            for t in node.outputs:
                producers[id(t)] = sources
            continue
        calls = [n for n in operation._inbound_nodes if id(n) in in_graph]
        name = prefix + operation.name + (f":{calls.index(node)}" if calls.index(node) else "")
        inner = _graph(operation)
        if inner is not None and len(calls) == 1:
            # A functional model used as a layer: its inputs stand for the outer call's inputs (all of
            # them: `parents` may then hold more than the call reads, never less), its outputs for its own.
            for t in inner.inputs:
                producers[id(t)] = sources
            _flatten(inner, name + "/", (name, *containers), producers, units)
            inner_outputs = list(inner.outputs)
            for i, t in enumerate(node.outputs):
                same = inner_outputs[i : i + 1] if len(node.outputs) == len(inner_outputs) else inner_outputs
                producers[id(t)] = frozenset().union(*(producers.get(id(o), frozenset()) for o in same))
            continue
        index = len(units)
        units.append(Unit(name, operation, node, sources, containers))
        for t in node.outputs:
            producers[id(t)] = frozenset({index})


def _unit_weights(unit) -> list:
    return list(unit.layer.weights)


def _weights_params(weights) -> int:
    return int(sum(_size(w.shape) for w in weights))


def _size(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _weights_bytes(weights) -> int:
    import numpy as np

    return int(sum(_size(w.shape) * np.dtype(w.dtype).itemsize for w in weights))


def _unique(weights) -> list:
    seen, out = set(), []
    for w in weights:
        if id(w) not in seen:
            seen.add(id(w))
            out.append(w)
    return out


def _weight_groups(units) -> list[int]:
    """For each unit, the index of the last unit (data-flow order) of its group: the units linked by
    using the same weights, directly or through one another. A unit that shares nothing is its own."""
    parent = list(range(len(units)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for i, unit in enumerate(units):
        for w in _unit_weights(unit):
            j = owner.setdefault(id(w), i)
            a, b = find(i), find(j)
            if a != b:
                parent[min(a, b)] = max(a, b)
    return [find(i) for i in range(len(units))]


# --------------------------------------------------------------------------------------------
# Explicit placement.
# --------------------------------------------------------------------------------------------
class StageRules:
    """Explicit placement rules, validated and compiled once: a regex fully matching a layer call's
    path (see `stage_units`) -> its stage. Both the plan (`plan_explicit`) and a strategy placing
    variables as they are created (`stage_of_path`) match names with `stages_of`.

    Which rule places a call: the rules matching its path ("gpt2_backbone/transformer_layer_0",
    "shared:1"), else those matching its layer's path without the call index ("shared": every call of
    the layer), else those matching the path of the functional model it is nested in, innermost first
    ("gpt2_backbone": every call inside it). Rules of two stages at the first of these that any rule
    matches are an error.

    Args:
        placement: a non-empty dict mapping a path regex to a stage.
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
                "'auto' or a non-empty dict mapping a layer-path regex to a stage, e.g. "
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

    def stage_of_unit(self, unit: Unit) -> int | None:
        """The stage the rules give the call `unit` (see the class), or None when no rule matches it.

        Raises:
            ValueError: rules of two stages match it at the same level.
        """
        for candidate in dict.fromkeys((unit.name, unit.base_name, *unit.containers)):
            hits = self.stages_of(candidate)
            if len(hits) > 1:
                how = "" if candidate == unit.name else f" (as {candidate!r})"
                raise ValueError(
                    f"Layer {unit.name!r} is matched{how} by placement rules of stages {hits}; each layer "
                    "belongs to one stage. Make the rules exclusive."
                )
            if hits:
                return hits[0]
        return None


def _rule_names(units) -> list[str]:
    """Every name a rule can match: the calls' paths, their layers' paths, the nested models' paths."""
    return list(dict.fromkeys(name for u in units for name in (*reversed(u.containers), u.base_name, u.name)))


def plan_explicit(model, placement: Mapping[str, int] | StageRules, stages: int) -> PipelinePlan:
    """A plan from rules mapping a regex (full match on a layer call's path) to a stage.

    Every call with weights must be placed by a rule (see `StageRules` for how
    rules name calls inside nested models and a layer's several calls). A call
    without weights that no rule places joins the latest stage among its inputs.
    Calls sharing weights that the rules put on different stages all run on the
    latest of them, which holds the weights (`PipelinePlan.shared`).

    Raises:
        ValueError: a rule that is not a regex, names a stage outside
            [0, stages) or matches no layer (the message lists the valid
            names); a call with weights matched by no rule or by rules of two
            stages; a stage left without calls; an assignment the data flow
            cannot follow (a call on an earlier stage than a call it reads from).
    """
    rules = placement if isinstance(placement, StageRules) else StageRules(placement, stages)
    units = stage_units(model)
    names = _rule_names(units)
    for pattern, compiled, _ in rules.rules:
        if not any(compiled.fullmatch(n) for n in names):
            close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.3)
            raise ValueError(
                f"Placement rule {pattern!r} matches no layer of model {model.name!r} (rules fully match a "
                f"layer's path: nested models' names and its own, '/'-joined). Valid names: {names}."
                + (f" Did you mean {close}?" if close else "")
            )
    assigned: list[int] = []
    for unit in units:
        stage = rules.stage_of_unit(unit)
        if stage is None and unit.layer.weights:
            raise ValueError(
                f"Layer {unit.name!r} (with {_weights_params(_unit_weights(unit)):,} parameters) is matched by "
                f"no placement rule, so it has no stage. Rules: {rules.patterns}. Add a rule for it."
            )
        assigned.append(stage if stage is not None else max((assigned[j] for j in unit.parents), default=0))
    return _plan_from_assignment(model, units, assigned, stages, cost="explicit", costs=None)


def _plan_from_assignment(model, units, assigned, stages, *, cost, costs, seconds=None) -> PipelinePlan:
    """The plan of `units` placed on `assigned` stages; `costs` (None: parameters) by unit name, as charged."""
    names = [u.name for u in units]
    for i, unit in enumerate(units):
        for j in sorted(unit.parents):
            if assigned[j] > assigned[i]:
                raise ValueError(
                    f"Layer {names[i]!r} (stage {assigned[i]}) reads the output of layer {names[j]!r} "
                    f"(stage {assigned[j]}): activations would flow back from stage {assigned[j]} to "
                    f"stage {assigned[i]}, so the model's graph cannot be cut there. Stages must follow the "
                    "data flow: give each layer a stage no earlier than the layers it reads from."
                )
    groups = _weight_groups(units)
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    runs = [max(assigned[j] for j in members[groups[i]]) for i in range(len(units))]
    empty = [s for s in range(stages) if s not in runs]
    if empty:
        moved = [names[i] for i in range(len(units)) if runs[i] != assigned[i]]
        raise ValueError(
            f"Pipeline stages {empty} of {stages} run no layer of model {model.name!r}: every stage needs at "
            f"least one layer (the model has {len(units)}: {names})."
            + (f" {moved} run on the stage holding the weights they share." if moved else "")
        )
    shared = []
    for g, indices in members.items():
        if len({assigned[i] for i in indices}) > 1:
            weights = _unique(w for i in indices for w in _unit_weights(units[i]))
            shared.append(
                SharedWeights(
                    weights=tuple(w.path for w in weights),
                    calls=tuple(names[i] for i in indices),
                    placed=tuple(assigned[i] for i in indices),
                    stage=runs[g],
                )
            )
    costs = costs or _charged(units, groups, lambda unit: 0.0, lambda weights: float(_weights_params(weights)))
    per_stage = [tuple(n for n, s in zip(names, runs) if s == k) for k in range(stages)]
    held = [_unique(w for u, s in zip(units, runs) if s == k for w in _unit_weights(u)) for k in range(stages)]
    if seconds is not None:
        seconds = _per_stage(seconds, per_stage)
    return PipelinePlan(
        layers=tuple(per_stage),
        cost=cost,
        layer_costs=dict(costs),
        params=tuple(_weights_params(w) for w in held),
        bytes=tuple(_weights_bytes(w) for w in held),
        seconds=seconds,
        shared=tuple(shared),
    )


def _charged(units, groups, call_cost, weights_cost) -> dict[str, float]:
    """Each unit's cost, calls sharing weights charged together to the last of them: `call_cost(unit)`
    summed over the group's calls plus `weights_cost` of the group's weights (each counted once)."""
    total: dict[int, float] = {}
    weights: dict[int, list] = {}
    for i, unit in enumerate(units):
        total[groups[i]] = total.get(groups[i], 0.0) + call_cost(unit)
        weights.setdefault(groups[i], []).extend(_unit_weights(unit))
    return {
        u.name: (total[i] + weights_cost(_unique(weights[i])) if groups[i] == i else 0.0) for i, u in enumerate(units)
    }


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


class _Chain:
    """What the balancer cuts: the units, less the calls that run with a later one sharing their weights
    (each group of calls sharing weights is cut as its last call, which carries the group's cost)."""

    def __init__(self, model, stages):
        self.model = model
        self.units = stage_units(model)
        self.groups = _weight_groups(self.units)
        self.indices = [i for i, g in enumerate(self.groups) if g == i]
        if stages > len(self.indices):
            shared = len(self.units) - len(self.indices)
            raise ValueError(
                f"stages={stages} is more than the {len(self.indices)} layers of model {model.name!r} that can "
                f"start a stage ({[self.units[i].name for i in self.indices]}"
                + (f"; {shared} more share weights with a later layer and run on its stage" if shared else "")
                + f"); each stage needs at least one layer. Use stages <= {len(self.indices)}."
            )

    def plan(self, stages, chain_stages, *, cost, costs, seconds=None) -> PipelinePlan:
        """The plan with the chain cut into `chain_stages`; every other call on the stage of the chain
        call before it (0 before the first), which keeps the assignment in data-flow order."""
        by_index = dict(zip(self.indices, chain_stages))
        assigned, stage = [], 0
        for i in range(len(self.units)):
            stage = by_index.get(i, stage)
            assigned.append(stage)
        return _plan_from_assignment(self.model, self.units, assigned, stages, cost=cost, costs=costs, seconds=seconds)


def even_split(model, stages: int) -> PipelinePlan:
    """The naive plan: an equal number of layers per stage (the first stages take one more)."""
    chain = _Chain(model, stages)
    per, extra = divmod(len(chain.indices), stages)
    assigned = [s for s in range(stages) for _ in range(per + (s < extra))]
    return chain.plan(stages, assigned, cost="params", costs=None)


def balance(model, stages: int, cost: str = "params", *, batch_size: int = 8, rounds: int = 3) -> PipelinePlan:
    """Splits `model` into `stages` contiguous stages minimizing the largest stage cost.

    The layer calls are those of `stage_units` (inside nested functional
    models); calls sharing weights are cut as one, at the last of them, and
    charged together to the stage that holds the weights.

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
    chain = _Chain(model, stages)
    units, groups = chain.units, chain.groups
    seconds = None
    if cost == "params":
        costs = _charged(units, groups, lambda unit: 0.0, lambda weights: float(_weights_params(weights)))
    elif cost == "flops":
        costs = _charged(units, groups, lambda unit: float(_unit_flops(unit, batch_size)), lambda weights: 0.0)
    else:
        seconds = {unit.name: _unit_seconds(unit, batch_size, rounds) for unit in units}
        costs = _charged(units, groups, lambda unit: seconds[unit.name], lambda weights: 0.0)
    assigned = partition([costs[units[i].name] for i in chain.indices], stages)
    return chain.plan(stages, assigned, cost=cost, costs=costs, seconds=seconds)


def _unit_of(model, layer) -> Unit:
    """The first call of `layer` (a layer, or a call's name) among `model`'s units."""
    units = stage_units(model)
    for unit in units:
        if unit.layer is layer or unit.name == layer:
            return unit
    name = getattr(layer, "name", layer)
    raise ValueError(f"Layer {name!r} is not called in model {model.name!r}; its layers are {[u.name for u in units]}.")


def _sample_inputs(unit, batch_size):
    """Arguments for `unit`'s call as in its graph, filled with zeros of `batch_size` rows."""
    import tensorflow as tf

    if unit.node is None:
        raise ValueError(
            f"Layer {unit.name!r} has no call recorded in a model graph, so its input shape is unknown; build the "
            "model with keras.Input(...) to balance on flops or time."
        )
    arguments = unit.node.arguments

    def zeros(kt):
        shape = [batch_size if i == 0 and d is None else (d or 1) for i, d in enumerate(kt.shape)]
        return tf.zeros(shape, dtype=kt.dtype)

    return arguments.fill_in({id(kt): zeros(kt) for kt in arguments.keras_tensors})


def layer_seconds(model, layer, batch_size: int, rounds: int = 3) -> float:
    """Median seconds of the forward and backward pass of `layer`'s (a layer, or a call's name) first call
    in `model` on a batch of zeros."""
    return _unit_seconds(_unit_of(model, layer), batch_size, rounds)


def _unit_seconds(unit, batch_size: int, rounds: int) -> float:
    import tensorflow as tf

    layer = unit.layer
    args, kwargs = _sample_inputs(unit, batch_size)
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
    """Estimated FLOPs of the forward pass of `layer`'s (a layer, or a call's name) first call in `model` on
    `batch_size` rows (matmuls, convolutions, einsums x2; other ops one per output element)."""
    return _unit_flops(_unit_of(model, layer), batch_size)


def _unit_flops(unit, batch_size: int) -> int:
    import tensorflow as tf

    args, kwargs = _sample_inputs(unit, batch_size)
    concrete = tf.function(lambda: unit.layer(*args, **kwargs)).get_concrete_function()
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
