"""Keras layers' `add_loss` terms kept per replica: one replica's step never sees another's.

Keras keeps a layer's `add_loss` terms in `layer._losses`, one list per layer
object, cleared when the outermost model call begins. Under a MirroredStrategy
every replica's thread calls the same layer objects, one thread at a time, and
switches threads at each merge point (an all-reduce): when the forward pass
all-reduces (global batch statistics, a synchronized BatchNormalization, the
global MoE balancing loss), the threads interleave inside it, so one replica
clears or appends to the list another replica is filling, and a replica's
`model.losses` holds other replicas' terms or its own twice (measured: a
2-layer Mixtral under 2 replicas logged the balancing loss 3 and 4 times
instead of 2; gradients stayed right because each replica's tape ignores the
other thread's tensors). Here `Layer._losses` becomes a property that, in a
replica context of a tfdist strategy with more than one replica, is this
thread's own list for the layer; anywhere else, the layer's own attribute as
before. Checked on Keras 3.15.
"""

from __future__ import annotations

import threading
import weakref

import tensorflow as tf
from keras.src.layers.layer import Layer

from tfdist._compat._hook import ABSENT
from tfdist._compat._hook import EXACT
from tfdist._compat._hook import hook
from tfdist.strategies import _extended


class _ReplicaLosses(threading.local):
    """This thread's loss lists: `{id(layer): (weakref to the layer, its list)}`."""

    def __init__(self):
        self.lists = {}


_replica_losses = _ReplicaLosses()


def _replica_list(layer) -> list | None:
    """`layer`'s loss list for this replica's thread, or None outside a multi-replica tfdist replica context."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync < 2 or _extended.in_replica() is None:
        return None
    entry = _replica_losses.lists.get(id(layer))
    if entry is None or entry[0]() is not layer:
        entry = _replica_losses.lists[id(layer)] = (weakref.ref(layer), [])
    return entry[1]


def _get_losses(self):
    own = _replica_list(self)
    if own is not None:
        return own
    try:
        return self.__dict__["_losses"]
    except KeyError:  # not set yet (`Layer.__init__` sets it)
        raise AttributeError("_losses") from None


def _set_losses(self, value):
    self.__dict__["_losses"] = value


HOOKS = (
    hook(
        "layer_losses",
        Layer,
        ("self._losses = []", "self._losses.extend(losses)", "return self._losses[:]", "self._losses.clear()"),
        *EXACT,
        patch=(Layer, "_losses", property(_get_losses, _set_losses)),
        original=ABSENT,
    ),
)
