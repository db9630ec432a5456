"""`PlacementReport`: where each variable of a model lives on a mesh, and the bytes on each device."""

from __future__ import annotations

import dataclasses

_ON_ATTRIBUTE_PATH = " on attribute path "


def chosen_by_rule(rule, path: str, attribute_path: str | None) -> str:
    """The report's "chosen by" for a path rule (None: ""), naming the attribute path when that is what it matched.

    Example:

    >>> from tfdist.placement.rules import Rule
    >>> chosen_by_rule(Rule("feature.*kernel", ("batch", None)), "subclassed_model/dense/kernel", "feature/kernel")
    "rule 'feature.*kernel' -> ('batch', None) on attribute path 'feature/kernel'"
    """
    if rule is None:
        return ""
    if rule.matches(path) or not attribute_path:
        return f"rule {rule}"
    return f"rule {rule}{_ON_ATTRIBUTE_PATH}{attribute_path!r}"


def unmatched_rule_lines(unmatched) -> list[str]:
    """One line per `(rule, similar paths)` of `LayoutRules.unmatched`.

    Example:

    >>> from tfdist.placement.rules import Rule
    >>> unmatched_rule_lines([(Rule("feature.*kernel", (None, "model")), ["sub/dense/kernel"])])
    ["rule 'feature.*kernel' -> (None, 'model') matched no variable; similar paths: sub/dense/kernel"]
    """
    return [f"rule {rule} matched no variable; similar paths: {', '.join(near) or 'none'}" for rule, near in unmatched]


@dataclasses.dataclass(frozen=True)
class VariablePlacement:
    """Where one variable lives: its path, global shape, per-dimension spec and bytes.

    `gathered`: stored split, read in another layout in each step. `note`: under
    sharded data parallelism, the dimension the data axis splits, or why the
    variable stays replicated over it; for a role (`tfdist.layouts.auto()`)
    whose dimension the mesh axis does not divide, why it stays whole.
    `chosen_by`: the path rule ("rule 'mlp_in/kernel$' -> (..., 'model')") or
    role ("attention query (EinsumDense in CachedMultiHeadAttention)") that
    chose the layout, "" when none did (replicated); optimizer slots give their
    variable's. A rule that matched the weight's attribute path in a subclassed
    model, not its Keras path, is named with it ("rule 'feature.*kernel' ->
    ('batch', None) on attribute path 'feature/kernel'").
    """

    path: str
    shape: tuple
    dtype: str
    spec: tuple
    bytes_total: int
    bytes_per_device: int
    gathered: bool = False
    note: str = ""
    chosen_by: str = ""


@dataclasses.dataclass(frozen=True)
class PlacementReport:
    """`ModelParallelStrategy.placement_report`'s result.

    Attributes:
        mesh: axis name -> size.
        variables: one `VariablePlacement` per variable (model weights, then
            optimizer state), in the model's order.
        bytes_per_device: device name -> bytes of all variables it holds.
        unmatched_rules: `(rule, near misses)` for each rule that matched no
            variable of the model.
        misplaced: `(path, spec the rules give, spec it has)` for each model
            variable whose layout is not what the rules give its path (it was
            created under another path, or under another strategy's rules).
    """

    mesh: dict
    variables: tuple
    bytes_per_device: dict
    unmatched_rules: tuple
    misplaced: tuple = ()

    @property
    def bytes_total(self) -> int:
        """Bytes of all variables, counted once (as on one device)."""
        return sum(v.bytes_total for v in self.variables)

    def table(self) -> str:
        """The report as a text table.

        A "note" column appears when a variable has a note, a "chosen by"
        column when roles placed some variable (`tfdist.layouts.auto()`) or a
        rule matched some variable by its attribute path.
        """
        notes = any(v.note for v in self.variables)
        chosen = any(
            v.chosen_by and (not v.chosen_by.startswith("rule ") or _ON_ATTRIBUTE_PATH in v.chosen_by)
            for v in self.variables
        )
        extra = (("note",) if notes else ()) + (("chosen by",) if chosen else ())
        rows = [("path", "shape", "layout", "bytes total", "bytes/device") + extra]
        for v in self.variables:
            layout = (
                "(" + ", ".join("-" if a is None else a for a in v.spec) + ")" + (" gathered" if v.gathered else "")
            )
            row = (v.path, str(list(v.shape)), layout, f"{v.bytes_total:,}", f"{v.bytes_per_device:,}")
            rows.append(row + ((v.note,) if notes else ()) + ((v.chosen_by,) if chosen else ()))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [
            "  ".join(c.rjust(w) if i in (3, 4) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows
        ]
        lines.insert(1, "-" * len(lines[0]))
        per_device = set(self.bytes_per_device.values())
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
        if len(per_device) == 1:
            lines.append(
                f"mesh {mesh}: {len(self.variables)} variables, {self.bytes_total:,} bytes in all, "
                f"{per_device.pop():,} bytes on each of {len(self.bytes_per_device)} devices"
            )
        else:
            lines.append(f"mesh {mesh}: bytes per device {self.bytes_per_device}")
        lines.extend(self.problems())
        return "\n".join(lines)

    def problems(self) -> list[str]:
        """One line per rule that matched nothing and per misplaced variable."""
        lines = unmatched_rule_lines(self.unmatched_rules)
        lines += [
            f"variable {path!r} has layout {actual} but the rules give its path {expected}"
            for path, expected, actual in self.misplaced
        ]
        return lines


