"""Roles: what each weight of a transformer does, found from layer types and how the layers fit together.

`tfdist.layouts.auto()` places weights by role instead of by name, so that one
preset fits models whose layers are named differently (KerasHub's GPT-2, Llama,
Gemma and BERT backbones, `tfdist.models`, a user's own blocks). A role is found
from the model's structure, never from a layer's name:

* **attention**: a layer that is a Keras `MultiHeadAttention`, a class whose name
  (or a base class's) ends in "Attention" (KerasHub's `CachedMultiHeadAttention`,
  `LlamaAttention`, `CachedGemmaAttention`), or any layer with an `EinsumDense`
  that splits its input into heads and one that merges heads back. Its own
  `Dense` / `EinsumDense` sublayers are its projections: those that split into
  heads (an einsum with two output axes of its kernel, heads and head size) are
  the query, key and value projections, in the order they were created, split
  over the heads (column-parallel); the one that merges heads is the output
  projection, split over the heads it sums (row-parallel). Projections without
  head axes (plain `Dense`): the last one is the output projection.
* **feed-forward**: among the `Dense` / `EinsumDense` sublayers of any other
  layer, in creation order, the last one whose input width is the output width
  of earlier ones that take its output width as input (width -> hidden ->
  width: the second feeds on the first's output) is the feed-forward output
  (row-parallel, over its input units); those earlier ones are its inputs
  (column-parallel over their output units; two of them for a gated unit, as
  Llama's gate and up projections or Gemma's `ffw_gating` and `ffw_gating_2`).
* **embedding**: a Keras `Embedding` (KerasHub's `ReversibleEmbedding` too)
  splits its table over the vocabulary.
* **LM head**: the reverse embeddings of an untied `ReversibleEmbedding`, or a
  `Dense` / `EinsumDense` (not otherwise placed) whose output width is the
  vocabulary of the largest embedding seen before it: split over the
  vocabulary.

Row-parallel biases stay whole (they are added after the sum); layer norms,
position embeddings and anything else without a role stay replicated.

Roles are found for the whole block: under a strategy with role rules, the
variables a layer's build creates are created when the outermost build ends
(tfdist/_compat/deferred_variables.py), so the finder sees every sublayer of
the block (KerasHub builds a block's sublayers one after another).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import threading
import weakref
from typing import ClassVar

import keras

from tfdist._compat import deferred_variables
from tfdist.placement.rules import Rule

ROLES = ("attention_in", "attention_out", "mlp_in", "mlp_out", "embedding", "lm_head")
"""The roles `tfdist.layouts.auto()` places; see the module."""

_EQUATION = re.compile(r"([a-zA-Z.]+),([a-zA-Z.]+)->([a-zA-Z.]+)")


@dataclasses.dataclass(frozen=True)
class Role:
    """What one weight does: its role (one of `ROLES`), the dimension that role splits, and a description.

    Attributes:
        kind: one of `ROLES`.
        dim: the dimension to split (heads, hidden units or vocabulary), or
            None for a weight of the role that stays whole (a row-parallel bias).
        description: for the placement report, e.g. "attention query
            (EinsumDense in CachedMultiHeadAttention)".
        unit: what the split dimension counts ("heads", "units", "vocabulary
            entries"), for the note when the mesh axis does not divide it.
    """

    kind: str
    dim: int | None
    description: str
    unit: str = "units"


@dataclasses.dataclass(frozen=True)
class RoleRule(Rule):
    """Splits the weights of one role over a mesh axis (made by `tfdist.layouts.auto()`).

    A role rule matches no path: `LayoutRules.resolve` (path rules) never
    returns it, and a path rule decides a weight before any role does. A
    dimension the axis does not divide stays whole, with a note in the
    placement report.
    """

    role: str = ""
    by_path: ClassVar[bool] = False

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"Unknown role {self.role!r}. Valid roles: {list(ROLES)}.")
        super().__post_init__()

    @classmethod
    def of(cls, role: str, axis: str) -> RoleRule:
        """The rule splitting `role`'s weights over mesh axis `axis`."""
        if not isinstance(axis, str) or not axis:
            raise ValueError(f"A role rule's axis must be a mesh axis name; got {axis!r}.")
        return cls(f"<role {role}>", (axis,), role=role)

    @property
    def axis(self) -> str:
        return self.spec[0]

    def matches(self, path: str) -> bool:
        del path
        return False

    def __str__(self):
        return f"role {self.role!r} -> {self.axis!r}"


def resolve(rules, role: Role | None, shape, mesh_axes) -> tuple[tuple, RoleRule | None, str]:
    """The spec `role` gives a weight of `shape` under `rules`, the role rule that gave it, and a note.

    Returns the whole spec and no rule when `rules` has no rule for the role;
    the whole spec, the rule and a note saying why when the rule's axis does
    not divide the role's dimension.

    Example:

    >>> rules = [RoleRule.of("attention_in", "model")]
    >>> role = Role("attention_in", 1, "attention query", "heads")
    >>> resolve(rules, role, (16, 8, 4), {"model": 4})[0]
    (None, 'model', None)
    >>> resolve(rules, role, (16, 2, 4), {"model": 4})[2]
    "kept whole: 2 heads are not divisible by mesh axis 'model' (4)"
    """
    whole = (None,) * len(shape)
    if role is None:
        return whole, None, ""
    rule = next((r for r in rules if isinstance(r, RoleRule) and r.role == role.kind), None)
    if rule is None or role.dim is None:
        return whole, rule, ""
    size, parts = int(shape[role.dim]), mesh_axes[rule.axis]
    if size % parts:
        return whole, rule, f"kept whole: {size} {role.unit} are not divisible by mesh axis {rule.axis!r} ({parts})"
    return whole[: role.dim] + (rule.axis,) + whole[role.dim + 1 :], rule, ""


def uses_roles(rules) -> bool:
    """Whether `rules` (a LayoutRules or a list of rules) has a role rule."""
    return any(isinstance(r, RoleRule) for r in rules)


# ---------------------------------------------------------------------------- finding roles
@dataclasses.dataclass(frozen=True)
class _Projection:
    """A Dense / EinsumDense layer's kernel and bias, and which kernel dimensions its input and output span."""

    layer: object
    kernel: object
    bias: object
    in_dims: tuple  # kernel dimensions summed over (input axes), in the input's order
    out_dims: tuple  # kernel dimensions that make output axes, in the output's order
    bias_dims: dict  # kernel dimension -> the bias dimension of the same output axis

    @property
    def in_width(self) -> int:
        return math.prod(self.kernel.shape[d] for d in self.in_dims)

    @property
    def out_width(self) -> int:
        return math.prod(self.kernel.shape[d] for d in self.out_dims)

    @property
    def splits_heads(self) -> bool:
        return len(self.out_dims) >= 2 and len(self.in_dims) == 1

    @property
    def merges_heads(self) -> bool:
        return len(self.in_dims) >= 2 and len(self.out_dims) == 1

    @property
    def kind(self) -> str:
        return type(self.layer).__name__


def _own_variables(layer) -> list:
    """The variables `layer` itself created (not its sublayers'), in creation order."""
    inner = {id(v) for sub in deferred_variables.sublayers(layer) for v in sub.weights}
    return [v for v in layer.weights if id(v) not in inner]


def _projection(layer) -> _Projection | None:
    if not isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
        return None
    own = {v.name: v for v in _own_variables(layer)}
    kernel, bias = own.get("kernel"), own.get("bias")
    if kernel is None:
        return None
    if isinstance(layer, keras.layers.Dense):
        if len(kernel.shape) != 2:
            return None
        return _Projection(layer, kernel, bias, (0,), (1,), {1: 0} if bias is not None else {})
    match = _EQUATION.fullmatch(layer.equation.replace(" ", ""))
    if match is None:
        return None
    inputs, weights, outputs = (part.replace("...", "") for part in match.groups())
    if len(weights) != len(kernel.shape):
        return None
    summed = [c for c in inputs if c in weights and c not in outputs]
    made = [c for c in outputs if c in weights and c not in inputs]
    bias_dims = {}
    bias_axes = getattr(layer, "bias_axes", None) or ""
    if bias is not None and bias_axes:
        bias_letters = outputs[min(outputs.find(c) for c in bias_axes) :]
        if len(bias_letters) == len(bias.shape):
            bias_dims = {weights.index(c): bias_letters.index(c) for c in made if c in bias_axes}
    return _Projection(
        layer, kernel, bias, tuple(weights.index(c) for c in summed), tuple(weights.index(c) for c in made), bias_dims
    )


def _is_attention(layer, projections) -> bool:
    if isinstance(layer, keras.layers.MultiHeadAttention):
        return True
    if any(cls.__name__.endswith("Attention") for cls in type(layer).__mro__):
        return True
    return any(p.splits_heads for p in projections) and any(p.merges_heads for p in projections)


def _input_names(count: int) -> list[str]:
    if count == 3:
        return ["query", "key", "value"]
    if count == 2:
        return ["query", "key/value"]
    if count == 1:
        return ["query/key/value"]
    return [f"input projection {i + 1} of {count}" for i in range(count)]


def _column(found, p, kind, what, unit):
    """`p` split over its first output axis (its bias too, where it has that axis)."""
    dim = p.out_dims[0]
    found[id(p.kernel)] = Role(kind, dim, what, unit)
    if p.bias is not None:
        bias_dim = p.bias_dims.get(dim)
        found[id(p.bias)] = Role(kind, bias_dim, what.replace(" (", " bias (", 1), unit)


def _row(found, p, kind, what, unit):
    """`p` split over its first input axis; its bias whole (added after the sum)."""
    found[id(p.kernel)] = Role(kind, p.in_dims[0], what, unit)
    if p.bias is not None:
        found[id(p.bias)] = Role(kind, None, what.replace(" (", " bias (", 1) + ": whole, added after the sum")


def _attention(found, layer, projections) -> None:
    where = f"in {type(layer).__name__}"
    ins = [p for p in projections if p.splits_heads]
    outs = [p for p in projections if p.merges_heads]
    flat = [p for p in projections if not (p.splits_heads or p.merges_heads)]
    if flat and not outs and len(projections) > 1:
        outs.append(flat.pop())
    order = {id(p): i for i, p in enumerate(projections)}
    ins = sorted(ins + flat, key=lambda p: order[id(p)])
    for name, p in zip(_input_names(len(ins)), ins):
        unit = "heads" if p.splits_heads else "units"
        _column(found, p, "attention_in", f"attention {name} ({p.kind} {where})", unit)
    for p in outs:
        unit = "heads" if p.merges_heads else "units"
        _row(found, p, "attention_out", f"attention output ({p.kind} {where})", unit)


def _feed_forward(found, layer, projections) -> list:
    """Places the feed-forward units among `projections`; returns the projections left."""
    where = f"in {type(layer).__name__}"
    used = set()
    for j in reversed(range(len(projections))):
        if j in used:
            continue
        out = projections[j]
        ins = [
            i
            for i in range(j)
            if i not in used
            and projections[i].out_width == out.in_width
            and projections[i].in_width == out.out_width
        ]
        if not ins:
            continue
        used.update([j, *ins])
        for n, i in enumerate(ins):
            p = projections[i]
            which = f" {n + 1} of {len(ins)}, gated" if len(ins) > 1 else ""
            _column(found, p, "mlp_in", f"feed-forward in{which} ({p.kind} {where}; feeds {out.layer.name})", "units")
        _row(found, out, "mlp_out", f"feed-forward out ({out.kind} {where})", "units")
    return [p for i, p in enumerate(projections) if i not in used]


def _embedding(found, layer) -> int:
    """Places an Embedding's table (and untied reverse embeddings); returns its vocabulary size."""
    vocabulary, width = layer.input_dim, layer.output_dim
    kind = type(layer).__name__
    table = None
    for v in _own_variables(layer):
        shape = tuple(v.shape)
        if table is None and shape == (vocabulary, width):
            table = v
            found[id(v)] = Role("embedding", 0, f"token embedding ({kind})", "vocabulary entries")
        elif shape == (width, vocabulary):
            found[id(v)] = Role("lm_head", 1, f"LM head ({kind}'s reverse embeddings)", "vocabulary entries")
    return vocabulary


def find_roles(root, vocabulary: int = 0) -> tuple[dict, int]:
    """The roles of the weights of `root` and its sublayers: `({id(variable): Role}, vocabulary)`.

    `vocabulary` is the largest embedding's vocabulary seen before (an LM head
    built apart from its embedding, as in a functional model); the largest one
    including `root`'s comes back.

    Example:

    >>> import keras
    >>> block = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8)
    >>> block.build((2, 6, 32), (2, 6, 32))
    >>> found, _ = find_roles(block)
    >>> [(w.path, found[id(w)].dim) for w in block.weights if w.name == "kernel"]
    [('multi_head_attention/query/kernel', 1), ('multi_head_attention/key/kernel', 1), \
('multi_head_attention/value/kernel', 1), ('multi_head_attention/attention_output/kernel', 0)]
    >>> found[id(block.weights[0])].description
    'attention query (EinsumDense in MultiHeadAttention)'
    """
    layers, pending = [], collections.deque([root])
    while pending:
        layer = pending.popleft()
        layers.append(layer)
        pending.extend(deferred_variables.sublayers(layer))
    found = {}
    for layer in layers:
        if isinstance(layer, keras.layers.Embedding):
            vocabulary = max(vocabulary, _embedding(found, layer))
    left = []
    for layer in layers:
        projections = [p for p in map(_projection, deferred_variables.sublayers(layer)) if p is not None]
        if _is_attention(layer, projections):
            _attention(found, layer, projections)
        else:
            left.extend(_feed_forward(found, layer, projections))
    alone = _projection(root)
    if alone is not None:
        left.append(alone)  # a projection built on its own (a functional model's head)
    for p in left:
        if vocabulary and len(p.out_dims) == 1 and p.out_width == vocabulary:
            what = f"LM head ({p.kind} onto the {vocabulary}-entry vocabulary of an embedding)"
            _column(found, p, "lm_head", what, "vocabulary entries")
    return found, vocabulary


class RoleFinder:
    """The roles of the variables of the layers it was shown, remembered per variable (thread-safe).

    One per strategy: it also remembers the largest embedding vocabulary it
    has seen, for LM heads built after their embedding.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._roles = {}  # id(variable) -> (weak reference to it, Role or None)
        self._vocabulary = 0

    def find(self, root) -> None:
        """Finds the roles of `root`'s weights (every weight of its tree gets one, or None)."""
        with self._lock:
            found, self._vocabulary = find_roles(root, self._vocabulary)
            for v in root.weights:
                self._roles[id(v)] = (weakref.ref(v), found.get(id(v)))

    def role_of(self, variable) -> Role | None:
        """`variable`'s role, finding the roles of the layer being built first if it was not shown yet."""
        if variable is None:
            return None
        role = self._known(variable)
        if role is False:
            root = deferred_variables.building_root()
            if root is None:
                return None
            self.find(root)
            role = self._known(variable)
        return role or None

    def _known(self, variable):
        """Its role or None when known, False when not."""
        with self._lock:
            entry = self._roles.get(id(variable))
        if entry is None or entry[0]() is not variable:
            return False
        return entry[1]
