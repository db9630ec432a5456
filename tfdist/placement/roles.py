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
* **expert**: a bank of stacked experts, as KerasHub's Mixtral, Qwen-MoE,
  Qwen3-MoE and GPT-OSS layers hold (found by shape, whatever the class): a
  layer (not a Dense, EinsumDense, Embedding or convolution) owning two or
  more rank-3 weights `[experts, in, out]` with the same number of experts
  (at least 2), the first taking the model width (`[E, h, m]`, a gate, an up
  projection or both fused) and the last bringing it back (`[E, m', h]`, `m`
  a multiple of `m'`). Its rank-3 weights and its rank-2 `[E, n]` ones (the
  experts' biases) are split over the experts; under a rule with a second
  axis (`auto(expert_axis=...)`), also over each expert's hidden units
  (experts x hidden): the in-weights' and their biases' last dimension, the
  out-weight's middle one (its bias, added after the sum, is split over the
  experts only).
* **conv**: a `Conv1D` / `Conv2D` / `Conv3D` kernel and bias, split over the
  output channels and gathered whole for each use (`layouts.conv()`'s
  layout: DTensor runs a convolution only on a whole filter). Depthwise,
  separable and transposed convolutions get no role.

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

ROLES = ("attention_in", "attention_out", "mlp_in", "mlp_out", "embedding", "lm_head", "expert", "conv")
"""The roles `tfdist.layouts.auto()` places; see the module."""

_CONVOLUTIONS = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)
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
        inner: a second dimension, split over the role rule's second axis
            when it has one (an expert's hidden units), or None.
    """

    kind: str
    dim: int | None
    description: str
    unit: str = "units"
    inner: int | None = None


@dataclasses.dataclass(frozen=True)
class RoleRule(Rule):
    """Splits the weights of one role over a mesh axis (made by `tfdist.layouts.auto()`).

    A role rule matches no path: `LayoutRules.resolve` (path rules) never
    returns it, and a path rule decides a weight before any role does. A
    dimension the axis does not divide stays whole, with a note in the
    placement report. Its spec is `(axis,)`, or `(axis, inner axis)` for a
    role that splits a second dimension (`Role.inner`) over another axis.
    """

    role: str = ""
    by_path: ClassVar[bool] = False

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"Unknown role {self.role!r}. Valid roles: {list(ROLES)}.")
        super().__post_init__()

    @classmethod
    def of(cls, role: str, axis: str, inner_axis: str | None = None) -> RoleRule:
        """The rule splitting `role`'s weights over mesh axis `axis` (and their inner dimension over `inner_axis`).

        Convolution filters are stored split and gathered whole for each use.
        """
        for name in (axis, inner_axis) if inner_axis is not None else (axis,):
            if not isinstance(name, str) or not name:
                raise ValueError(f"A role rule's axis must be a mesh axis name; got {name!r}.")
        spec = (axis,) if inner_axis is None else (axis, inner_axis)
        return cls(f"<role {role}>", spec, gather=role == "conv", role=role)

    @property
    def axis(self) -> str:
        return self.spec[0]

    def matches(self, path: str) -> bool:
        del path
        return False

    def __str__(self):
        axes = repr(self.axis) if len(self.spec) == 1 else repr(self.spec)
        return f"role {self.role!r} -> {axes}" + (" gathered for use" if self.gather else "")


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
    spec = [None] * len(shape)
    if role is None:
        return tuple(spec), None, ""
    rule = next((r for r in rules if isinstance(r, RoleRule) and r.role == role.kind), None)
    if rule is None or role.dim is None:
        return tuple(spec), rule, ""
    notes = []
    splits = [(role.dim, rule.spec[0], role.unit)]
    if role.inner is not None and len(rule.spec) > 1:
        splits.append((role.inner, rule.spec[1], "hidden units"))
    for dim, axis, unit in splits:
        size, parts = int(shape[dim]), mesh_axes[axis]
        if size % parts:
            notes.append(f"{size} {unit} are not divisible by mesh axis {axis!r} ({parts})")
        else:
            spec[dim] = axis
    note = ("kept whole: " if not any(spec) else "not split over all its axes: ") + "; ".join(notes) if notes else ""
    return tuple(spec), rule, note


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


def own_variables(layer) -> list:
    """The variables `layer` itself created (not its sublayers'), in creation order."""
    inner = {id(v) for sub in deferred_variables.sublayers(layer) for v in sub.weights}
    return [v for v in layer.weights if id(v) not in inner]


def _projection(layer) -> _Projection | None:
    if not isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
        return None
    own = {v.name: v for v in own_variables(layer)}
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
    for v in own_variables(layer):
        shape = tuple(v.shape)
        if table is None and shape == (vocabulary, width):
            table = v
            found[id(v)] = Role("embedding", 0, f"token embedding ({kind})", "vocabulary entries")
        elif shape == (width, vocabulary):
            found[id(v)] = Role("lm_head", 1, f"LM head ({kind}'s reverse embeddings)", "vocabulary entries")
    return vocabulary


def _experts(found, layer) -> None:
    """Places the expert bank `layer` holds, if it is one (see the module)."""
    if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Embedding, *_CONVOLUTIONS)):
        return
    own = own_variables(layer)
    banks = collections.defaultdict(list)
    for v in own:
        if len(v.shape) == 3:
            banks[int(v.shape[0])].append(v)
    for experts, group in banks.items():
        first, last = group[0], group[-1]
        width = int(first.shape[1])
        if (
            experts < 2
            or len(group) < 2
            or int(last.shape[2]) != width
            or any(int(v.shape[1]) != width for v in group[:-1])
            or int(first.shape[2]) % int(last.shape[1])
        ):
            continue
        where = f"{experts} experts in {type(layer).__name__}"
        hidden = {int(v.shape[2]) for v in group[:-1]}
        for v in group[:-1]:
            found[id(v)] = Role("expert", 0, f"experts' feed-forward in ({where})", "experts", inner=2)
        found[id(last)] = Role("expert", 0, f"experts' feed-forward out ({where})", "experts", inner=1)
        for v in own:
            if len(v.shape) == 2 and int(v.shape[0]) == experts:
                inner = 1 if int(v.shape[1]) in hidden else None
                found[id(v)] = Role("expert", 0, f"experts' biases ({where})", "experts", inner=inner)


def _convolution(found, layer) -> None:
    """Places a convolution's kernel and bias over its output channels."""
    if not isinstance(layer, _CONVOLUTIONS):
        return
    own = {v.name: v for v in own_variables(layer)}
    kernel, bias = own.get("kernel"), own.get("bias")
    if kernel is None:
        return
    kind = type(layer).__name__
    found[id(kernel)] = Role("conv", len(kernel.shape) - 1, f"convolution filters ({kind})", "output channels")
    if bias is not None:
        found[id(bias)] = Role("conv", 0, f"convolution bias ({kind})", "output channels")


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
        _convolution(found, layer)
        projections = [p for p in map(_projection, deferred_variables.sublayers(layer)) if p is not None]
        if _is_attention(layer, projections):
            _attention(found, layer, projections)
        else:
            _experts(found, layer)
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
