"""Attribute paths: where a weight sits in a subclassed model, by the attribute names that hold it.

Keras 3 names a weight by the layers' names (`"subclassed_model/dense/kernel"`);
tf_keras' `LayoutMap` matched a subclassed model's weights by the attributes
that hold them (`self.feature = Dense(16)`: `"feature.kernel"`), as
TensorFlow's DTensor Keras tutorial's keys (`"feature.*kernel"`) expect. A
weight's attribute path here is the chain of attribute names from the
outermost subclassed model holding it to its layer, then the weight's name,
joined by "/" as Keras paths are: `"feature/kernel"`; a list element adds its
index (`"blocks/0/kernel"`), a dict value its key. The first chain found
(attributes in assignment order, depth first) names a layer held twice.

Functional and Sequential models have none of their own (their layers are not
attributes; their subclassed layers' weights have none either), but a
subclassed model among their layers gives its weights theirs. When a weight is
created, its attribute path comes from the outermost subclassed model being
built or called around the creation (or, for variables Keras creates after a
build traced in a stateless scope, as `fit`'s first build, the latest such
model holding the weight), so a layer built before it is attached
to its model (a functional backbone built in a model's `__init__`) has none
then; the placement report names such a weight as misplaced when a rule would
place it by the attribute path it has later.
"""

from __future__ import annotations

import collections
import threading
import weakref

from tfdist._compat import deferred_variables
from tfdist.placement import roles

_lock = threading.Lock()
_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {id(weight): (weak ref, path)}


def _walk(layer, prefix: str, found: dict, seen: set) -> None:
    if id(layer) in seen:
        return
    seen.add(id(layer))
    for variable in roles.own_variables(layer):
        found.setdefault(id(variable), (weakref.ref(variable), prefix + variable.name))
    for name, sublayer in deferred_variables.attribute_sublayers(layer):
        _walk(sublayer, f"{prefix}{name}/", found, seen)


def _paths_of(model) -> dict:
    found = {}
    _walk(model, "", found, set())
    return found


def attribute_paths(model) -> dict[int, str]:
    """`{id(weight): attribute path}` for the weights of `model` that a subclassed model holds (see the module).

    Example:

    >>> import keras
    >>> class Tiny(keras.Model):
    ...     def __init__(self):
    ...         super().__init__(name="tiny")
    ...         self.feature = keras.layers.Dense(2)
    ...     def call(self, x):
    ...         return self.feature(x)
    >>> model = Tiny()
    >>> _ = model(keras.ops.zeros((1, 3)))
    >>> paths = attribute_paths(model)
    >>> [(w.path, paths[id(w)]) for w in model.weights]
    [('tiny/dense/kernel', 'feature/kernel'), ('tiny/dense/bias', 'feature/bias')]
    """
    found, pending, seen = {}, collections.deque([model]), set()
    while pending:
        layer = pending.popleft()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        if deferred_variables.is_subclassed_model(layer):
            for key, entry in _paths_of(layer).items():
                found.setdefault(key, entry)
        else:
            pending.extend(deferred_variables.sublayers(layer))
    return {key: path for key, (_, path) in found.items()}


def path_at_creation(variable, rules) -> str | None:
    """The attribute path of the Keras `variable` being created, or None (see the module).

    None too when `rules` has no path rule (only roles, which need no path).
    """
    if variable is None or not any(rule.by_path for rule in rules):
        return None
    stack = [layer for layer in deferred_variables.layer_stack() if deferred_variables.is_subclassed_model(layer)]
    for model in stack[:1] + deferred_variables.models_built_late():
        with _lock:
            entry = _cache.get(model, {}).get(id(variable))
            if entry is None or entry[0]() is not variable:
                # A weight the cached walk did not see (created since): walk the model again.
                _cache[model] = _paths_of(model)
                entry = _cache[model].get(id(variable))
        if entry is not None and entry[0]() is variable:
            return entry[1]
    return None
