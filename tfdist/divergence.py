"""tfdist.check: trains a few steps on one device and under a strategy, and names the first difference.

The promise of every tfdist strategy is that it changes where the work runs,
never what is learned. `check` tests that promise for one model: it builds the
model twice (once with no strategy, once in the strategy's scope), copies the
one-device model's initial weights into the other, trains both on the same
batches, one `fit` step at a time (the strategy splits each batch as in
training), and after each step compares

1. the loss that step reports,
2. each trainable variable's gradient as the optimizer applied it (recorded
   inside the real step, at the optimizer's `update_step`: under
   `DataParallelStrategy` that is the all-reduced gradient each replica
   applies, under the DTensor strategies the global gradient in each
   device's layout, under `PipelineStrategy` the sum over micro-batches),
3. each variable's value,

on every device's copy (each replica's mirror, each DTensor shard): a replica
that missed an update differs even where the first replica is right.

The report names the first step, and in it the first quantity in the order
the step computes them: the loss (forward pass), then the gradients in the
order the backward pass produces them (from the model's last variable to its
first: a wrong gradient spreads to every variable before it), then the values.

Example:

>>> import keras, numpy as np, tfdist
>>> def build():
...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="dense")])
...     model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
...     return model
>>> data = (np.ones((8, 4), "float32"), np.zeros((8, 2), "float32"))
>>> report = tfdist.check(build, data, tfdist.DataParallelStrategy(devices=["CPU:0"]), steps=2, batch_size=4)
>>> report.equal, report.step
(True, None)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from tfdist import _validate
from tfdist.strategies import _extended

_RECORD_NAME = "tfdist_check_gradient"


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """When two numbers count as equal: `|a - b| <= atol + rtol * scale`.

    For the loss `scale` is the one-device loss; for a gradient or a variable it
    is the largest absolute entry of its one-device value, so the relative
    difference reads "off by this fraction of the variable's size" and entries
    near zero do not blow it up.

    Attributes:
        loss_rtol: relative tolerance of the loss.
        gradient_rtol: of each gradient, relative to its largest entry.
        value_rtol: of each variable's value, relative to its largest entry.
        atol: absolute slack (all-zero gradients, variables near zero).
        reason: why these numbers (printed in the report).
        value_scale_floor: the least scale a variable's value is compared at (an
            adaptive optimizer's learning rate: see `default_tolerance`; 0 for SGD).
    """

    loss_rtol: float
    gradient_rtol: float
    value_rtol: float
    atol: float
    reason: str
    value_scale_floor: float = 0.0

    def allowed(self, scale: float, kind: str) -> float:
        """The largest difference allowed for a `kind` ("loss", "gradient", "value") of size `scale`."""
        if kind == "value":
            scale = max(scale, self.value_scale_floor)
        return self.atol + getattr(self, f"{kind}_rtol") * scale


def default_tolerance(optimizer, *, rtol: float | None = None, atol: float | None = None) -> Tolerance:
    """The tolerance for a model trained with `optimizer` (a Keras optimizer), `rtol` / `atol` overriding.

    SGD (plain, momentum, Nesterov) updates linearly in the gradient: a strategy
    changes only the order of float32 sums (an all-reduce, a split matmul), so
    losses, gradients and weights agree to about 1e-7 and 1e-5 is tight.
    Adaptive optimizers (Adam, AdamW, RMSprop, Adagrad, Lion, ...) divide by
    a running norm of the gradient: a rounding difference in an entry near zero
    becomes a difference of up to the learning rate in its update, for every
    strategy, even TensorFlow's own MirroredStrategy. Their losses and
    gradients still agree to 1e-4, their values to 1e-3 of each variable's
    largest entry, or of the learning rate where that is larger: a variable
    whose gradient is only rounding noise (an attention key's bias, which
    softmax ignores) moves by up to the learning rate a step from noise alone.

    Example:

    >>> default_tolerance(keras.optimizers.SGD(0.1)).value_rtol
    1e-05
    >>> default_tolerance(keras.optimizers.Adam(), rtol=1e-2).value_rtol
    0.01
    >>> round(default_tolerance(keras.optimizers.Adam(1e-3)).allowed(1e-7, "value"), 10)  # 1e-7 + 1e-3 * 1e-3
    1.1e-06
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    name = type(inner).__name__
    if isinstance(inner, keras.optimizers.SGD):
        tolerance = Tolerance(1e-5, 1e-5, 1e-5, 1e-7, f"{name}: an update linear in the gradient, float32 rounding")
    else:
        rate = float(keras.ops.convert_to_numpy(inner.learning_rate))
        tolerance = Tolerance(
            1e-4, 1e-4, 1e-3, 1e-7,
            f"{name}: adaptive, it divides by a running gradient norm, which amplifies rounding of entries near "
            f"zero; values compared to 1e-3 of each variable's largest entry or of the learning rate ({rate:g}), "
            "which a variable whose gradient is rounding noise moves by",
            value_scale_floor=rate,
        )
    if rtol is not None:
        tolerance = dataclasses.replace(
            tolerance, loss_rtol=rtol, gradient_rtol=rtol, value_rtol=rtol, reason=f"rtol={rtol:g} given"
        )
    if atol is not None:
        tolerance = dataclasses.replace(tolerance, atol=atol, reason=f"{tolerance.reason}; atol={atol:g} given")
    return tolerance


@dataclasses.dataclass(frozen=True)
class Difference:
    """One compared quantity at one step: its largest difference, where, and what the tolerance allowed.

    Attributes:
        step: the training step, from 1.
        kind: "loss", "gradient" or "value".
        variable: the Keras path of the variable (the strategy model's), or None for the loss.
        difference: the largest absolute difference over every device's copy.
        scale: the one-device loss, or the largest absolute entry of the one-device value.
        allowed: the largest difference the tolerance allows (`atol + rtol * scale`).
        device: the device whose copy differs most ("" for the loss).
    """

    step: int
    kind: str
    variable: str | None
    difference: float
    scale: float
    allowed: float
    device: str

    @property
    def within(self) -> bool:
        """Whether the difference is within tolerance."""
        return self.difference <= self.allowed

    @property
    def relative(self) -> float:
        """`difference / scale` (infinite when the one-device value is zero and this one is not)."""
        if self.scale:
            return self.difference / self.scale
        return 0.0 if not self.difference else math.inf

    @property
    def ratio(self) -> float:
        """`difference / allowed`: above 1 beyond tolerance."""
        return self.difference / self.allowed if self.allowed else (0.0 if not self.difference else math.inf)

    def describe(self) -> str:
        """One line: what differs, by how much, where."""
        where = f" on {self.device}" if self.device else ""
        what = "the loss" if self.kind == "loss" else f"the {self.kind} of {self.variable}"
        return (
            f"{what} is {self.difference:.3g} off ({self.relative:.3g} of {self.scale:.3g}; tolerance "
            f"{self.allowed:.3g}){where}"
        )


_KINDS = ("loss", "gradient", "value")


@dataclasses.dataclass(frozen=True)
class CheckReport:
    """What `tfdist.check` found; `str(report)` is a one-screen summary.

    Attributes:
        strategy: the strategy's class name.
        steps: the steps compared.
        tolerance: the `Tolerance` used.
        differences: every comparison, step by step, in the order the step computes them: the loss, the
            gradients from the last trainable variable to the first (the backward pass), the values.
        seconds: how long the check took.
        device_bytes: the bytes of the model's variables and optimizer state on the device holding the most
            under the strategy (each device's copy or shard, as placed).
        reference_bytes: the same on one device.
    """

    strategy: str
    steps: int
    tolerance: Tolerance
    differences: tuple[Difference, ...]
    seconds: float
    device_bytes: int = 0
    reference_bytes: int = 0

    def beyond(self, step: int | None = None) -> list[Difference]:
        """The comparisons beyond tolerance (at `step` only, if given), in the order the step computes them."""
        return [d for d in self.differences if not d.within and (step is None or d.step == step)]

    @property
    def equal(self) -> bool:
        """Whether everything agreed within tolerance."""
        return not self.beyond()

    @property
    def step(self) -> int | None:
        """The first step with a difference beyond tolerance, or None."""
        found = self.beyond()
        return found[0].step if found else None

    @property
    def first(self) -> Difference | None:
        """The first variable's difference at `step` (a gradient, else a value), else the loss's; None if equal.

        Gradients come in backward order: the first that differs is the one nearest where the step went
        wrong (the variables before it in the model get their gradients through it).
        """
        found = self.beyond(self.step) if self.step is not None else []
        return next((d for d in found if d.variable is not None), found[0] if found else None)

    @property
    def variable(self) -> str | None:
        """The Keras path of the variable `first` names (None when equal, or when only the loss differs)."""
        return None if self.first is None else self.first.variable

    @property
    def kind(self) -> str | None:
        """"gradient", "value" or "loss" for `first`, or None."""
        return None if self.first is None else self.first.kind

    @property
    def loss_differs(self) -> bool:
        """Whether the loss is beyond tolerance at `step`."""
        return any(d.kind == "loss" for d in self.beyond(self.step)) if self.step is not None else False

    def largest(self, step: int, kind: str) -> Difference | None:
        """The comparison of `kind` at `step` nearest to (or furthest beyond) its tolerance."""
        return max((d for d in self.differences if d.step == step and d.kind == kind), key=lambda d: d.ratio,
                   default=None)

    def to_dict(self) -> dict:
        """The report as plain data (JSON-ready)."""
        first = self.first
        return {
            "strategy": self.strategy,
            "steps": self.steps,
            "equal": self.equal,
            "step": self.step,
            "kind": self.kind,
            "variable": self.variable,
            "device": None if first is None else first.device,
            "loss_differs": self.loss_differs,
            "beyond": [(d.step, d.kind, d.variable) for d in self.beyond()],
            "tolerance": dataclasses.asdict(self.tolerance),
            "seconds": self.seconds,
            "device_bytes": self.device_bytes,
            "reference_bytes": self.reference_bytes,
            # per kind, the largest difference relative to the one-device size, atol's slack counted as size
            # (difference / (scale + atol / rtol), i.e. ratio * rtol): at most rtol when within tolerance, and a
            # variable that is zero on one device (all-zero gradients) does not read as 100% off.
            "largest": {
                kind: max(
                    (d.ratio * getattr(self.tolerance, f"{kind}_rtol") for d in self.differences if d.kind == kind),
                    default=0.0,
                )
                for kind in _KINDS
            },
        }

    def __str__(self) -> str:
        t = self.tolerance
        lines = [
            f"tfdist.check: {self.strategy} against one device, {self.steps} step(s), {self.seconds:.1f} s",
            f"tolerance: |a - b| <= {t.atol:g} + rtol * scale, scale = the one-device loss or the variable's largest "
            f"entry; rtol {t.loss_rtol:g} (loss), {t.gradient_rtol:g} (gradients), {t.value_rtol:g} (values): "
            f"{t.reason}",
            "",
            "step  per kind, the comparison nearest its tolerance: difference / tolerance (! beyond it)",
        ]
        for step in range(1, self.steps + 1):
            cells = []
            for kind in _KINDS:
                d = self.largest(step, kind)
                if d is not None:
                    mark = "" if d.within else " !"
                    cells.append(f"{kind} {d.ratio:.2g}{mark}" + (f" {d.variable}" if d.variable else ""))
            lines.append(f"{step:>4}  " + "; ".join(cells))
        if self.reference_bytes:
            lines.append(
                f"state (weights and optimizer) on the fullest device: {self.device_bytes:,} bytes, "
                f"{self.device_bytes / self.reference_bytes:.2f} of one device's {self.reference_bytes:,}"
            )
        lines.append("")
        first = self.first
        if first is None:
            lines.append(
                f"EQUAL within tolerance: {self.steps} step(s), the loss, every gradient and every variable on every "
                "device."
            )
            return "\n".join(lines)
        lines.append(f"DIFFERENT from step {first.step}: {first.describe()}.")
        also = [d for d in self.beyond(first.step) if d is not first]
        if also:
            names = ", ".join(f"{d.kind} {d.variable or ''}".strip() for d in also[:4])
            more = f" and {len(also) - 4} more" if len(also) > 4 else ""
            lines.append(f"Also beyond tolerance at step {first.step}: {names}{more}.")
        if first.kind == "gradient":
            lines.append(
                "Gradients are compared in the order the backward pass computes them (the model's last variable "
                "first): the variables before this one get their gradients through it."
            )
        elif first.kind == "value":
            lines.append(
                "Its gradient agreed at this step: the update differs (optimizer state, the rows of a sparse "
                "gradient, or a device whose copy missed the update)."
            )
        return "\n".join(lines)


def check(
    build_model: Callable[[], keras.Model],
    data,
    strategy: tf.distribute.Strategy,
    *,
    steps: int = 3,
    batch_size: int | None = None,
    rtol: float | None = None,
    atol: float | None = None,
) -> CheckReport:
    """Trains `steps` steps on one device and under `strategy`, and names the first difference.

    Args:
        build_model: a function with no arguments returning a compiled, built
            `keras.Model` (give it a `keras.Input`). It is called twice: with
            no strategy (the reference) and in `strategy.scope()`. The
            reference's initial weights are copied into the second model.
        data: the batches, in a fixed order: a `tf.data.Dataset` of batches
            (the first `steps` are used), or a tuple `(x,)`, `(x, y)` or
            `(x, y, sample_weight)` of arrays (or structures of arrays), cut
            into `steps` batches of `batch_size`.
        strategy: the `tf.distribute.Strategy` to check (any tfdist strategy,
            or TensorFlow's own).
        steps: how many training steps to compare.
        batch_size: examples per step for array `data` (default 32, as
            `fit`); None for a dataset, which is batched already.
        rtol: relative tolerance for the loss, the gradients and the values,
            instead of the optimizer's default (`default_tolerance`).
        atol: absolute tolerance, instead of 1e-7.

    Returns:
        A `CheckReport`; `print(report)` shows it, `report.equal`,
        `report.step` and `report.variable` say what differs first.

    Raises:
        ValueError: for a bad argument, a model that is not compiled or not
            built, data with fewer than `steps` batches, or models whose
            variables differ in number or shape.
        TypeError: for `data` that is neither a dataset nor a tuple of arrays.
    """
    started = time.perf_counter()
    if not callable(build_model):
        raise _validate.invalid("build_model", build_model, "a function with no arguments returning a compiled model")
    if not isinstance(strategy, tf.distribute.Strategy):
        raise _validate.invalid("strategy", strategy, "a tf.distribute.Strategy, e.g. tfdist.DataParallelStrategy()")
    _validate.integer("steps", steps)
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and (not _validate.is_number(value) or not 0 <= value < math.inf):
            raise _validate.invalid(name, value, "a finite number >= 0, or None (the optimizer's default)")
    if tf.distribute.has_strategy():
        raise ValueError(
            f"tfdist.check was called inside the scope of {type(tf.distribute.get_strategy()).__name__}: it builds the "
            "one-device model with no strategy and the other in `strategy.scope()` itself. Call it outside any scope."
        )
    batches = _batches(data, steps, batch_size)

    reference = _model(build_model, "with no strategy")
    with strategy.scope():
        model = _model(build_model, f"in {type(strategy).__name__}.scope()")
    _check_same_variables(reference, model)
    model.set_weights(reference.get_weights())
    tolerance = default_tolerance(reference.optimizer, rtol=rtol, atol=atol)  # the same optimizer, off the mesh
    extended = _extended.extended_of(strategy)
    copies = extended._tfdist_device_copies if extended is not None else _extended.device_copies

    names = [v.path for v in model.variables]
    trainable = [names[i] for i in _trainable_positions(model)]
    compared = [i for i, v in enumerate(model.variables) if tf.as_dtype(v.dtype).is_floating]
    differences = []
    with _recording(reference, contextlib.nullcontext()) as ref_grads, _recording(model, strategy.scope()) as grads:
        for step, batch in enumerate(batches, start=1):
            ref_loss, loss = _fit_step(reference, batch), _fit_step(model, batch)
            scale = abs(ref_loss)
            differences.append(
                Difference(step, "loss", None, abs(loss - ref_loss), scale, tolerance.allowed(scale, "loss"), "")
            )
            for i in reversed(range(len(trainable))):  # the order the backward pass computes them
                differences.append(
                    _compare(step, "gradient", trainable[i], ref_grads[i].numpy(), copies(grads[i]), tolerance)
                )
            for i in compared:
                differences.append(
                    _compare(step, "value", names[i], reference.variables[i].numpy(), copies(model.variables[i]),
                             tolerance)
                )
    return CheckReport(
        type(strategy).__name__, steps, tolerance, tuple(differences), time.perf_counter() - started,
        device_bytes=max(_bytes_per_device(model, copies).values(), default=0),
        reference_bytes=sum(_bytes_per_device(reference, _extended.device_copies).values()),
    )


def _bytes_per_device(model, copies) -> dict[str, int]:
    """The bytes of `model`'s variables and optimizer state (not the check's records) on each device."""
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    state = {id(v): v for v in (*model.variables, *model.optimizer.variables, *optimizer.variables)}
    found: dict[str, int] = {}
    for v in state.values():
        if _RECORD_NAME in v.path:
            continue
        for device, _, array in copies(v):
            found[device] = found.get(device, 0) + array.nbytes
    return found


def _fit_step(model, batch) -> float:
    """Trains `model` one step on `batch` with `fit` (as training does: the strategy splits the batch); its loss.

    Not `train_on_batch`: under a MirroredStrategy it gives every replica the whole batch.
    """
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(batch)
    size = len(keras.tree.flatten(x)[0])
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=size, epochs=1, shuffle=False, verbose=0)
    return float(history.history["loss"][-1])


def _compare(step, kind, name, expected, copies, tolerance) -> Difference:
    """The largest difference between the one-device `expected` and each device's copy (`device_copies`)."""
    expected = np.asarray(expected, np.float64)
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    worst, where = 0.0, ""
    for device, index, array in copies:
        part = np.asarray(array, np.float64)
        gap = float(np.max(np.abs(part - expected[index]))) if part.size else 0.0
        if not math.isfinite(gap) or gap > worst:
            worst, where = (math.inf if not math.isfinite(gap) else gap), device
            if not math.isfinite(gap):
                break
    return Difference(step, kind, name, worst, scale, tolerance.allowed(scale, kind), where)


def _model(build_model, where: str) -> keras.Model:
    model = build_model()
    if not isinstance(model, keras.Model):
        raise ValueError(f"build_model() returned {model!r} ({where}); expected a compiled keras.Model.")
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", False):
        raise ValueError(
            f"build_model() returned the uncompiled model {model.name!r} ({where}). Expected a compiled model: call "
            "model.compile(optimizer=..., loss=...) in build_model before returning it."
        )
    if not model.built:
        raise ValueError(
            f"build_model() returned model {model.name!r} ({where}) with no weights yet (not built). Give it a "
            "keras.Input, or call model.build(input_shape) in build_model before returning it."
        )
    return model


def _check_same_variables(reference, model) -> None:
    ref_shapes = [tuple(v.shape) for v in reference.variables]
    shapes = [tuple(v.shape) for v in model.variables]
    if ref_shapes != shapes:
        raise ValueError(
            f"build_model() made models whose variables differ: {len(ref_shapes)} with no strategy, {len(shapes)} "
            "under the strategy (or shapes differ). It must build the same model on every call; variables are "
            "compared in the model's order."
        )


def _trainable_positions(model) -> list[int]:
    ids = {id(v): i for i, v in enumerate(model.variables)}
    return [ids[id(v)] for v in model.trainable_variables if id(v) in ids]


def _batches(data, steps: int, batch_size: int | None) -> list:
    """The first `steps` batches of `data` as host numpy structures."""
    if isinstance(data, tf.data.Dataset):
        if batch_size is not None:
            raise _validate.invalid(
                "batch_size", batch_size, "None for a tf.data.Dataset, which yields batches already"
            )
        batches = [keras.tree.map_structure(np.asarray, b) for b in data.take(steps).as_numpy_iterator()]
        if len(batches) < steps:
            raise ValueError(f"`data` yields {len(batches)} batch(es); steps={steps} needs {steps}. Lower steps.")
        return batches
    if not isinstance(data, tuple) or not 1 <= len(data) <= 3:
        raise TypeError(
            f"Invalid `data`: {type(data).__name__}. Expected a tf.data.Dataset of batches, or a tuple (x,), (x, y) or "
            "(x, y, sample_weight) of arrays."
        )
    batch_size = _validate.integer("batch_size", 32 if batch_size is None else batch_size)
    leaves = keras.tree.flatten(data)
    counts = {len(leaf) for leaf in leaves if leaf is not None}
    if len(counts) != 1:
        raise ValueError(f"The arrays of `data` have different numbers of examples: {sorted(counts)}.")
    (count,) = counts
    if count < steps * batch_size:
        raise ValueError(
            f"`data` has {count} examples; steps={steps} batches of batch_size={batch_size} need {steps * batch_size}. "
            "Lower steps or batch_size, or give more examples."
        )

    def cut(i):
        return keras.tree.map_structure(
            lambda a: None if a is None else np.asarray(a[i * batch_size : (i + 1) * batch_size]), data
        )

    return [cut(i) for i in range(steps)]


@contextlib.contextmanager
def _recording(model, scope):
    """Records each gradient the model's optimizer applies into a variable laid out as the optimizer's slots.

    Yields the record variables, in `model.trainable_variables` order. The
    optimizer's `update_step(gradient, variable, learning_rate)` (what every
    Keras optimizer runs per variable, on each device's copy, with the gradient
    it applies) is wrapped on this optimizer object for the duration.
    """
    optimizer = model.optimizer
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer applies through its inner one
    trainable = model.trainable_variables
    with scope:
        if not optimizer.built:
            optimizer.build(trainable)
        records = [inner.add_variable_from_reference(v, name=_RECORD_NAME) for v in trainable]
    original = inner.update_step

    def position(variable):
        # Looked up at each call: a strategy may have replaced a variable (a pipeline moves weights to their stage).
        for i, v in enumerate(trainable):
            value = v.value
            if variable is value or any(variable is c for c in getattr(value, "values", ())):
                return i
        return None

    def update_step(gradient, variable, learning_rate):
        i = position(variable)
        if i is not None:
            dense = tf.convert_to_tensor(gradient) if isinstance(gradient, tf.IndexedSlices) else gradient
            inner.assign(records[i], dense)
        return original(gradient, variable, learning_rate)

    inner.update_step = update_step
    try:
        yield records
    finally:
        del inner.update_step
