"""Keras' `TFEpochIterator`: how many iterators it made of its dataset, and its batch size.

Keras' TFEpochIterator calls `iter()` on the distributed dataset once per epoch
plus once at each epoch end, or once for the whole fit (a repeated dataset with
`steps_per_epoch`). A tf.data pipeline that reshuffles each iteration draws a
new order at every `iter()`, so the order of a resumed epoch depends on how many
iterators came before it. The hook counts them (per TFEpochIterator, and
remembers the one constructed last), so BackupAndRestore can create the same
number before the resumed epoch. It only counts; the iterators are Keras' own.
PipelineStrategy reads `data_adapter.batch_size` (the global batch) to check it
against its micro-batches. Checked on Keras 3.15.
"""

from __future__ import annotations

import threading

import keras
from keras.src.backend.tensorflow import trainer as keras_tf_trainer

from tfdist._compat._hook import hook

_epoch_iterator = keras_tf_trainer.TFEpochIterator
_original_epoch_iterator_init = _epoch_iterator.__init__
_original_get_iterator = _epoch_iterator._get_iterator
_latest_epoch_iterator = threading.local()


class _CountingDataset:
    """Stands in for an epoch iterator's distributed dataset; counts the iterators made from it."""

    def __init__(self, owner, dataset):
        self._owner, self._dataset = owner, dataset

    def __iter__(self):
        iterator = iter(self._dataset)
        self._owner._tfdist_iterators_created = iterators_created(self._owner) + 1
        return iterator


def _epoch_iterator_init(self, *args, **kwargs):
    _original_epoch_iterator_init(self, *args, **kwargs)
    _latest_epoch_iterator.value = self


def _get_iterator(self):
    return _CountingDataset(self, _original_get_iterator(self))


def latest_epoch_iterator():
    """The Keras TFEpochIterator constructed last in this thread (in `on_train_begin`: fit's), else None."""
    return getattr(_latest_epoch_iterator, "value", None)


def iterators_created(epoch_iterator) -> int:
    """How many iterators `epoch_iterator` has made of its dataset so far."""
    return getattr(epoch_iterator, "_tfdist_iterators_created", 0)


def make_unused_iterators(epoch_iterator, count: int) -> None:
    """Makes `count` iterators of the epoch iterator's dataset and drops them (advances reshuffling seeds)."""
    dataset = _original_get_iterator(epoch_iterator)
    for _ in range(count):
        iter(dataset)
    epoch_iterator._tfdist_iterators_created = iterators_created(epoch_iterator) + count


HOOKS = (
    hook(
        "epoch_iterator_construction",
        _original_epoch_iterator_init,
        ("self._distributed_dataset = dataset",),
        "callbacks",
        patch=(_epoch_iterator, "__init__", _epoch_iterator_init),
    ),
    hook(
        "epoch_iterator_get_dataset",
        _original_get_iterator,
        ("return self._distributed_dataset",),
        "callbacks",
        patch=(_epoch_iterator, "_get_iterator", _get_iterator),
    ),
    hook(
        "epoch_iterator_iter",
        keras.src.trainers.epoch_iterator.EpochIterator._enumerate_iterator,
        ("iter(self._get_iterator())",),
        "callbacks",
    ),
    hook("epoch_iterator_adapter", _original_epoch_iterator_init, ("self.data_adapter.get_tf_dataset()",), "pipeline"),
    hook(
        "batch_size_property",
        keras.src.trainers.data_adapters.data_adapter.DataAdapter,
        ("def batch_size(self)",),
        "pipeline",
    ),
)
