"""Learning-rate warmup with the linear scaling rule (Goyal et al. 2017): `WarmupSchedule`, `LearningRateWarmup`."""

from __future__ import annotations

import keras
import numpy as np

from tfdist import _validate
from tfdist.strategies import topology

__all__ = ["LearningRateWarmup", "WarmupSchedule"]


def _check_steps(value) -> int:
    return _validate.integer("warmup_steps", value)


def _check_factor(name, value) -> float:
    return _validate.positive_number(name, value)


def _warmup_factor(step, warmup_steps: int, scale: float, initial_scale: float):
    """initial_scale at step 0, rising linearly to `scale` at `warmup_steps`, then `scale`."""
    fraction = keras.ops.minimum(keras.ops.cast(step, "float32") / float(warmup_steps), 1.0)
    return initial_scale + (scale - initial_scale) * fraction


@keras.saving.register_keras_serializable(package="tfdist")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Gradual warmup to `scale` x a base learning rate or Keras schedule (linear scaling rule).

    `lr(step) = base(step) * f(step)`, where `f` rises linearly from
    `initial_scale` at step 0 to `scale` at `warmup_steps` and stays there
    (Goyal et al. 2017, "Accurate, Large Minibatch SGD": scale = the number
    of replicas, start at the single-device rate, warm up over ~5 epochs).

    Args:
        base: the single-device learning rate: a float or a Keras
            `LearningRateSchedule` (it composes: its decay continues under
            the scaling).
        warmup_steps: steps to reach full scale (>= 1).
        scale: the final multiplier, e.g. `strategy.num_replicas_in_sync`.
        initial_scale: the multiplier at step 0 (1.0: the single-device rate).

    Example:

    >>> import keras, tfdist
    >>> decay = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=100, decay_rate=0.5)
    >>> lr = tfdist.callbacks.WarmupSchedule(decay, warmup_steps=10, scale=4)
    >>> round(float(lr(0)), 4), round(float(lr(5)), 4), round(float(lr(10)), 4)
    (0.1, 0.2415, 0.3732)
    >>> optimizer = keras.optimizers.SGD(learning_rate=lr)
    """

    def __init__(self, base, *, warmup_steps: int, scale: float, initial_scale: float = 1.0):
        if not isinstance(base, keras.optimizers.schedules.LearningRateSchedule):
            base = _check_factor("base", base)
        self.base = base
        self.warmup_steps = _check_steps(warmup_steps)
        self.scale = _check_factor("scale", scale)
        self.initial_scale = _check_factor("initial_scale", initial_scale)

    def __call__(self, step):
        base = self.base(step) if callable(self.base) else self.base
        return base * _warmup_factor(step, self.warmup_steps, self.scale, self.initial_scale)

    def get_config(self):
        base = self.base
        if isinstance(base, keras.optimizers.schedules.LearningRateSchedule):
            base = keras.saving.serialize_keras_object(base)
        return {
            "base": base,
            "warmup_steps": self.warmup_steps,
            "scale": self.scale,
            "initial_scale": self.initial_scale,
        }

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        if isinstance(config["base"], dict):
            config["base"] = keras.saving.deserialize_keras_object(config["base"])
        base = config.pop("base")
        return cls(base, **config)


class LearningRateWarmup(keras.callbacks.Callback):
    """Linear scaling rule with gradual warmup for an optimizer with a constant learning rate.

    Before each step sets `learning_rate = base * f(step)`, `f` rising linearly
    from `initial_scale` to `scale` over `warmup_steps` optimizer steps
    (`optimizer.iterations`, so a resumed run continues the ramp). `base` is
    the optimizer's learning rate when the callback is attached to the model,
    unless given. For an optimizer built on a Keras schedule, use
    `WarmupSchedule(schedule, ...)` as its learning rate instead (the
    callback raises ValueError saying so).

    Args:
        warmup_steps: steps to reach full scale (>= 1).
        scale: "replicas" (the data-parallel size: replicas in sync, or the
            batch axis of a model-parallel mesh) or a positive number.
        initial_scale: the multiplier at step 0 (1.0: the single-device rate).
        base_learning_rate: the single-device learning rate; default: the
            optimizer's at `fit` start.

    Example:

    >>> import keras, numpy as np, tfdist
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    >>> warmup = tfdist.callbacks.LearningRateWarmup(warmup_steps=4, scale=8)
    >>> _ = model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, epochs=2, verbose=0, callbacks=[warmup])
    >>> round(float(model.optimizer.learning_rate), 4)
    0.08
    """

    def __init__(self, *, warmup_steps: int, scale="replicas", initial_scale: float = 1.0, base_learning_rate=None):
        super().__init__()
        self.warmup_steps = _check_steps(warmup_steps)
        if scale != "replicas":
            _check_factor("scale", scale)
        self.scale = scale
        self.initial_scale = _check_factor("initial_scale", initial_scale)
        self.base_learning_rate = (
            None if base_learning_rate is None else _check_factor("base_learning_rate", base_learning_rate)
        )

    def set_model(self, model):
        super().set_model(model)
        optimizer = model.optimizer
        try:
            optimizer.learning_rate = optimizer.learning_rate
        except TypeError as e:
            raise ValueError(
                "LearningRateWarmup needs an optimizer with a constant learning rate; this one uses a schedule. "
                "Pass learning_rate=tfdist.callbacks.WarmupSchedule(schedule, warmup_steps=..., scale=...) to the "
                "optimizer instead."
            ) from e
        if self.base_learning_rate is None:
            self.base_learning_rate = float(np.asarray(optimizer.learning_rate.numpy()))

    def on_train_batch_begin(self, batch, logs=None):
        optimizer = self.model.optimizer
        if self.scale == "replicas":
            scale = topology.of(self.model.distribute_strategy).data_parallel_size
        else:
            scale = self.scale
        factor = _warmup_factor(optimizer.iterations, self.warmup_steps, float(scale), self.initial_scale)
        optimizer.learning_rate = self.base_learning_rate * float(factor)
