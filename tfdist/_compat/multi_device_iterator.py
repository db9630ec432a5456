"""tf.data's multi-device iterator: each device's reader functions traced once, not at every epoch.

Every pass over a dataset a tf.distribute strategy distributed (each epoch of
`fit`, each `evaluate` and `predict`) makes a new `OwnedMultiDeviceIterator`,
and that builds one `_PerDeviceGenerator` per device, which traces six
`tf.function`s: the reader of that device's share from the host's buffer and
its remote calls. Their graphs are the same every time; only the values they
capture differ (the new iterator's handle, resource and incarnation id). That
tracing was 0.25 s of the 0.27 s an iterator over 4 devices takes to make
(TensorFlow 2.21, 2-core CPU): a quarter of the time of a short data-parallel
`fit`.

Under a tfdist strategy (`DistributedDataset.__iter__` and
`DistributedDatasetsFromFunction.__iter__` of a strategy whose `extended` is a
`TfdistExtended` mark the pass) and in eager mode, `per_device_generator`
keeps the first iterator's traced functions per (device, shard, source
device, element spec) and gives later iterators a generator dataset of those
functions with the new values in place of the old ones, by position: the
mechanism TensorFlow's own `_ReincarnatedPerDeviceGenerator` uses to swap the
incarnation id. `create_device_dataset` makes the per-device dataset from
such a cached prototype. A prototype whose captured values are not exactly
the ones it recognises is not cached (TensorFlow's own path then runs every
time). Checked on TensorFlow 2.21.
"""

from __future__ import annotations

import collections
import threading

import tensorflow as tf
from tensorflow.python.data.ops import dataset_ops
from tensorflow.python.data.ops import multi_device_iterator_ops as mdi
from tensorflow.python.data.ops import prefetch_op
from tensorflow.python.data.util import structure
from tensorflow.python.distribute import input_lib
from tensorflow.python.eager import context
from tensorflow.python.ops import gen_dataset_ops

from tfdist._compat._hook import EXACT
from tfdist._compat._hook import hook
from tfdist._compat._hook import thread_local_scope
from tfdist.strategies import _extended

_OriginalPerDeviceGenerator = mdi._PerDeviceGenerator
_OriginalReincarnated = mdi._ReincarnatedPerDeviceGenerator
_original_create_device_dataset = mdi._create_device_dataset
_original_dataset_iter = input_lib.DistributedDataset.__iter__
_original_from_function_iter = input_lib.DistributedDatasetsFromFunction.__iter__

CACHE_SIZE = 256  # (device, shard, element spec) entries; the oldest is dropped beyond it
_state = threading.local()
_lock = threading.Lock()
_cache: collections.OrderedDict = collections.OrderedDict()

# What each captured value of a prototype's functions is, by position.
_HANDLE, _RESOURCE, _INCARNATION, _SOURCE = "handle", "resource", "incarnation", "source"


class _Prototype:
    """One device's traced reader functions and what each of their captured values stands for."""

    def __init__(self, made, resource, incarnation_id, source_device):
        known = {id(resource): _RESOURCE, id(incarnation_id): _INCARNATION, id(source_device): _SOURCE}
        self.name = made._name
        self.init_func, self.next_func, self.finalize_func = made._init_func, made._next_func, made._finalize_func
        self.init_roles = [known.get(id(t), _HANDLE) for t in made._init_captured_args]
        self.next_roles = [known.get(id(t)) for t in made._next_captured_args]
        self.finalize_roles = [known.get(id(t)) for t in made._finalize_captured_args]

    @property
    def recognised(self) -> bool:
        """Whether every captured value was named: one handle in init, nothing unknown elsewhere."""
        return (
            self.init_roles.count(_HANDLE) == 1
            and None not in self.next_roles
            and None not in self.finalize_roles
            and self.next_roles.count(_INCARNATION) == 1
        )


def _key(shard_num, source_device, element_spec, iterator_is_anonymous):
    """What the traced functions depend on: device, shard, source device and the flat types and shapes read."""
    types = tuple(structure.get_flat_tensor_types(element_spec))
    shapes = structure.get_flat_tensor_shapes(element_spec)
    shapes = tuple(None if s.rank is None else tuple(s.as_list()) for s in shapes)
    return (shard_num, context.context().device_name, bytes(source_device.numpy()), types, shapes,
            repr(element_spec), iterator_is_anonymous)


def _generator_dataset(ds):
    """The generator dataset op of `ds`'s reader functions and captured values (as TensorFlow's classes make it)."""
    return gen_dataset_ops.generator_dataset(
        ds._init_captured_args,
        ds._next_captured_args,
        ds._finalize_captured_args,
        init_func=ds._init_func,
        next_func=ds._next_func,
        finalize_func=ds._finalize_func,
        **ds._flat_structure,
    )


class PerDeviceGenerator(dataset_ops.DatasetV2):
    """`_PerDeviceGenerator`: from the cached prototype of its device and spec when tfdist iterates eagerly.

    Otherwise (and the first time) TensorFlow's own constructor runs on it, which traces; its `super()`
    names this class, the module's `_PerDeviceGenerator` now, and so reaches `DatasetV2` as it does there.
    """

    def __init__(self, shard_num, multi_device_iterator_resource, incarnation_id, source_device, element_spec,
                 iterator_is_anonymous):
        args = (shard_num, multi_device_iterator_resource, incarnation_id, source_device, element_spec,
                iterator_is_anonymous)
        self._tfdist_prototype = self._tfdist_values = None
        if not (getattr(_state, "tfdist", False) and context.executing_eagerly() and tf.is_tensor(source_device)):
            _OriginalPerDeviceGenerator.__init__(self, *args)
            return
        key = _key(shard_num, source_device, element_spec, iterator_is_anonymous)
        with _lock:
            prototype = _cache.get(key)
            if prototype is not None:
                _cache.move_to_end(key)
        if prototype is None:
            _OriginalPerDeviceGenerator.__init__(self, *args)
            prototype = _Prototype(self, multi_device_iterator_resource, incarnation_id, source_device)
            if prototype.recognised:
                with _lock:
                    _cache[key] = prototype
                    while len(_cache) > CACHE_SIZE:
                        _cache.popitem(last=False)
            return
        handle = gen_dataset_ops.multi_device_iterator_to_string_handle(multi_device_iterator_resource)
        values = {_HANDLE: handle, _RESOURCE: multi_device_iterator_resource, _INCARNATION: incarnation_id,
                  _SOURCE: source_device}
        self._tfdist_prototype, self._tfdist_values = prototype, values
        self._name, self._element_spec = prototype.name, element_spec
        self._init_func, self._next_func = prototype.init_func, prototype.next_func
        self._finalize_func = prototype.finalize_func
        self._init_captured_args = [values[r] for r in prototype.init_roles]
        self._next_captured_args = [values[r] for r in prototype.next_roles]
        self._finalize_captured_args = [values[r] for r in prototype.finalize_roles]
        self._incarnation_id_index = prototype.next_roles.index(_INCARNATION)
        super().__init__(_generator_dataset(self))

    _inputs = _OriginalPerDeviceGenerator._inputs
    element_spec = _OriginalPerDeviceGenerator.element_spec


class _Reincarnated(dataset_ops.DatasetV2):
    """`_ReincarnatedPerDeviceGenerator` of a cached `PerDeviceGenerator`: its own values, a new incarnation id."""

    def __init__(self, prototype: PerDeviceGenerator, incarnation_id):
        self._name, self._element_spec = prototype._name, prototype.element_spec
        self._init_func, self._next_func = prototype._init_func, prototype._next_func
        self._finalize_func = prototype._finalize_func
        self._init_captured_args = list(prototype._init_captured_args)
        self._next_captured_args = list(prototype._next_captured_args)
        self._next_captured_args[prototype._incarnation_id_index] = incarnation_id
        self._finalize_captured_args = list(prototype._finalize_captured_args)
        super().__init__(_generator_dataset(self))

    _inputs = _OriginalReincarnated._inputs
    element_spec = _OriginalPerDeviceGenerator.element_spec


def create_device_dataset(prototype_ds, incarnation_id, prefetch_buffer_size, experimental_slack):
    """`_create_device_dataset`: TensorFlow's, or for a cached prototype its reincarnation and the same prefetch."""
    if getattr(prototype_ds, "_tfdist_values", None) is None:
        return _original_create_device_dataset(prototype_ds, incarnation_id, prefetch_buffer_size, experimental_slack)
    ds = _Reincarnated(prototype_ds, incarnation_id)
    if prefetch_buffer_size > 0:
        if experimental_slack:
            ds = prefetch_op._PrefetchDataset(ds, prefetch_buffer_size, slack_period=1)
        else:
            ds = ds.prefetch(prefetch_buffer_size, name="device_prefetch")
    return ds


def _marked(original):
    def iterate(self):
        under_tfdist = _extended.extended_of(self._strategy) is not None
        with thread_local_scope(_state, "tfdist", under_tfdist):
            return original(self)

    iterate.__name__ = iterate.__qualname__ = "__iter__"
    iterate.__doc__ = f"{original.__qualname__}: tfdist's multi-device reader cache on while it makes the iterator."
    return iterate


distributed_dataset_iter = _marked(_original_dataset_iter)
from_function_iter = _marked(_original_from_function_iter)

_NEEDLES = (
    "def _init_func():",
    "return multi_device_iterator_string_handle",
    "args=init_func_concrete.captured_inputs",
    "args=[string_handle] + next_func_concrete.captured_inputs",
    "incarnation_id=incarnation_id",
    "self._next_captured_args = self._next_captured_args + [",
    "args=[string_handle] + finalize_func_concrete.captured_inputs",
    "super(_PerDeviceGenerator, self).__init__(variant_tensor)",
)
HOOKS = (
    hook("per_device_generator", _OriginalPerDeviceGenerator, _NEEDLES, *EXACT,
         patch=(mdi, "_PerDeviceGenerator", PerDeviceGenerator)),
    hook("create_device_dataset", _original_create_device_dataset,
         ("_ReincarnatedPerDeviceGenerator(prototype_ds, incarnation_id)", "slack_period=1",
          'ds.prefetch(prefetch_buffer_size, name="device_prefetch")'),
         *EXACT, patch=(mdi, "_create_device_dataset", create_device_dataset)),
    hook("reincarnated_generator", _OriginalReincarnated,
         ("per_device_dataset._incarnation_id_index] = incarnation_id", "per_device_dataset._finalize_captured_args"),
         *EXACT),
    hook("owned_multi_device_iterator", mdi.OwnedMultiDeviceIterator.__init__,
         ("ds = _PerDeviceGenerator(", "iterator_is_anonymous=True", "_create_device_dataset(prototype_device_"),
         *EXACT),
    hook("distributed_dataset_iter", input_lib.DistributedDataset.__iter__, ("_create_iterators_per_worker(",),
         *EXACT, patch=(input_lib.DistributedDataset, "__iter__", distributed_dataset_iter)),
    hook("from_function_iter", input_lib.DistributedDatasetsFromFunction.__iter__,
         ("_create_iterators_per_worker(",), *EXACT,
         patch=(input_lib.DistributedDatasetsFromFunction, "__iter__", from_function_iter)),
)
