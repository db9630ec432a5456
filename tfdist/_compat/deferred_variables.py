"""Keras layer builds: the variables of a layer being built are created once its whole build is done.

A strategy that places a weight by what its layer does in the model (which
projection of an attention layer, the first or last dense layer of a
feed-forward block) needs the block's structure when the weight is created,
but Keras builds a block's sublayers one after the other, each creating its
weights at once. While a strategy whose extended says
`_tfdist_defer_variables` is in scope, a Keras variable created inside the
build of a layer is left uninitialized, as Keras leaves one created in a
stateless scope (`_value` None, its initializer kept). It belongs to the
*root*: the outermost of the layers being built (unbuilt, or inside their
build wrapper) on Keras' name-scope stack around the creation. When the
root's build returns (Keras' `_post_build`, called at the end of every build;
in a stateless scope, when Keras initializes its late variables at the
scope's end), the strategy is handed the root and a function that creates them all, in
creation order (`_tfdist_place_deferred(root, create)`), with Keras' own
`_deferred_initialize`; the strategy's variable creator then runs as usual.
Variables Keras itself initializes late (created in a stateless scope, as
its symbolic build of a subclassed model does) are created when Keras says.

Reads before that: a symbolic or stateless read (Keras tracing a call for
shapes) gets the initializer's value, as an uninitialized Keras variable
gives; any other read (an eager or traced step reading the weight, e.g. a
sublayer built in an eager call) first creates every variable of its root.
Also here, for attribute paths (tfdist/placement/attributes.py): the
sublayers a layer holds by attribute (`attribute_sublayers`) and the layers
being built or called around a variable's creation (`layer_stack`), and the
subclassed models whose build ended while Keras held their variables for later
(a build traced in a stateless scope, as `fit`'s symbolic build does: Keras
creates them when the outermost scope ends, no layer on the stack then;
`models_built_late`).
Checked on Keras 3.15.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import weakref

import keras
import tensorflow as tf
from keras.src.backend.common import global_state
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.common.symbolic_scope import in_symbolic_scope
from keras.src.models import functional as keras_functional
from keras.src.models import sequential as keras_sequential
from keras.src.ops import function as keras_function
from keras.src.ops import operation as keras_operation

from tfdist._compat._hook import hook
from tfdist.strategies import _extended

_keras_tf_variable = keras.src.backend.tensorflow.core.Variable
_original_initialize_with_initializer = _keras_tf_variable._initialize_with_initializer
_original_post_build = keras_operation.Operation._post_build
_NAME_SCOPE_STACK = "name_scope_stack"
_lock = threading.Lock()


@dataclasses.dataclass
class _Pending:
    """The uninitialized variables of one root, the strategy that creates them, and their initializers."""

    extended: object
    variables: list = dataclasses.field(default_factory=list)
    initializers: list = dataclasses.field(default_factory=list)


_pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root layer -> _Pending
_root_of: dict = {}  # id(variable) -> weak reference to its root
_placing = threading.local()  # .root: the root whose variables `create` is creating on this thread
# Attributes by which Keras itself holds a layer's sublayers (Functional's graph, Sequential's model): not paths.
_KERAS_OWN_ATTRIBUTES = ("_operations", "_functional")
_bookkeeping: set = set()  # the attributes every Keras layer has (`_layers`, `_tracker`, ...), filled once
_UNINITIALIZED = "uninitialized_variables"  # Keras' list of the variables a stateless scope's end creates
_built_late: list = []  # weak references to subclassed models built while Keras held variables for later


def _in_build(layer) -> bool:
    """Whether `layer`'s build runs on this thread: Keras' build wrapper of `layer` is on the call stack.

    A layer may set `built = True` inside its own build (Keras' `Embedding` does, before
    `ReversibleEmbedding.build` adds its reverse embeddings).
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "build_wrapper" and frame.f_locals.get("obj") is layer:
            return True
        frame = frame.f_back
    return False


def building_root():
    """The layer whose build the current variable creation is part of, or None.

    Keras' name-scope stack holds the layers being built or called; the root
    is the outermost of the innermost run of layers being built (unbuilt, or
    inside their build); scopes of other objects, such as a seed generator's,
    are skipped.
    """
    root = None
    for entry in reversed(global_state.get_global_attribute(_NAME_SCOPE_STACK, default=None) or ()):
        caller = entry.caller
        if not isinstance(caller, keras.layers.Layer):
            continue
        if caller.built and not _in_build(caller):
            break
        root = caller
    return root


def sublayers(layer) -> list:
    """`layer`'s direct sublayers, in the order they were assigned (Keras' tracking order)."""
    return layer._flatten_layers(include_self=False, recursive=False)


def layer_stack() -> list:
    """The layers being built or called on this thread around a variable's creation, outermost first.

    From Keras' name-scope stack; a root whose build-end creation runs outside
    its own scope (`create`) comes last.
    """
    stack = global_state.get_global_attribute(_NAME_SCOPE_STACK, default=None) or ()
    layers = [entry.caller for entry in stack if isinstance(entry.caller, keras.layers.Layer)]
    root = getattr(_placing, "root", None)
    if root is not None and root not in layers:
        layers.append(root)
    return layers


def models_built_late() -> list:
    """Subclassed models whose build ended while Keras held variables for later, the latest first.

    A model is forgotten once none of its variables waits any more.
    """
    with _lock:
        alive = [ref for ref in _built_late if ref() is not None and any(v._value is None for v in ref().weights)]
        _built_late[:] = alive
    return [ref() for ref in reversed(alive)]


def is_subclassed_model(layer) -> bool:
    """Whether `layer` is a `keras.Model` subclass built by its own code (not a functional or Sequential model)."""
    return isinstance(layer, keras.Model) and not isinstance(
        layer, (keras_functional.Functional, keras_sequential.Sequential)
    )


def attribute_sublayers(layer) -> list:
    """The sublayers `layer` holds by attribute, as `(name, sublayer)`, in assignment order.

    A list or tuple element is named `"<attribute>/<index>"`, a dict value
    `"<attribute>/<key>"`. Attributes every Keras layer has (its tracking
    lists) and a functional or Sequential model's own graph are skipped, as
    Keras' weights-file walk skips them (`saving_lib.get_attr_skipset`).
    """
    if not _bookkeeping:
        _bookkeeping.update(vars(keras.layers.Layer()), _KERAS_OWN_ATTRIBUTES)
    found = []
    for name, value in vars(layer).items():
        if name in _bookkeeping or name.startswith("_self_"):  # TensorFlow trackable bookkeeping too
            continue
        if isinstance(value, keras.layers.Layer):
            found.append((name, value))
        elif isinstance(value, (list, tuple)):
            found.extend((f"{name}/{i}", v) for i, v in enumerate(value) if isinstance(v, keras.layers.Layer))
        elif isinstance(value, dict):
            found.extend((f"{name}/{k}", v) for k, v in value.items() if isinstance(v, keras.layers.Layer))
    return found


def pending(root) -> int:
    """How many variables of `root`'s build are still uninitialized."""
    with _lock:
        group = _pending.get(root)
        return len(group.variables) if group is not None else 0


def _reader(variable, initializer):
    """What Keras calls for the value of the uninitialized `variable`: see the module."""

    def read(shape, dtype=None):
        if in_symbolic_scope() or in_stateless_scope():
            return initializer(shape, dtype=dtype)
        root = _root_of.get(id(variable))
        root = root() if root is not None else None
        if root is not None:
            create(root)
        if variable._value is None:
            raise RuntimeError(
                f"Variable {variable.path!r} was read before its layer's build ended, and tfdist could not "
                "create it then. Build the model (call it, or build it) before reading its weights."
            )
        return variable._value

    return read


def _initialize_with_initializer(self, initializer):
    # Keras' own `_deferred_initialize` passes the variable's initializer (a variable created in a stateless
    # scope, or one of ours being created): that creation goes ahead.
    extended = None if initializer is self._initializer else _extended.extended_of(tf.distribute.get_strategy())
    root = building_root() if extended is not None and extended._tfdist_defer_variables else None
    if root is None:
        return _original_initialize_with_initializer(self, initializer)
    with _lock:
        group = _pending.get(root)
        if group is None:
            group = _pending[root] = _Pending(extended)
        group.variables.append(self)
        group.initializers.append(initializer)
        _root_of[id(self)] = weakref.ref(root)
    self._value = None
    self._initializer = _reader(self, initializer)


def create(root) -> None:
    """Has the strategy create the variables of `root`'s build that are still uninitialized."""
    with _lock:
        group = _pending.pop(root, None)
        if group is None:
            return
        for variable in group.variables:
            _root_of.pop(id(variable), None)

    def create_all():
        outer, _placing.root = getattr(_placing, "root", None), root
        try:
            for variable, initializer in zip(group.variables, group.initializers):
                variable._initializer = initializer
                variable._deferred_initialize()
        finally:
            _placing.root = outer

    group.extended._tfdist_place_deferred(root, create_all)


class _CreateAtScopeEnd:
    """An entry of Keras' late-initialized variables that creates the pending variables of a root instead.

    A root's build can end inside a stateless scope (its parent traced for shapes by
    `compute_output_spec`, as KerasHub's T5 layers are when the backbone is built), where no
    variable may be created; Keras calls `_deferred_initialize()` on every entry when the
    outermost such scope ends, and this one then has the strategy create the root's.
    """

    def __init__(self, root):
        self._root = weakref.ref(root)

    def _deferred_initialize(self):
        root = self._root()
        if root is not None:
            create(root)


def _post_build(self):
    _original_post_build(self)
    if global_state.get_global_attribute(_UNINITIALIZED, None) and is_subclassed_model(self):
        with _lock:
            _built_late.append(weakref.ref(self))
    if not pending(self):
        return
    if in_stateless_scope():
        keras.src.backend.common.variables.register_uninitialized_variable(_CreateAtScopeEnd(self))
    else:
        create(self)


HOOKS = (
    hook(
        "deferred_variables",
        _original_initialize_with_initializer,
        ("self._initialize(",),
        "model_parallel",
        patch=(_keras_tf_variable, "_initialize_with_initializer", _initialize_with_initializer),
    ),
    hook(
        "deferred_variables_init",
        keras.src.backend.common.variables.Variable.__init__,
        ("self._initializer = None", "self._initialize_with_initializer(initializer)"),
        "model_parallel",
    ),
    hook(
        "deferred_variables_read",
        keras.src.backend.common.variables.Variable.value.fget,
        ("if self._value is None:", "self._initializer(self._shape, dtype=self._dtype)"),
        "model_parallel",
    ),
    hook(
        "deferred_variables_create",
        _keras_tf_variable._deferred_initialize,
        ("self._initialize_with_initializer(self._initializer)", "tf.init_scope()"),
        "model_parallel",
    ),
    hook(
        "deferred_variables_build_end",
        keras.src.layers.layer.Layer.__new__,
        ("def build_wrapper(*args, **kwargs):", "original_build_method(*args, **kwargs)", "obj._post_build()"),
        "model_parallel",
        patch=(keras_operation.Operation, "_post_build", _post_build),
    ),
    hook(
        "deferred_variables_sublayers",
        keras.src.layers.layer.Layer._flatten_layers,
        ("def _flatten_layers(self, include_self=True, recursive=True)", "deque = collections.deque(self._layers)"),
        "model_parallel",
    ),
    hook(
        "deferred_variables_scope_end",
        keras.src.backend.common.variables.initialize_all_variables,
        ('get_global_attribute("uninitialized_variables")', "v._deferred_initialize()"),
        "model_parallel",
    ),
    hook(
        "attribute_paths_late_variables",
        keras.src.backend.common.variables.register_uninitialized_variable,
        ('"uninitialized_variables"',),
        "model_parallel",
    ),
    hook(
        "attribute_sublayers",
        keras.src.layers.layer.Layer._initialize_tracker,
        ("self._layers = layers",),
        "model_parallel",
    ),
    hook(
        "attribute_sublayers_functional",
        keras_function.Function.__init__,
        ("self._operations = operations",),
        "model_parallel",
    ),
    hook(
        "attribute_sublayers_sequential",
        keras_sequential.Sequential.build,
        ("self._functional = Functional(",),
        "model_parallel",
    ),
    hook(
        "deferred_variables_root",
        keras.src.backend.common.name_scope.name_scope.__init__,
        ("self.caller = caller",),
        "model_parallel",
    ),
)
