"""The `Hook` record: one private TensorFlow/Keras internal tfdist replaces or relies on, and its probe."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
from collections.abc import Callable

import keras
import tensorflow as tf

from tfdist import errors

CHECKED_ON = {"tensorflow": "2.21", "keras": "3.15"}
# The features whose strategies run the exact data-parallel runtime (tfdist/strategies/_exact.py).
EXACT = ("data_parallel", "multi_worker", "pipeline")


class _Absent:
    """The `original` of a hook that adds an attribute its owner lacks (`ABSENT`)."""

    def __repr__(self):
        return "ABSENT"


ABSENT = _Absent()


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def versions_match() -> bool:
    """True when the installed TensorFlow and Keras are the versions the hooks were checked on."""
    return (
        _major_minor(tf.__version__) == CHECKED_ON["tensorflow"]
        and _major_minor(keras.__version__) == CHECKED_ON["keras"]
    )


def _qualified_name(obj) -> str:
    if inspect.ismodule(obj):
        return obj.__name__
    return f"{obj.__module__}.{obj.__qualname__}"


def _installed_versions() -> str:
    return (
        f"tfdist was checked on TensorFlow {CHECKED_ON['tensorflow']} and Keras {CHECKED_ON['keras']}; "
        f"installed are TensorFlow {tf.__version__} and Keras {keras.__version__}. Install the pinned versions "
        "(pip install -e .)."
    )


def require(hook: str, obj, *needles: str) -> None:
    """Raises CompatError unless the source of `obj` contains every needle."""
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError) as e:
        raise errors.CompatError(f"tfdist hook {hook!r}: cannot read the source of {obj!r}: {e}") from e
    missing = [n for n in needles if n not in source]
    if missing:
        raise errors.CompatError(
            f"tfdist hook {hook!r} no longer applies: {_qualified_name(obj)} does not "
            f"contain {missing}. {_installed_versions()}"
        )


def missing_spec_error(hook: str, what: str) -> errors.CompatError:
    """The error of a hook that found no element spec on a Keras epoch iterator."""
    return errors.CompatError(
        f"tfdist hook {hook!r}: the epoch iterator has no {what} with an element spec "
        f"(checked on Keras {CHECKED_ON['keras']}, installed {keras.__version__})."
    )


@dataclasses.dataclass(frozen=True)
class Hook:
    """One private TensorFlow/Keras internal: what tfdist checks in it, and what it replaces, for which features.

    Attributes:
        name: the hook's name, in every CompatError about it.
        probe: the TF/Keras object (function, class or module) whose source must contain `needles`:
            the code tfdist replaces or relies on, as it was on `CHECKED_ON`.
        needles: source text the probe must contain.
        features: the `tfdist._compat.install` features that need the hook.
        owner, attribute, replacement: the patch (`setattr(owner, attribute, replacement)`), or None
            for a hook that only checks code a replacement relies on.
        original: what `owner.attribute` is before the patch; anything else there (Keras overrode it
            in a subclass, another library patched it) is a CompatError. `ABSENT`: the owner has no
            such attribute, and tfdist adds it (one appearing in Keras is a CompatError).
        after: called once right after the patch is set (e.g. to re-register a function with TF's C++).
    """

    name: str
    probe: object
    needles: tuple[str, ...]
    features: frozenset[str]
    owner: object = None
    attribute: str | None = None
    replacement: Callable | None = None
    original: Callable | None = None
    after: Callable[[], None] | None = None

    def check(self) -> None:
        """Raises CompatError if the probed code changed, or the patched attribute is not the expected one."""
        require(self.name, self.probe, *self.needles)
        if self.owner is not None:
            current = getattr(self.owner, self.attribute, ABSENT)
            if current is not self.original and current is not self.replacement:
                where = f"{_qualified_name(self.owner)}.{self.attribute}"
                if self.original is ABSENT:
                    problem = f"{where} exists now, where tfdist adds it (Keras or another library defines it)"
                else:
                    problem = (
                        f"{where} is not {_qualified_name(self.original)}, the code tfdist replaces (overridden "
                        "or patched elsewhere)"
                    )
                raise errors.CompatError(
                    f"tfdist hook {self.name!r} no longer applies: {problem}. {_installed_versions()}"
                )

    @property
    def patched(self) -> bool:
        """Whether the replacement is in place (True for a check-only hook)."""
        return self.owner is None or getattr(self.owner, self.attribute, ABSENT) is self.replacement

    def apply(self) -> None:
        """Sets the replacement (idempotent)."""
        if not self.patched:
            setattr(self.owner, self.attribute, self.replacement)
            if self.after is not None:
                self.after()


def hook(name: str, probe, needles, *features: str, patch: tuple | None = None, original=None, after=None) -> Hook:
    """A `Hook`; `patch` is `(owner, attribute, replacement)`; `original` defaults to `owner.attribute` now.

    Pass `original=ABSENT` for an attribute the owner lacks and the patch adds.
    """
    if patch is None:
        return Hook(name, probe, tuple(needles), frozenset(features))
    owner, attribute, replacement = patch
    original = getattr(owner, attribute) if original is None else original
    return Hook(name, probe, tuple(needles), frozenset(features), owner, attribute, replacement, original, after)


@contextlib.contextmanager
def thread_local_scope(state: threading.local, name: str, value):
    """Sets `state.<name>` to `value` on this thread meanwhile, then restores what it was."""
    previous = getattr(state, name, None)
    setattr(state, name, value)
    try:
        yield
    finally:
        setattr(state, name, previous)
