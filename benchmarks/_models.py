"""Models the benchmarks share."""

from __future__ import annotations


def mlp(strategy, *, width: int, depth: int, seed: int = 0):
    """`depth` Dense(width, relu) layers and a 10-way head, SGD, built and compiled under `strategy`."""
    import keras

    keras.utils.set_random_seed(seed)
    with strategy.scope():
        layers = [keras.Input((width,))]
        layers += [keras.layers.Dense(width, activation="relu") for _ in range(depth)]
        layers += [keras.layers.Dense(10)]
        model = keras.Sequential(layers)
        model.compile(
            optimizer=keras.optimizers.SGD(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model
