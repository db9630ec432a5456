"""Resuming at the exact step: which backup, where the data stood, which batches to skip, the metric state.

A backup records the position of the interrupted `fit` besides the model's
variables: the epoch and the batches done in it, which iterator of the dataset
Keras was using and how many batches were drawn from it, and the metric state
of the epoch so far. `Position` records all of it while training, and on
resume recreates it: it makes the unused iterators a reshuffling pipeline
would have made, draws the trained batches again without training them, and
puts the metric state back once Keras has reset the metrics for the epoch.
"""

from __future__ import annotations

import warnings

import numpy as np

from tfdist._compat import callbacks as keras_callbacks
from tfdist.callbacks import _files
from tfdist.callbacks import _workers
from tfdist.strategies import topology


def agreed_backup(strategy, where: topology.Topology, directory: str, prefix: str, *, required, hint: str):
    """(step, path, meta, arrays) of the newest backup in `directory` that every worker holds, or None.

    Each worker finds its newest intact backup; under several workers they
    all-gather their steps (a collective: every worker calls this at the same
    point) and take the smallest, then each reads its own backup of that step.

    Raises:
        RuntimeError: when this worker has no intact backup of the agreed
            step, naming `directory` and what to delete (`hint`) to start over.
    """
    found = _files.newest_valid(directory, prefix, required=required)
    if where.num_workers == 1:
        return found
    mine = -1 if found is None else found[0]
    agreed = int(_workers.all_gather_rows(strategy, [mine]).min())
    if agreed == mine:
        return found
    if agreed < 0:
        return None
    found = _files.newest_valid(directory, prefix, max_step=agreed, required=required)
    if found is None or found[0] != agreed:
        raise RuntimeError(
            f"BackupAndRestore: worker {where.worker_index} has no intact backup of step {agreed}, the newest "
            f"step every worker holds (see {directory!r}). Delete {hint!r} to start over."
        )
    return found


def metric_state(model) -> list:
    """Every metric variable's value on each local replica (its unreduced, per-replica part), as lists."""
    strategy = model.distribute_strategy
    return [
        [np.asarray(part.numpy()).tolist() for part in strategy.experimental_local_results(v.value)]
        for v in model.metrics_variables
    ]


def set_metric_state(model, state) -> None:
    """Restores what `metric_state` returned into the model's metric variables (same layout only)."""
    strategy = model.distribute_strategy
    variables = list(model.metrics_variables)
    if state is None or len(state) != len(variables):
        return
    for v, parts in zip(variables, state):
        local = strategy.experimental_local_results(v.value)
        if len(local) != len(parts):
            return
        for part, value in zip(local, parts):
            part.assign(np.asarray(value, dtype=part.dtype.as_numpy_dtype))


class Position:
    """Where a `fit` of `model` stands (epoch, batch, dataset iterator), and what a resumed fit skips.

    Create it at the start of `fit`; call `resume(meta)` with a backup's
    metadata to continue from there, then `wrap_train_function()`; tell it
    each epoch begin, batch end and epoch end; `meta()` is what a backup
    records; `unwrap()` at the end of `fit`.
    """

    def __init__(self, model):
        self._model = model
        self._per_call = max(1, int(model.steps_per_execution))
        self.epoch = 0
        self.batches_in_epoch = 0
        self._epoch_iterator = keras_callbacks.latest_epoch_iterator()
        self._ordinal, self._drawn = 0, 0  # the iterator in use (how many existed when it started), batches drawn
        self._extra, self._noop_calls, self._ignore_batch_ends = 0, 0, 0  # what the resumed fit skips
        self._saved_logs: dict = {}
        self._metric_state = None

    # ------------------------------------------------------------------ resuming
    def resume(self, meta: dict) -> None:
        """Continues from a backup's position (after its variables were restored into the model)."""
        # The skipped batches never run a train step, which is where Keras builds the compiled
        # metrics without a strategy: build them now, so their state is restored and read back.
        keras_callbacks.build_compiled_state(self._model, self._epoch_iterator)
        self.epoch, self.batches_in_epoch = meta["epoch"], meta["batch"]
        keras_callbacks.set_initial_epoch(self._model, self.epoch)
        self._plan_data_position(meta)
        if self.batches_in_epoch:
            self._metric_state = meta.get("metrics")

    def _plan_data_position(self, meta):
        """Recreates the data position of the backup: which iterator of the dataset, how far into it.

        Keras makes a new iterator of the dataset per epoch (plus one at each
        epoch end), or one for the whole fit (a repeated dataset with
        `steps_per_epoch`); a reshuffling tf.data pipeline draws a new order
        for each. The backup records the ordinal of the iterator in use, the
        batches drawn from it and how many iterators existed; here as many
        unused iterators are made as came before that one, and the wrapped
        train function draws the trained batches again without training.
        """
        batch = meta["batch"]
        position = meta.get("iterator")
        self._noop_calls = batch // self._per_call
        self._saved_logs = dict(meta["logs"])
        if self._epoch_iterator is None or position is None:
            return
        if batch == 0 and position["created"] > position["ordinal"]:  # the next epoch gets a new iterator
            target, self._extra = position["created"] + 1, 0
        else:  # the epoch continues with the backup's iterator
            target, self._extra = position["ordinal"], position["drawn"] - batch
        unused = target - 1 - keras_callbacks.iterators_created(self._epoch_iterator)
        if unused < 0:
            warnings.warn(
                f"BackupAndRestore: fit made {-unused} more iterators of the dataset than the run that wrote the "
                "backup; a dataset that reshuffles each iteration will give the resumed epoch another order.",
                stacklevel=4,
            )
        keras_callbacks.make_unused_iterators(self._epoch_iterator, max(0, unused))

    def wrap_train_function(self) -> None:
        """Counts the batches drawn from the current iterator; skips the ones a resumed run trained on."""
        model = self._model
        original = getattr(model.train_function, "_tfdist_original", model.train_function)
        per_call = self._per_call

        def draw(iterator, count):
            for _ in range(count):
                next(iterator)
            self._drawn += count

        def train_function(iterator):
            created = keras_callbacks.iterators_created(self._epoch_iterator)
            if created != self._ordinal:  # Keras started a new iterator of the dataset
                self._ordinal, self._drawn = created, 0
            if self._extra:
                draw(iterator, self._extra)
                self._extra = 0
            if self._noop_calls:
                self._noop_calls -= 1
                self._ignore_batch_ends += 1
                draw(iterator, per_call)
                return self._saved_logs
            logs = original(iterator)
            self._drawn += per_call
            return logs

        train_function._tfdist_original = original
        model.train_function = train_function

    def unwrap(self) -> None:
        """Puts the model's own train function and initial epoch back (at the end of `fit`)."""
        model = self._model
        model.train_function = getattr(model.train_function, "_tfdist_original", model.train_function)
        keras_callbacks.set_initial_epoch(model, None)

    # ------------------------------------------------------------------ following fit
    def epoch_begin(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.batches_in_epoch = 0
        self.epoch = epoch
        if self._metric_state is not None:  # Keras reset the metrics just before; the epoch continues
            set_metric_state(self._model, self._metric_state)
            self._metric_state = None

    def batch_end(self, batch: int) -> bool:
        """Records a batch end; False for the end of a skipped (already trained) batch, which is not one."""
        if self._ignore_batch_ends:
            self._ignore_batch_ends -= 1
            return False
        self.batches_in_epoch = batch + 1
        return True

    def epoch_end(self, epoch: int) -> None:
        self.epoch, self.batches_in_epoch = epoch + 1, 0

    def meta(self) -> dict:
        """The position a backup records: epoch, batch, the metric state in mid-epoch, the iterator."""
        meta = {
            "epoch": self.epoch,
            "batch": self.batches_in_epoch,
            "metrics": metric_state(self._model) if self.batches_in_epoch else None,
        }
        if self._epoch_iterator is not None:
            meta["iterator"] = {
                "ordinal": self._ordinal,
                "drawn": self._drawn,
                "created": keras_callbacks.iterators_created(self._epoch_iterator),
            }
        return meta
