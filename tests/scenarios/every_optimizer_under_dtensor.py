"""Asserted by tests/strategies/test_dtensor_optimizers.py.

Every Keras optimizer under every DTensor strategy, in a fresh process (run as a script, not collected by pytest).

Usage: python tests/scenarios/every_optimizer_under_dtensor.py OUT_DIR

Simulates 8 CPUs. For each optimizer of `OPTIMIZERS`, trains a token Embedding (vocabulary 32, width 16,
split over "model" by vocabulary) and a Dense head (split over "model" by output) once on one device (no
strategy) and once under each strategy of `STRATEGIES`, from the same seed on the same 3 batches of 8
sequences of 4 tokens (tokens repeat within a batch: the Embedding's IndexedSlices gradient has repeated
rows). Per (optimizer, strategy): the relative difference of the per-step losses, the largest weight and
optimizer-variable differences, or the error. Numbers go to OUT_DIR/result.json for
tests/strategies/test_dtensor_optimizers.py.
"""

import json
import os
import sys
import time

import tfdist

OUT = sys.argv[1]
tfdist.simulate_devices(8)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfdist.strategies.model_parallel.variables import spec_of  # noqa: E402

VOCAB, WIDTH, SEQ, CLASSES, BATCH, STEPS = 32, 16, 4, 8, 8, 3
MESH = {"batch": 2, "model": 4}
RULES = [(r"embed/embeddings$", ("model", None)), (r"head/kernel$", (None, "model"))]

# Learning rates large enough that a few steps move every weight well past rounding.
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.5),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.5, momentum=0.9),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.5, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(0.05),
    "adamw": lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1),
    "adagrad": lambda: keras.optimizers.Adagrad(0.5),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.05),
    "adadelta": lambda: keras.optimizers.Adadelta(5.0),
    "adafactor": lambda: keras.optimizers.Adafactor(0.05),
    "adamax": lambda: keras.optimizers.Adamax(0.05),
    "nadam": lambda: keras.optimizers.Nadam(0.05),
    "ftrl": lambda: keras.optimizers.Ftrl(0.5),
    "lion": lambda: keras.optimizers.Lion(0.01),
    "lamb": lambda: keras.optimizers.Lamb(0.05),
}
STRATEGIES = {
    "model_parallel": lambda: tfdist.ModelParallelStrategy(mesh=MESH, rules=RULES),
    "zero1": lambda: tfdist.ShardedDataParallelStrategy(shard="optimizer", mesh=MESH, rules=RULES, min_size=16),
    "zero3": lambda: tfdist.ShardedDataParallelStrategy(shard="weights", mesh=MESH, rules=RULES, min_size=16),
}


def data():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (BATCH * STEPS, SEQ)).astype("int32")
    return tokens, rng.integers(0, CLASSES, (BATCH * STEPS,)).astype("int32")


def build(optimizer, strategy=None):
    keras.utils.set_random_seed(3)
    with strategy.scope() if strategy is not None else keras.name_scope("one_device"):
        tokens = keras.Input((SEQ,), dtype="int32")
        x = keras.layers.Embedding(VOCAB, WIDTH, name="embed")(tokens)
        x = keras.layers.GlobalAveragePooling1D()(x)
        model = keras.Model(tokens, keras.layers.Dense(CLASSES, name="head")(x))
        model.compile(
            optimizer=OPTIMIZERS[optimizer](), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    return model


class StepLosses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


def train(optimizer, strategy=None):
    """(model, per-step losses) after STEPS steps of `fit`."""
    x, y = data()
    model = build(optimizer, strategy)
    losses = StepLosses()
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[losses])
    return model, losses.losses


def max_diff(a, b):
    return float(max(np.max(np.abs(np.asarray(x, "float64") - np.asarray(y, "float64"))) for x, y in zip(a, b)))


def main():
    start = time.monotonic()
    result = {}
    for optimizer in OPTIMIZERS:
        ref, ref_losses = train(optimizer)
        ref_weights = ref.get_weights()
        result[optimizer] = {
            "reference": {"losses": ref_losses, "moved": max_diff(ref_weights, build(optimizer).get_weights())}
        }
        for name, make in STRATEGIES.items():
            try:
                model, losses = train(optimizer, make())
                result[optimizer][name] = {
                    "loss_rel": float(np.max(np.abs(np.subtract(losses, ref_losses)) / np.abs(ref_losses))),
                    "weights_diff": max_diff(model.get_weights(), ref_weights),
                    "slots_diff": max_diff(model.optimizer.variables, ref.optimizer.variables),
                    "embedding_spec": list(spec_of(model.get_layer("embed").embeddings.value.layout)),
                }
            except Exception as e:  # noqa: BLE001 - recorded for the test, which names the cell
                result[optimizer][name] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
            print(optimizer, name, result[optimizer][name], flush=True)
    print(f"trained in {time.monotonic() - start:.1f} s", flush=True)
    with open(os.path.join(OUT, "result.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
