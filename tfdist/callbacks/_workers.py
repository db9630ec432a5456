"""What the workers exchange: one all-gather of a small row of numbers, in the same order on every worker."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfdist.strategies import topology


def all_gather_rows(strategy, row) -> np.ndarray:
    """Every worker's `row` (a float64 vector of the same length on all workers), shape [workers, len].

    A collective under a multi-worker strategy: every worker must call it, in
    the same order. On one host it returns `row[None]` and communicates nothing.
    The all-gather is traced once per strategy and row length (an eager one
    costs ~50 ms; traced, ~1-2 ms on loopback).
    """
    row = np.asarray(row, np.float64).reshape(1, -1)
    num_workers = topology.of(strategy).num_workers
    if num_workers == 1:
        return row
    own = getattr(strategy.extended, "_tfdist_all_gather_rows", None)  # a mesh over processes gathers itself
    if own is not None:
        return own(row)
    gathered = _gather_function(strategy, row.shape[1])(tf.constant(row)).numpy()
    per_worker = gathered.shape[0] // num_workers  # each worker's local replicas sent the same row
    return gathered[::per_worker]


_GATHER_FUNCTIONS: dict = {}


def _gather_function(strategy, length: int):
    key = (id(strategy), length)
    if key not in _GATHER_FUNCTIONS:

        @tf.function(input_signature=[tf.TensorSpec([1, length], tf.float64)])
        def gather(value):
            return strategy.gather(strategy.run(lambda: tf.identity(value)), axis=0)

        _GATHER_FUNCTIONS[key] = gather
    return _GATHER_FUNCTIONS[key]
