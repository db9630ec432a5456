"""Layout rules: which dimensions of which variable are split over which mesh axis.

A rule pairs a regular expression on a variable's Keras path (such as
`"block_0/mlp_in/kernel"`) with a sharding spec: one entry per dimension of
the variable, each a mesh axis name (split that dimension over the axis) or
`None` (keep it whole). A spec may start with `...` to leave all leading
dimensions whole, so `(..., "model")` splits the last dimension of a variable
of any rank.

Rules are ordered; a variable matched by no rule is replicated, and a variable
matched by two rules is an error (so adding a rule never silently changes
another's meaning).

A `keras.distribution.LayoutMap` is accepted wherever rules are, with Keras'
own matching kept for its keys (see `LayoutRules`): a key must match the whole
path (`re.fullmatch`, where tfdist's patterns are searched), and a key equal to
the path wins over keys that match it as a regex.

A weight of a subclassed model also has an *attribute path*: the chain of
attribute names from the model to the layer that owns it, then the weight's
name (`"feature/kernel"` for `self.feature = Dense(...)`; a list element adds
its index, `"blocks/0/kernel"`), as tf_keras' LayoutMap matched a subclassed
model's weights (tfdist/placement/attributes.py). Rules match the Keras path
first: a rule matching it decides, whatever rules match the attribute path;
only when no rule matches the Keras path are the rules tried on the attribute
path. On either path, two matching rules are an error, as above.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable
from collections.abc import Mapping
from collections.abc import Sequence
from typing import ClassVar

Spec = tuple  # of str | None, optionally starting with Ellipsis
# A pattern whose last path component is "output": Keras' key for a layer's output (activation) layout.
_ACTIVATION = re.compile(r"(^|/)output\$?$")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One layout rule: a regex searched in the variable path, and a sharding spec.

    Args:
        pattern: a regular expression, searched (`re.search`) in the path.
        spec: per-dimension mesh axis names or None, optionally starting with
            `...` (leading dimensions unsharded).
        gather: store the variable (and its optimizer slots) split as `spec`
            says, but gather it whole for each use in the forward pass (as
            FSDP / ZeRO-3 do). For ops DTensor cannot run on a split operand,
            such as a convolution's filter.
        fullmatch: the pattern must match the whole path (a Keras `LayoutMap`
            key's semantics) instead of being searched in it.
    """

    pattern: str
    spec: Spec
    gather: bool = False
    fullmatch: bool = False

    def __post_init__(self):
        if not isinstance(self.pattern, str) or not self.pattern:
            raise ValueError(f"A layout rule's pattern must be a non-empty regex string; got {self.pattern!r}.")
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ValueError(f"Layout rule {self.pattern!r} is not a valid regular expression: {e}.") from e
        spec = self.spec
        if isinstance(spec, (str, bytes)) or not isinstance(spec, Sequence):
            raise ValueError(
                f"Layout rule {self.pattern!r}: the spec must be a tuple with one mesh axis name or None "
                f'per dimension, e.g. (None, "model"); got {spec!r}.'
            )
        spec = tuple(spec)
        body = spec[1:] if spec and spec[0] is Ellipsis else spec
        for entry in body:
            if entry is not None and not isinstance(entry, str):
                raise ValueError(
                    f"Layout rule {self.pattern!r}: spec entries are mesh axis names or None "
                    f"(`...` only first); got {entry!r} in {spec!r}."
                )
        axes = [a for a in body if a is not None]
        repeated = sorted({a for a in axes if axes.count(a) > 1})
        if repeated:
            raise ValueError(
                f"Layout rule {self.pattern!r}: mesh axis {repeated[0]!r} appears twice in spec {spec!r}; "
                "a mesh axis can split at most one dimension of a variable."
            )
        if _ACTIVATION.search(self.pattern):
            raise ValueError(
                f"Layout rule {self.pattern!r} names a layer's output (an activation layout, as a Keras LayoutMap's "
                '"<layer>/output" key does); layout rules place weights only. Activations take the layout DTensor '
                "derives from the weights and the batch (split over the mesh's batch axis), so no rule is needed. "
                "Remove the rule, or match weight paths such as 'd2/kernel$'."
            )
        object.__setattr__(self, "spec", spec)

    # False for rules that place weights by role, not by path (tfdist/placement/roles.py): they match no path.
    by_path: ClassVar[bool] = True

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes this rule uses."""
        return tuple(a for a in self.spec if isinstance(a, str))

    def matches(self, path: str) -> bool:
        if self.fullmatch:
            return self.pattern == path or re.fullmatch(self.pattern, path) is not None
        return re.search(self.pattern, path) is not None

    def expand(self, rank: int) -> tuple | None:
        """The spec for a variable of `rank` dimensions, or None when the ranks disagree."""
        if self.spec and self.spec[0] is Ellipsis:
            body = self.spec[1:]
            return (None,) * (rank - len(body)) + body if len(body) <= rank else None
        return self.spec if len(self.spec) == rank else None

    def __str__(self):
        shown = ", ".join("..." if a is Ellipsis else repr(a) for a in self.spec)
        name = f"LayoutMap key {self.pattern!r}" if self.fullmatch else repr(self.pattern)
        return f"{name} -> ({shown})" + (" gathered for use" if self.gather else "")


class LayoutRules:
    """An ordered list of layout rules (regex on the variable path -> sharding spec).

    Args:
        rules: `(pattern, spec)` pairs, `Rule`s, another `LayoutRules`, a
            dict `{pattern: spec}`, or a `keras.distribution.LayoutMap`.

    A `LayoutMap` keeps Keras' semantics: each key is a regex that must match
    the whole variable path (`re.fullmatch`; tfdist's own patterns are searched,
    `re.search`), and a key equal to the path wins over other keys matching it
    (tfdist refuses a path two rules match). Its `TensorLayout` values (or axis
    tuples) become specs; keys naming a layer's output (`"d2/output"`, an
    activation layout) are kept in `activation_keys` and place nothing:
    activations take the layout DTensor derives from the weights and the batch
    (under a Keras `ModelParallel` set after `tfdist.use_keras_distribution()`,
    Keras' layer call relayouts them).
    The map's `DeviceMesh` is kept as `mesh` (axis name -> size), which a
    strategy given no mesh adopts and otherwise checks against its own.

    Raises:
        ValueError: for an invalid regex or spec, a pattern given twice, or a
            LayoutMap whose `TensorLayout`s name another mesh.

    Example:

    >>> from tfdist.layouts import LayoutRules
    >>> rules = LayoutRules([(r"mlp_in/kernel$", (None, "model")), (r"mlp_in/bias$", ("model",))])
    >>> rules.spec_for("block/mlp_in/kernel", (16, 64), {"batch": 2, "model": 4})
    (None, 'model')
    >>> rules.spec_for("block/norm/gamma", (16,), {"batch": 2, "model": 4})
    (None,)
    >>> (rules + LayoutRules([(r"logits/kernel$", (None, "model"))])).patterns[-1]
    'logits/kernel$'
    """

    def __init__(self, rules: Iterable | Mapping = ()):
        self.mesh: dict[str, int] | None = None
        self.activation_keys: tuple[str, ...] = ()
        if _is_layout_map(rules):
            items, self.mesh, self.activation_keys = _from_layout_map(rules)
        elif isinstance(rules, LayoutRules):
            items = list(rules.rules)
            self.mesh, self.activation_keys = rules.mesh, rules.activation_keys
        elif isinstance(rules, Mapping):
            items = list(rules.items())
        elif isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
            raise ValueError(
                f"Invalid layout rules {rules!r}. Expected a list of (regex, spec) pairs, "
                'e.g. [(r"mlp_in/kernel$", (None, "model"))].'
            )
        else:
            items = list(rules)
        parsed = []
        for item in items:
            if isinstance(item, Rule):
                parsed.append(item)
            elif isinstance(item, Sequence) and not isinstance(item, str) and len(item) == 2:
                parsed.append(Rule(item[0], item[1]))
            else:
                raise ValueError(f"Invalid layout rule {item!r}. Expected a (regex, spec) pair.")
        patterns = [r.pattern for r in parsed]
        repeated = sorted({p for p in patterns if patterns.count(p) > 1})
        if repeated:
            raise ValueError(f"Layout rule pattern {repeated[0]!r} is given twice; keep one.")
        self.rules: tuple[Rule, ...] = tuple(parsed)

    @property
    def patterns(self) -> list[str]:
        return [r.pattern for r in self.rules]

    @property
    def axes(self) -> set[str]:
        """Every mesh axis named by some rule."""
        return {a for r in self.rules for a in r.axes}

    def __iter__(self):
        return iter(self.rules)

    def __len__(self):
        return len(self.rules)

    def __add__(self, other) -> LayoutRules:
        other = LayoutRules(other)
        if self.mesh is not None and other.mesh is not None and self.mesh != other.mesh:
            raise ValueError(
                f"Cannot combine layout rules for the mesh {self.mesh!r} with a LayoutMap for the mesh {other.mesh!r}."
            )
        combined = LayoutRules(list(self.rules) + list(other.rules))
        combined.mesh = self.mesh if self.mesh is not None else other.mesh
        combined.activation_keys = self.activation_keys + other.activation_keys
        return combined

    def __eq__(self, other):
        return isinstance(other, LayoutRules) and self.rules == other.rules

    def __repr__(self):
        return "LayoutRules([" + ", ".join(f"({r.pattern!r}, {r.spec!r})" for r in self.rules) + "])"

    def check_axes(self, mesh_axes: Mapping[str, int]) -> None:
        """Raises ValueError naming the rule when a rule uses an axis that `mesh_axes` lacks."""
        for rule in self.rules:
            unknown = [a for a in rule.axes if a not in mesh_axes]
            if unknown:
                raise ValueError(
                    f"Layout rule {rule} uses mesh axis {unknown[0]!r}, which the mesh {dict(mesh_axes)!r} "
                    f"does not have. Valid axes: {list(mesh_axes)}."
                )

    def rule_for(self, path: str, attribute_path: str | None = None) -> Rule | None:
        """The one rule matching `path` (else `attribute_path`, see the module), or None.

        Raises:
            ValueError: if two or more rules match the path that decides, naming them.
        """
        return self.match(path, attribute_path)[0]

    def match(self, path: str, attribute_path: str | None = None) -> tuple[Rule | None, str]:
        """The rule deciding a weight and the path it matched: its Keras `path`, else its `attribute_path`.

        Returns `(None, "")` when no rule matches either path.

        Raises:
            ValueError: if two or more rules match the path that decides, naming them.

        Example:

        >>> rules = LayoutRules([(r"feature.*kernel", (None, "model"))])
        >>> rules.match("subclassed_model/dense/kernel", "feature/kernel")[1]
        'feature/kernel'
        """
        for candidate in [path] + ([attribute_path] if attribute_path and attribute_path != path else []):
            found = [r for r in self.rules if r.matches(candidate)]
            if len(found) > 1:
                # A LayoutMap key equal to the path wins, as in `keras.distribution.LayoutMap`.
                exact = [r for r in found if r.fullmatch and r.pattern == candidate]
                if exact:
                    return exact[0], candidate
                which = f"Variable {path!r}" + (f" (attribute path {candidate!r})" if candidate != path else "")
                raise ValueError(
                    f"{which} matches {len(found)} layout rules: "
                    + "; ".join(str(r) for r in found)
                    + ". Make the patterns exclusive (anchor them, e.g. with '/kernel$') so one rule decides."
                )
            if found:
                return found[0], candidate
        return None, ""

    def spec_for(self, path: str, shape: Sequence[int], mesh_axes: Mapping[str, int]) -> tuple:
        """The sharding spec (one axis name or None per dimension) of a variable.

        See `resolve`, which also returns the deciding rule.
        """
        return self.resolve(path, shape, mesh_axes)[0]

    def resolve(
        self, path: str, shape: Sequence[int], mesh_axes: Mapping[str, int], *, attribute_path: str | None = None
    ) -> tuple[tuple, Rule | None]:
        """The sharding spec of a variable and the rule that decided it (None: replicated, no rule).

        Args:
            path: the variable's Keras path, e.g. "block_0/mlp_in/kernel".
            shape: its (global) shape.
            mesh_axes: the mesh's axis name -> size.
            attribute_path: its attribute path in a subclassed model (e.g.
                "feature/kernel"), matched when no rule matches `path`.

        Raises:
            ValueError: when two rules match, or the matching rule's spec has
                another rank, names an axis the mesh lacks, or splits a
                dimension that its mesh axis does not divide.
        """
        shape = tuple(int(d) for d in shape)
        rule, matched = self.match(path, attribute_path)
        if rule is None:
            return (None,) * len(shape), None
        if matched != path:
            path = f"{path} (attribute path {matched})"
        spec = rule.expand(len(shape))
        if spec is None:
            raise ValueError(
                f"Layout rule {rule} has {len([a for a in rule.spec if a is not Ellipsis])} entries but "
                f"variable {path!r} has shape {shape} (rank {len(shape)}). Give one entry per dimension, "
                "start the spec with ... to skip leading dimensions, or narrow the pattern."
            )
        for dim, (axis, size) in enumerate(zip(spec, shape)):
            if axis is None:
                continue
            if axis not in mesh_axes:
                raise ValueError(
                    f"Layout rule {rule} (matching {path!r}) uses mesh axis {axis!r}, which the mesh "
                    f"{dict(mesh_axes)!r} does not have. Valid axes: {list(mesh_axes)}."
                )
            if size % mesh_axes[axis]:
                raise ValueError(
                    f"Variable {path!r} of shape {shape}: dimension {dim} (size {size}) is not divisible by "
                    f"mesh axis {axis!r} (size {mesh_axes[axis]}), as layout rule {rule} asks. Choose a size "
                    f"divisible by {mesh_axes[axis]}, another mesh, or a rule that keeps dimension {dim} whole."
                )
        return spec, rule

    def unmatched(self, paths: Iterable[str], attribute_paths: Iterable[str] = ()) -> list[tuple[Rule, list[str]]]:
        """The path rules matching none of `paths` nor `attribute_paths`, each with similar paths (near misses).

        Up to 3 near misses among the Keras `paths`, then up to 3 among the
        `attribute_paths` (of a subclassed model's weights).
        """
        paths, attribute_paths = list(paths), list(attribute_paths)
        out = []
        for rule in self.rules:
            if not rule.by_path or any(rule.matches(p) for p in paths + attribute_paths):
                continue
            # The pattern's literal pieces: "feature.*kernel" -> ["feature", "kernel"].
            pieces = [p for p in re.split(r"\\.|[\^$()\[\]|?*+{}.]", rule.pattern) if p]
            near = []
            for candidates in (paths, attribute_paths):
                close = difflib.get_close_matches("".join(pieces), candidates, n=3, cutoff=0.4)
                if not close and pieces:
                    tail = pieces[-1].split("/")[-1]
                    close = [p for p in candidates if tail and tail in p][:3]
                near += [p for p in close if p not in near]
            out.append((rule, near))
        return out


def _is_layout_map(value) -> bool:
    """Whether `value` is a `keras.distribution.LayoutMap` (Keras imported only when it could be one)."""
    if isinstance(value, (LayoutRules, str, bytes, list, tuple, dict)):
        return False
    from keras import distribution

    return isinstance(value, distribution.LayoutMap)


def device_mesh_axes(device_mesh) -> dict[str, int]:
    """A `keras.distribution.DeviceMesh`'s axis name -> size."""
    return {str(a): int(n) for a, n in zip(device_mesh.axis_names, device_mesh.shape)}


def _from_layout_map(layout_map) -> tuple[list[Rule], dict[str, int] | None, tuple[str, ...]]:
    """A `keras.distribution.LayoutMap` as (rules, mesh axis name -> size, activation keys)."""
    mesh = device_mesh_axes(layout_map.device_mesh) if layout_map.device_mesh is not None else None
    rules, activations = [], []
    for key, layout in layout_map.items():
        if layout is None:
            continue
        layout_mesh = getattr(layout, "device_mesh", None)
        if layout_mesh is not None and mesh is not None and device_mesh_axes(layout_mesh) != mesh:
            raise ValueError(
                f"LayoutMap key {key!r}: its TensorLayout is on the mesh {device_mesh_axes(layout_mesh)!r}, but the "
                f"LayoutMap's DeviceMesh is {mesh!r}. Give every TensorLayout the LayoutMap's mesh (or none)."
            )
        if _ACTIVATION.search(key):
            activations.append(key)
            continue
        axes = getattr(layout, "axes", layout)
        try:
            spec = tuple(None if a is None else str(a) for a in axes)
        except TypeError:
            raise ValueError(
                f"LayoutMap key {key!r}: expected a keras.distribution.TensorLayout or a tuple of mesh axis names "
                f"and None; got {layout!r}."
            ) from None
        rules.append(Rule(key, spec, fullmatch=True))
    return rules, mesh, tuple(activations)
