"""How to train a model, decided from measurements: `recommend(Measurements) -> Recommendation`, pure Python.

`tfdist.advise` (in `tfdist.advisor`) measures a model on the devices at
hand and passes the numbers here; this module imports no TensorFlow, so the
rules can be read, tested and reused on numbers measured elsewhere.

The rules, in order (`usable` = `MEMORY_HEADROOM` x one device's memory; the
model's *state* = its weights + optimizer slots):

1. State and the whole batch's activations fit one device: "data parallel"
   (`DataParallelStrategy`) when the predicted data-parallel speed-up is at
   least `min_speedup`, else "one device" (communication or shared compute
   would eat the gain).
2. They do not, but state + 1/N of the activations does: "data parallel", to fit.
3. They do not either, but the state split over the N devices does:
   "data parallel" with `ShardedDataParallelStrategy`, whose persistent bytes
   per device are `Measurements.sharded_bytes`: `shard="optimizer"` (ZeRO-1:
   the weights whole, the optimizer slots split; with Adam in float32 4 + 8/N
   bytes per parameter instead of 12) when that + 1/N of the activations
   fits, else `shard="weights"` (ZeRO-3 / FSDP: both split, 12/N). It is
   chosen over splitting the model: no layout rules to write, and each device
   computes as under data parallelism (the whole model on 1/N of the batch).
4. Otherwise the model must be split, by stages or within its layers:

   - pipeline parallelism (`PipelineStrategy`) when the model is a deep
     stack: its top-level layers with weights split into k consecutive stages
     (k a divisor of N) of at least `MIN_LAYERS_PER_STAGE` layers each, the
     heaviest stage holding at most `PIPELINE_BALANCE` x state / k; the
     heaviest stage + 1/N of the activations fits a device; each of the N / k
     pipeline replicas' batch splits into at least 2(k - 1) micro-batches
     (the bubble, (k - 1) / (M + k - 1) of a step, at most a third); and k is
     no larger than the model axis model parallelism would need. A pipeline
     then sends activations only across its k - 1 stage boundaries, where a
     model axis runs collectives inside every split layer, forward and
     backward;
   - else a mesh for `ModelParallelStrategy` with the smallest model axis m
     (a divisor of N) at which state / m + activations / (N / m) fits.

   Either is "model parallel" when one copy of the model spans all N devices,
   "hybrid" when there are several copies trained data-parallel. When
   everything of the state splits over the data axis, rule 3 needs no more
   memory than any of these (state / N + activations / N is the least); they
   come into play for state that sharded data parallelism keeps whole
   (`Measurements.unsharded_parameter_bytes`, `unsharded_optimizer_bytes`).

Example:

>>> from tfdist.advice import Measurements, recommend
>>> measured = Measurements(
...     devices=("GPU:0", "GPU:1"), batch_size=64, step_time=0.010, compute_time=0.008,
...     parallel_compute_time=0.0042, gradient_bytes=4 << 20, all_reduce_time=0.0005, overhead_time=0.0002,
...     parameter_bytes=4 << 20, optimizer_bytes=8 << 20, activation_bytes=16 << 20, device_memory=16 << 30)
>>> result = recommend(measured)
>>> result.recommendation, result.mesh, result.strategy
('data parallel', {'batch': 2}, 'DataParallelStrategy')
"""

from __future__ import annotations

import dataclasses
import math

from tfdist import _validate

RECOMMENDATIONS = ("one device", "data parallel", "model parallel", "hybrid")
STRATEGIES = ("DataParallelStrategy", "ShardedDataParallelStrategy", "ModelParallelStrategy", "PipelineStrategy")
"""The tfdist strategy a `Recommendation` names (None for one device)."""
MEMORY_HEADROOM = 0.9  # plan to fill at most this share of a device's memory
MIN_LAYERS_PER_STAGE = 2  # a pipeline stage of fewer layers leaves balance to single layers
PIPELINE_BALANCE = 1.25  # the heaviest stage may hold this much more than an even share
MAX_MICROBATCHES_PER_STAGE = 4  # micro-batches per stage planned: bubble (k-1)/(4k+k-1) < 20%
SHARD_MODES = ("optimizer", "weights")
"""The `shard` modes of `ShardedDataParallelStrategy` a `Recommendation` names, in the order they are tried."""


def _nonnegative(name: str, value, *, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value >= 0 or value == math.inf:
        expected = "an integer >= 0" if integer else "a finite number >= 0"
        raise ValueError(f"Invalid value for `Measurements.{name}`. Received: {name}={value!r}. Expected {expected}.")


@dataclasses.dataclass(frozen=True)
class Measurements:
    """What `recommend` decides from. Times are seconds (medians over rounds), sizes bytes.

    Attributes:
        devices: the devices measured (names; N = their number).
        batch_size: the global batch measured.
        step_time: one training step of the whole batch on one device.
        compute_time: its forward and backward pass alone.
        parallel_compute_time: forward and backward of batch/N on each of the N devices at once
            (`compute_time` for one device).
        gradient_bytes: bytes of the trainable weights' gradients.
        all_reduce_time: all-reduce of those gradients over the N devices (0 for one device).
        overhead_time: what a data-parallel training step adds that does not grow with the model
            (input splitting and copying, the strategy's per-step work), measured with a model
            that does almost nothing on the same batch (0 when not measured).
        parameter_bytes: all weights.
        optimizer_bytes: the optimizer's slots (e.g. Adam's two moments).
        activation_bytes: forward intermediates of the whole batch (an estimate from the traced graph).
        device_memory: memory of one device; None when unknown.
        layer_bytes: weight bytes of each top-level layer that has weights, in the model's order
            (what a pipeline splits into stages); empty when not measured. Each layer's optimizer
            slots are taken to be in proportion to its weights.
        unsharded_parameter_bytes: of `parameter_bytes`, what `ShardedDataParallelStrategy` over the
            N devices keeps whole on each of them (non-trainable weights, and weights with fewer
            than its `min_size` elements or with no dimension N divides); 0 (the default) when
            everything splits.
        unsharded_optimizer_bytes: of `optimizer_bytes`, the slots it keeps whole (those of such
            weights); 0 by default.

    Raises:
        ValueError: for no devices, a batch smaller than the devices, a time or size that is
            negative or not a number, or unsharded bytes larger than the bytes they are part of,
            naming the field.
    """

    devices: tuple
    batch_size: int
    step_time: float
    compute_time: float
    parallel_compute_time: float
    gradient_bytes: int
    all_reduce_time: float
    overhead_time: float
    parameter_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    device_memory: int | None
    layer_bytes: tuple = dataclasses.field(default=(), kw_only=True)
    unsharded_parameter_bytes: int = dataclasses.field(default=0, kw_only=True)
    unsharded_optimizer_bytes: int = dataclasses.field(default=0, kw_only=True)

    def __post_init__(self):
        if isinstance(self.devices, str) or not self.devices:
            raise ValueError(
                f"Invalid value for `Measurements.devices`. Received: devices={self.devices!r}. Expected a "
                "non-empty tuple of device names."
            )
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "layer_bytes", tuple(self.layer_bytes))
        for name in ("step_time", "compute_time", "parallel_compute_time", "all_reduce_time", "overhead_time"):
            _nonnegative(name, getattr(self, name))
        for name in ("batch_size", "gradient_bytes", "parameter_bytes", "optimizer_bytes", "activation_bytes",
                     "unsharded_parameter_bytes", "unsharded_optimizer_bytes"):
            _nonnegative(name, getattr(self, name), integer=True)
        for part in ("parameter_bytes", "optimizer_bytes"):
            if getattr(self, f"unsharded_{part}") > getattr(self, part):
                raise ValueError(
                    f"Invalid value for `Measurements.unsharded_{part}`. Received: unsharded_{part}="
                    f"{getattr(self, f'unsharded_{part}')!r}, more than {part}={getattr(self, part)!r}. Expected "
                    f"at most {part}: the part of it that sharded data parallelism keeps whole."
                )
        if self.device_memory is not None:
            _nonnegative("device_memory", self.device_memory, integer=True)
        for i, size in enumerate(self.layer_bytes):
            _nonnegative(f"layer_bytes[{i}]", size, integer=True)
        if self.batch_size < len(self.devices):
            raise ValueError(
                f"Invalid value for `Measurements.batch_size`: {self.batch_size} example(s) cannot be split over "
                f"{len(self.devices)} devices. Expected at least {len(self.devices)}."
            )
        if self.parallel_compute_time <= 0 or self.step_time <= 0:
            raise ValueError(
                "Invalid `Measurements`: step_time and parallel_compute_time must be > 0. Received: "
                f"step_time={self.step_time!r}, parallel_compute_time={self.parallel_compute_time!r}."
            )

    @property
    def compute_speedup(self) -> float:
        """How much faster N devices compute 1/N of the batch each than one device the whole batch."""
        return self.compute_time / self.parallel_compute_time

    @property
    def memory_bytes(self) -> int:
        """Parameters + optimizer slots + activations, all on one device."""
        return self.parameter_bytes + self.optimizer_bytes + self.activation_bytes

    def sharded_bytes(self, shard: str) -> int:
        """Persistent bytes per device (weights + optimizer slots) under `ShardedDataParallelStrategy(shard=shard)`.

        Over the N devices: "optimizer" (ZeRO-1) keeps the weights whole and
        1/N of the optimizer slots; "weights" (ZeRO-3) 1/N of both. What the
        strategy keeps whole (`unsharded_parameter_bytes`,
        `unsharded_optimizer_bytes`) counts in full. With Adam's two float32
        moments per float32 weight, that is 4 + 8/N and 12/N bytes per
        parameter (data parallelism: 12). Rounded up to a whole byte.

        Args:
            shard: "optimizer" or "weights".

        Returns:
            The bytes each device keeps between steps (activations, gradients
            and gathered weights come and go within a step).

        Raises:
            ValueError: for a `shard` that is not one of `SHARD_MODES`.

        Example:

        >>> from tfdist.advice import Measurements
        >>> params = 1_000_000  # float32, with Adam's two float32 moments each
        >>> m = Measurements(
        ...     devices=("GPU:0", "GPU:1", "GPU:2", "GPU:3"), batch_size=8, step_time=0.01, compute_time=0.008,
        ...     parallel_compute_time=0.003, gradient_bytes=4 * params, all_reduce_time=0.001, overhead_time=0.0,
        ...     parameter_bytes=4 * params, optimizer_bytes=8 * params, activation_bytes=0, device_memory=None)
        >>> m.sharded_bytes("optimizer") / params, m.sharded_bytes("weights") / params  # 4 + 8/4, 12/4
        (6.0, 3.0)
        """
        shard = _validate.one_of("shard", shard, SHARD_MODES, where=" of Measurements.sharded_bytes()")
        n = len(self.devices)
        kept = self.unsharded_parameter_bytes + self.unsharded_optimizer_bytes
        split = self.optimizer_bytes - self.unsharded_optimizer_bytes
        if shard == "weights":
            split += self.parameter_bytes - self.unsharded_parameter_bytes
        else:
            kept += self.parameter_bytes - self.unsharded_parameter_bytes
        return kept + -(-split // n)


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """What `recommend` says.

    Attributes:
        recommendation: one of `RECOMMENDATIONS`.
        strategy: the tfdist strategy to train with (one of `STRATEGIES`); None for one device.
        mesh: how to lay out the devices: `{"batch": N}` for data parallel (`DataParallelStrategy` or
            `ShardedDataParallelStrategy`); `{"batch": b, "model": m}` for `ModelParallelStrategy`
            (b = 1: model parallel; else hybrid); `{"batch": r, "stage": k}` for `PipelineStrategy`
            (r replicas of k stages); None for one device.
        microbatches: the micro-batches per step for `PipelineStrategy`, else None.
        shard: the `shard` of `ShardedDataParallelStrategy` ("optimizer" or "weights"), else None.
        bytes_per_device: for `ShardedDataParallelStrategy`, the predicted persistent bytes of weights
            and optimizer slots on each device (`Measurements.sharded_bytes(shard)`), else None.
        predicted_step_time: data-parallel step over the N devices, predicted: (forward+backward of
            batch/N on N devices at once) + (all-reduce) + (optimizer update, measured on one device,
            for N copies at the measured concurrency) + (per-step overhead).
        predicted_speedup: `step_time / predicted_step_time`.
        reasons: the sentences behind the recommendation.
    """

    recommendation: str
    strategy: str | None
    mesh: dict | None
    microbatches: int | None
    predicted_step_time: float
    predicted_speedup: float
    reasons: tuple
    shard: str | None = dataclasses.field(default=None, kw_only=True)
    bytes_per_device: int | None = dataclasses.field(default=None, kw_only=True)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _size(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"


def _divisors(n: int) -> list[int]:
    """The divisors of `n` from 2 up."""
    return [d for d in range(2, n + 1) if n % d == 0]


def _mesh_for_memory(state: int, activations: int, n: int, usable: float) -> dict | None:
    """The smallest model axis m (a divisor of n) whose mesh {batch: n/m, model: m} fits, or None."""
    for m in _divisors(n):
        if state / m + activations / (n // m) <= usable:
            return {"batch": n // m, "model": m}
    return None


def _heaviest_stage(sizes, k: int) -> float:
    """The smallest possible largest sum of `sizes` split into `k` consecutive non-empty groups."""
    prefix = [0.0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    # best[j][i]: the first i sizes in j groups.
    best = [[math.inf] * (len(sizes) + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, len(sizes) + 1):
            best[j][i] = min(max(best[j - 1][h], prefix[i] - prefix[h]) for h in range(j - 1, i))
    return best[k][len(sizes)]


@dataclasses.dataclass(frozen=True)
class _Pipeline:
    stages: int
    replicas: int
    microbatches: int
    heaviest: float  # bytes of state of the heaviest stage

    @property
    def bubble(self) -> float:
        return (self.stages - 1) / (self.microbatches + self.stages - 1)


def _pipeline_for_memory(m: Measurements, usable: float) -> _Pipeline | None:
    """The pipeline with the fewest stages that fits under the rule in the module docstring, or None."""
    n, state = len(m.devices), m.parameter_bytes + m.optimizer_bytes
    layers = [b for b in m.layer_bytes if b > 0]
    weights = sum(layers)
    if not weights:
        return None
    share = state / weights  # each layer's optimizer slots in proportion to its weights
    for k in _divisors(n):
        if len(layers) < MIN_LAYERS_PER_STAGE * k:
            break
        heaviest = _heaviest_stage(layers, k) * share
        if heaviest > PIPELINE_BALANCE * state / k or heaviest + m.activation_bytes / n > usable:
            continue
        replicas = n // k
        per_replica = m.batch_size // replicas
        microbatches = max(d for d in range(1, MAX_MICROBATCHES_PER_STAGE * k + 1) if per_replica % d == 0)
        if microbatches >= 2 * (k - 1):
            return _Pipeline(stages=k, replicas=replicas, microbatches=microbatches, heaviest=heaviest)
    return None


def _sharded_for_memory(m: Measurements, usable: float, reasons: list) -> str | None:
    """The `shard` of `ShardedDataParallelStrategy` whose state + 1/N of the activations fits, or None.

    Appends the sentences behind it to `reasons`: why, and the bytes per device; or, for None, that
    not even ZeRO-3 fits.
    """
    n, state = len(m.devices), m.parameter_bytes + m.optimizer_bytes
    share = m.activation_bytes / n
    zero1, zero3 = m.sharded_bytes("optimizer"), m.sharded_bytes("weights")
    kept = m.unsharded_parameter_bytes + m.unsharded_optimizer_bytes
    whole = (
        f"; {_size(kept)} of the state stays whole on every device (non-trainable, or fewer elements than "
        f"min_size, or no dimension {n} divides)" if kept else ""
    )
    tail = f" + 1/{n} of the activations ({_size(share)})"
    if zero3 + share > usable:
        reasons.append(
            f"sharded data parallelism does not fit: even ZeRO-3 (shard='weights') keeps {_size(zero3)} per "
            f"device{tail} > {_size(usable)} usable{whole}"
        )
        return None
    reasons.append(
        f"weights and optimizer ({_size(state)}) do not fit one device next to 1/{n} of the activations "
        f"({_size(state + share)} > {_size(usable)} usable): split them over the {n} devices"
    )
    if zero1 + share <= usable:
        shard, held = "optimizer", (
            f"ZeRO-1 (shard='optimizer'): the weights whole ({_size(m.parameter_bytes)}) and 1/{n} of the optimizer "
            f"slots, {_size(zero1)} per device{tail} fits{whole}"
        )
    else:
        shard, held = "weights", (
            f"ZeRO-1 would keep {_size(zero1)} per device (the weights whole){tail}: too much; ZeRO-3 "
            f"(shard='weights', FSDP): 1/{n} of the weights and of the optimizer slots, {_size(zero3)} per "
            f"device{tail} fits{whole}"
        )
    reasons += [
        held,
        "sharded data parallelism rather than a model axis or pipeline stages: no layout rules to write, and "
        f"the same math as data parallel (each device runs the whole model on 1/{n} of the batch)",
        f"use tfdist.ShardedDataParallelStrategy(shard={shard!r})",
    ]
    return shard


def predicted_step_time(m: Measurements) -> float:
    """The data-parallel step over the N devices: parallel compute + all-reduce + N updates + overhead."""
    n = len(m.devices)
    if n == 1:
        return m.step_time
    update_time = max(0.0, m.step_time - m.compute_time) * n / min(max(m.compute_speedup, 1.0), n)
    return m.parallel_compute_time + m.all_reduce_time + update_time + m.overhead_time


def recommend(m: Measurements, *, min_speedup: float = 1.15) -> Recommendation:
    """How to train the measured model: the rules of this module's docstring, applied to `m`.

    Args:
        m: the measurements (`tfdist.advise` makes them; any source will do).
        min_speedup: the predicted data-parallel speed-up below which one device is recommended.

    Returns:
        A `Recommendation` with the reasons behind it.

    Raises:
        ValueError: for a `min_speedup` that is not a positive number.

    Example:

    >>> from tfdist.advice import Measurements, recommend
    >>> tiny = Measurements(
    ...     devices=("CPU:0",), batch_size=8, step_time=1e-4, compute_time=8e-5, parallel_compute_time=8e-5,
    ...     gradient_bytes=20, all_reduce_time=0.0, overhead_time=0.0, parameter_bytes=20, optimizer_bytes=0,
    ...     activation_bytes=64, device_memory=2**30)
    >>> recommend(tiny).recommendation
    'one device'
    """
    min_speedup = _validate.positive_number("min_speedup", min_speedup)
    n = len(m.devices)
    predicted = predicted_step_time(m)
    predicted_speedup = m.step_time / predicted
    state = m.parameter_bytes + m.optimizer_bytes
    parallel_time, activations = m.parallel_compute_time, m.activation_bytes
    reasons = []
    if m.device_memory is None:
        usable = math.inf
        reasons.append("device memory unknown: assumed to fit (pass device_memory= to check)")
    else:
        usable = MEMORY_HEADROOM * m.device_memory

    def result(recommendation, strategy=None, mesh=None, microbatches=None, shard=None):
        return Recommendation(
            recommendation=recommendation,
            strategy=strategy,
            mesh=mesh,
            microbatches=microbatches,
            predicted_step_time=predicted,
            predicted_speedup=predicted_speedup,
            reasons=tuple(reasons),
            shard=shard,
            bytes_per_device=None if shard is None else m.sharded_bytes(shard),
        )

    if state + activations <= usable:
        gain = f"predicted data-parallel speed-up {predicted_speedup:.2f}x on {n} devices"
        fits = f"the model and its whole batch fit one device ({_size(state + activations)})"
        if n > 1 and predicted_speedup >= min_speedup:
            reasons += [f"{gain} (>= {min_speedup:g}x)", fits]
            return result("data parallel", "DataParallelStrategy", {"batch": n})
        if n == 1:
            reasons.append("only one device at hand, and the model fits it")
        else:
            reasons.append(f"{gain} (< {min_speedup:g}x): not worth distributing")
            if m.all_reduce_time >= parallel_time:
                reasons.append(
                    f"communication would dominate: the all-reduce ({_ms(m.all_reduce_time)}) takes as long "
                    f"as the parallel compute ({_ms(parallel_time)})"
                )
            if m.compute_speedup < 0.5 * n:
                shared = ": simulated devices share the host cores" if "CPU" in m.devices[0] else ""
                reasons.append(
                    f"these devices compute only {m.compute_speedup:.2f}x faster together than one "
                    f"alone (ideal {n}x){shared}"
                )
        reasons.append(fits)
        return result("one device")
    if n > 1 and state + activations / n <= usable:
        reasons.append(
            f"the whole batch does not fit one device ({_size(state + activations)} > {_size(usable)} usable), "
            f"1/{n} of it does: data parallel to fit (predicted speed-up {predicted_speedup:.2f}x)"
        )
        return result("data parallel", "DataParallelStrategy", {"batch": n})
    if n > 1:
        shard = _sharded_for_memory(m, usable, reasons)
        if shard is not None:
            return result("data parallel", "ShardedDataParallelStrategy", {"batch": n}, shard=shard)

    mesh = _mesh_for_memory(state, activations, n, usable)
    pipeline = _pipeline_for_memory(m, usable)
    if pipeline is not None and (mesh is None or pipeline.stages <= mesh["model"]):
        k, r, micro = pipeline.stages, pipeline.replicas, pipeline.microbatches
        reasons += [
            f"weights and optimizer ({_size(state)}) do not fit next to the activations on one device "
            f"({_size(usable)} usable); the {len([b for b in m.layer_bytes if b > 0])} layers with weights split "
            f"into {k} balanced stages (the heaviest {_size(pipeline.heaviest)} + 1/{n} of the activations "
            "fits a device)",
            f"a pipeline sends activations only across its {k - 1} stage boundar{'y' if k == 2 else 'ies'}, "
            "where a model axis runs collectives inside every split layer"
            + (f" (and would need a model axis of {mesh['model']})" if mesh is not None else ""),
            f"{micro} micro-batches per step: the pipeline bubble is {pipeline.bubble:.0%} of a step",
            f"use tfdist.PipelineStrategy(stages={k}, microbatches={micro}, replicas={r})",
        ]
        return result("model parallel" if r == 1 else "hybrid", "PipelineStrategy", {"batch": r, "stage": k}, micro)
    if mesh is None:
        need = 2 ** math.ceil(math.log2(max(2, (state + activations) / usable)))
        mesh = {"batch": 1, "model": max(n, need)}
        reasons.append(
            f"does not fit even split over {n} device(s) ({_size(state / n + activations)} each > "
            f"{_size(usable)} usable): about {need} devices, or a smaller batch, are needed"
        )
    else:
        reasons.append(
            f"weights and optimizer ({_size(state)}) do not fit next to the activations on one device "
            f"({_size(usable)} usable); split over a model axis of {mesh['model']} they do"
        )
    reasons.append(f"use tfdist.ModelParallelStrategy(mesh={mesh}, rules=...)")
    return result("model parallel" if mesh["batch"] == 1 else "hybrid", "ModelParallelStrategy", mesh)


@dataclasses.dataclass(frozen=True)
class Advice(Recommendation, Measurements):
    """What `tfdist.advise` measured (`Measurements`' fields) and recommends (`Recommendation`'s fields).

    `print(advice)` shows the numbers behind the recommendation.
    """

    @classmethod
    def of(cls, measurements: Measurements, recommendation: Recommendation) -> Advice:
        fields = {f.name: getattr(measurements, f.name) for f in dataclasses.fields(Measurements)}
        fields.update({f.name: getattr(recommendation, f.name) for f in dataclasses.fields(Recommendation)})
        return cls(**fields)

    def __str__(self) -> str:
        n = len(self.devices)
        update = max(0.0, self.step_time - self.compute_time)
        memory = "unknown" if self.device_memory is None else _size(self.device_memory)
        lines = [
            f"tfdist.advise: batch {self.batch_size} on {n} device(s) {list(self.devices)}",
            f"  one device:        step {_ms(self.step_time)} (forward+backward {_ms(self.compute_time)}, "
            f"optimizer update {_ms(update)})",
        ]
        if n > 1:
            updates = self.predicted_step_time - self.parallel_compute_time - self.all_reduce_time - self.overhead_time
            lines += [
                f"  {n} devices at once: forward+backward of {self.batch_size // n} examples each "
                f"{_ms(self.parallel_compute_time)} (compute speed-up {self.compute_speedup:.2f}x of an ideal {n}x)",
                f"  gradients:         {_size(self.gradient_bytes)} all-reduced over {n} devices in "
                f"{_ms(self.all_reduce_time)}",
                f"  data parallel:     predicted step {_ms(self.predicted_step_time)} = "
                f"{_ms(self.parallel_compute_time)} compute + {_ms(self.all_reduce_time)} all-reduce + "
                f"{_ms(max(0.0, updates))} updating {n} copies + {_ms(self.overhead_time)} per-step overhead "
                f"-> speed-up {self.predicted_speedup:.2f}x",
            ]
        lines += [
            f"  memory:            parameters {_size(self.parameter_bytes)} + optimizer {_size(self.optimizer_bytes)}"
            f" + activations ~{_size(self.activation_bytes)} = {_size(self.memory_bytes)} on one device; "
            f"{memory} per device",
            f"Recommendation: {self.recommendation}"
            + (f" with tfdist.{self.strategy}" if self.strategy else "")
            + (f", mesh {self.mesh}" if self.mesh else "")
            + (f", shard={self.shard!r}: {_size(self.bytes_per_device)} per device" if self.shard else ""),
            *(f"  - {r}" for r in self.reasons),
        ]
        return "\n".join(lines)
