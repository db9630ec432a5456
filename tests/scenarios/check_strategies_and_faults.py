"""Asserted by tests/strategies/test_check.py.

tfdist.check scenarios in a fresh process of 8 logical CPUs (run as a script, not collected by pytest).

Usage: python tests/scenarios/check_strategies_and_faults.py OUT_DIR

A tiny `transformer_lm` (SGD with momentum), 3 steps of 16 examples, checked under the five correct strategies
and under five injected faults (test fixtures, not library features), and `tfdist-check`'s `main` once. Each
report (`CheckReport.to_dict()`, its text) goes to OUT_DIR/result.json for tests/strategies/test_check.py.
"""

import contextlib
import io
import json
import os
import sys
import time

import tfdist

OUT = sys.argv[1]
tfdist.simulate_devices(8)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from keras import ops  # noqa: E402

from tfdist import layouts  # noqa: E402
from tfdist import models  # noqa: E402

SEQ, VOCAB, D_MODEL, BATCH, STEPS = 8, 64, 32, 16, 3
FAULT_STEPS = 2  # each fault shows at step 1
MLP = 4 * D_MODEL
RESULT = {}


def lm():
    return models.transformer_lm(seq_len=SEQ, vocab_size=VOCAB, d_model=D_MODEL, num_heads=4, num_layers=1)


def sgd():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def compiled(model, optimizer=None):
    model.compile(optimizer=optimizer or sgd(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def build():
    return compiled(lm())


def faulty(optimizer_class):
    """A builder whose model, under a strategy only, trains with `optimizer_class` (a faulty SGD)."""

    def build_faulty():
        distributed = tf.distribute.has_strategy()
        return compiled(lm(), optimizer_class(0.1, momentum=0.9) if distributed else sgd())

    return build_faulty


class ScaledGradient(keras.optimizers.SGD):
    """Fault 1: one layer's gradient scaled by 1.01 before it is applied."""

    def apply(self, grads, trainable_variables=None):
        grads = [g * 1.01 if v.path == "block_0/mlp_out/kernel" else g for g, v in zip(grads, trainable_variables)]
        return super().apply(grads, trainable_variables)


def skip_all_reduce(strategy):
    """Fault 2: each replica applies its own gradient of block_0/mlp_in/kernel, without the all-reduce."""

    class SkipOne(type(strategy.extended)):
        def _tfdist_all_reduce_gradients(self, grads):
            reduced = super()._tfdist_all_reduce_gradients(grads)
            # The one rank-2 gradient of MLP columns (traced under fit its first dimension may read None).
            return [g if g.shape.rank == 2 and g.shape[-1] == MLP else r for g, r in zip(grads, reduced)]

    strategy.extended.__class__ = SkipOne
    return strategy


class StaleCopy(keras.optimizers.SGD):
    """Fault 3: device CPU:1's copy of block_0/mlp_in/bias (the one variable of shape (MLP,)) is never updated."""

    def update_step(self, gradient, variable, learning_rate):
        if tuple(variable.shape) == (MLP,) and variable.device.endswith("CPU:1"):
            return None
        return super().update_step(gradient, variable, learning_rate)


class BatchMeanPenalty(keras.layers.Layer):
    """Fault 4: an `add_loss` from the batch's statistics (the square of the logits' mean over the batch)."""

    def call(self, logits):
        self.add_loss(ops.sum(ops.square(ops.mean(logits, axis=0))))
        return logits


def penalized():
    base = lm()
    return compiled(keras.Model(base.input, BatchMeanPenalty(name="penalty")(base.output)))


# Fault 5: the MLP's rules on the wrong dimensions (mlp_in split on its input, mlp_out on its output dimension,
# where Megatron splits mlp_in's output and mlp_out's input): DTensor places and reduces otherwise.
WRONG_AXIS = [(r"mlp_in/kernel$", ("model", None)), (r"mlp_out/kernel$", (None, "model"))]

rng = np.random.default_rng(0)
DATA = (
    rng.integers(0, VOCAB, (STEPS * BATCH, SEQ)).astype("int32"),
    rng.integers(0, VOCAB, (STEPS * BATCH, SEQ)).astype("int32"),
)

# MirroredStrategy traces the step once per replica: the correct data-parallel check on 4 (16 examples, 4 each),
# the data-parallel faults on 2.
QUAD, PAIR = [f"CPU:{i}" for i in range(4)], ["CPU:0", "CPU:1"]
SCENARIOS = {
    "data_parallel": (build, lambda: tfdist.DataParallelStrategy(devices=QUAD)),
    "model_parallel": (build, lambda: tfdist.ModelParallelStrategy(mesh={"batch": 2, "model": 4},
                                                                   rules=layouts.transformer())),
    "zero3": (build, lambda: tfdist.ShardedDataParallelStrategy(shard="weights")),
    "zero1": (build, lambda: tfdist.ShardedDataParallelStrategy(shard="optimizer")),
    "pipeline": (build, lambda: tfdist.PipelineStrategy(stages=2, microbatches=2)),
    "fault_scaled_gradient": (
        faulty(ScaledGradient),
        lambda: tfdist.ModelParallelStrategy(mesh={"batch": 2, "model": 4}, rules=layouts.transformer()),
    ),
    "fault_skipped_all_reduce": (
        build, lambda: skip_all_reduce(tfdist.DataParallelStrategy(devices=PAIR))
    ),
    "fault_stale_copy": (faulty(StaleCopy), lambda: tfdist.DataParallelStrategy(devices=PAIR)),
    "fault_batch_loss": (penalized, lambda: tfdist.DataParallelStrategy(devices=PAIR)),
    "fault_wrong_axis": (build, lambda: tfdist.ModelParallelStrategy(mesh={"batch": 2, "model": 4}, rules=WRONG_AXIS)),
}

for name, (builder, make_strategy) in SCENARIOS.items():
    keras.utils.set_random_seed(0)
    steps = FAULT_STEPS if name.startswith("fault_") else STEPS
    report = tfdist.check(builder, DATA, make_strategy(), steps=steps, batch_size=BATCH)
    RESULT[name] = {**report.to_dict(), "text": str(report)}
    print(report, flush=True)

# The binary's main (flags to strategy and report) on tfdist-train's transformer_lm, small sizes.
from tfdist import check_main  # noqa: E402

check_main.FLAGS([
    "tfdist-check", "--strategy=pipeline", "--stages=2", "--microbatches=2", "--num_devices=8", "--steps=1",
    "--seq_len=16", "--d_model=32", "--num_layers=1", "--global_batch_size=8", "--optimizer=adamw",
])
started = time.perf_counter()
with contextlib.redirect_stdout(io.StringIO()) as stdout:
    status = check_main.main(["tfdist-check"])
RESULT["binary"] = {"status": status, "stdout": stdout.getvalue(), "seconds": time.perf_counter() - started}
print(stdout.getvalue(), flush=True)

with open(os.path.join(OUT, "result.json"), "w") as f:
    json.dump(RESULT, f)
