"""Should I distribute? `tfdist.advise` measures a model on the devices at hand and says how to train it.

This module measures (with TensorFlow); `tfdist.advice.recommend` decides from
the `Measurements`, in pure Python (its docstring states the rules). It times,
side by side on the devices you have:

- one training step of the whole batch on one device (forward, backward, optimizer update),
- the forward and backward pass of 1/N of the batch on each of the N devices at once: the compute
  speed-up these devices really give (on simulated CPU devices, which share the host's cores,
  it is far below N),
- the all-reduce of the model's gradient bytes over the N devices (tfdist's own all-reduce,
  `tfdist.strategies.collectives.all_reduce_gradients`),
- the per-step cost of a data-parallel `fit` that does not grow with the model,

and sizes the parameters, optimizer slots, forward activations, each top-level layer's
weights, and what sharded data parallelism over the N devices would keep whole. The
recommendation is one of `RECOMMENDATIONS` with the tfdist strategy and mesh (or pipeline
stages, or the `shard` of sharded data parallelism) to use.

The `tfdist-advise` binary (`python -m tfdist.advisor`) does this for a reference model.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import time

from tfdist.advice import MEMORY_HEADROOM
from tfdist.advice import RECOMMENDATIONS
from tfdist.advice import Advice
from tfdist.advice import Measurements
from tfdist.advice import recommend

__all__ = ["MEMORY_HEADROOM", "RECOMMENDATIONS", "Advice", "advise", "run"]

_ROUND_SECONDS = 0.1  # each timed round repeats a step until it lasts about this long
_SKIPPED_OPS = frozenset({"ReadVariableOp", "Const", "Placeholder", "VarHandleOp", "NoOp", "Identity", "Shape"})


def _bytes(variables) -> int:
    import tensorflow as tf

    return sum(math.prod(v.shape) * tf.as_dtype(v.dtype).size for v in variables)


def _device_memory(devices: list[str]) -> int | None:
    """Memory of one device: the GPU's total (nvidia-smi), or host RAM shared by the logical CPUs."""
    import tensorflow as tf

    if "GPU" in devices[0].upper():
        index = tf.DeviceSpec.from_string(devices[0]).device_index or 0
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                capture_output=True, text=True, timeout=30, check=True,
            ).stdout.split()
            return int(float(out[index]) * 2**20)
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None
    from tfdist import devices as devices_lib

    ram = devices_lib.host_memory()
    return None if ram is None else ram // max(1, len(tf.config.list_logical_devices("CPU")))


def _unsharded_bytes(model, n: int) -> tuple[int, int]:
    """Bytes of the weights and of the optimizer slots that `ShardedDataParallelStrategy` over `n` devices keeps whole.

    As the strategy decides (`AutoShard` with its default `min_size`): a trainable weight splits on a
    dimension `n` divides unless it has fewer than `min_size` elements; non-trainable weights stay
    whole; an optimizer slot follows the weight whose shape it has, and other slots stay whole.
    """
    from tfdist.strategies.model_parallel.auto_shard import DEFAULT_MIN_SIZE
    from tfdist.strategies.model_parallel.auto_shard import AutoShard

    plan = AutoShard(mode="weights", axis="batch", size=n, min_size=DEFAULT_MIN_SIZE)

    def splits(shape) -> bool:
        whole = (None,) * len(shape)
        return plan.extend(whole, shape)[0] != whole

    split = {tuple(v.shape) for v in model.trainable_variables if splits(v.shape)}
    weights = _bytes(v for v in model.weights if not (v.trainable and tuple(v.shape) in split))
    slots = _bytes(v for v in model.optimizer.variables if len(v.shape) > 0 and tuple(v.shape) not in split)
    return weights, slots


def _check_batch(batch):
    import tensorflow as tf

    if not isinstance(batch, (tuple, list)) or len(batch) not in (2, 3):
        raise ValueError(
            f"Invalid value for argument `batch`. Received: batch of type {type(batch).__name__}. "
            "Expected a tuple (x, y) or (x, y, sample_weight) holding one global batch of training data."
        )
    sizes = {int(tf.shape(leaf)[0]) for leaf in tf.nest.flatten(batch)}
    if len(sizes) != 1:
        raise ValueError(
            f"Invalid value for argument `batch`: its arrays have different batch sizes {sorted(sizes)}. "
            "Expected x, y (and sample_weight) with the same first dimension."
        )
    return tuple(batch), sizes.pop()


def _copy_optimizer(optimizer):
    import keras

    if isinstance(optimizer, keras.optimizers.Optimizer):
        return optimizer.__class__.from_config(optimizer.get_config())
    return keras.optimizers.get(optimizer)


def _clone(model, optimizer, strategy):
    """The model's architecture, weights and loss, compiled with a fresh `optimizer`, under `strategy`."""
    import keras

    with strategy.scope():
        clone = keras.models.clone_model(model)
        clone.set_weights(model.get_weights())
        clone.compile(optimizer=_copy_optimizer(optimizer), loss=model.loss)
        clone.optimizer.build(clone.trainable_variables)
    return clone


def _loss_and_grads(model, x, y, sample_weight=None):
    import tensorflow as tf

    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
    return loss, tape.gradient(loss, model.trainable_variables)


def _ready(outputs) -> list:
    """One element of each output (in replica context): fetching it waits for that output, copying nothing large."""
    import tensorflow as tf

    return [tf.reshape(t, [-1])[:1] for t in tf.nest.flatten(outputs) if t is not None]


def _time(fn, args, rounds: int) -> float:
    """Median seconds per call of `fn(*args)` over `rounds` rounds (after tracing and a warm-up)."""
    return _time_together({"fn": (fn, args)}, rounds)["fn"]


def _time_together(calls: dict, rounds: int) -> dict:
    """Median seconds per call of each `name: (fn, args)` of `calls`, their rounds interleaved.

    Each round times every call once, in an order that rotates from round to round, so that a
    slow spell of a shared host weighs on all of them alike and their ratios hold.
    """
    import tensorflow as tf

    def wait(result):
        for value in tf.nest.flatten(result):
            for t in getattr(value, "values", (value,)):
                t.numpy()

    iters = {}
    for name, (fn, args) in calls.items():
        wait(fn(*args))  # trace
        start = time.perf_counter()
        wait(fn(*args))
        iters[name] = max(1, min(100, int(_ROUND_SECONDS / max(time.perf_counter() - start, 1e-6))))
    names = list(calls)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, args = calls[name]
            start = time.perf_counter()
            for _ in range(iters[name] - 1):
                fn(*args)
            wait(fn(*args))
            times[name].append((time.perf_counter() - start) / iters[name])
    return {name: statistics.median(t) for name, t in times.items()}


def _activation_bytes(model, x) -> int:
    """Bytes of the float tensors the traced forward pass of batch `x` produces."""
    import tensorflow as tf

    graph = tf.function(lambda inputs: model(inputs, training=True)).get_concrete_function(x).graph
    total = 0
    for op in graph.get_operations():
        if op.type in _SKIPPED_OPS:
            continue
        for t in op.outputs:
            if t.dtype.is_floating and t.shape.is_fully_defined():
                total += t.shape.num_elements() * t.dtype.size
    return total


def _step_overhead(data, devices: list[str], rounds: int) -> float:
    """Extra seconds per training step under data parallelism that do not grow with the model.

    Runs Keras' train step of a model that does almost nothing, fed the same batch through the
    strategy's distributed input pipeline (so the input splitting and copying, the strategy's
    per-step work and its collectives remain), on one device and on all `devices`, in steady
    state; 0 when x is not a single array.
    """
    import keras
    import tensorflow as tf

    from tfdist.strategies.data_parallel import DataParallelStrategy

    x = data[0]
    if not isinstance(x, tf.Tensor):
        return 0.0
    dataset = tf.data.Dataset.from_tensors(data).repeat()
    seconds = {}
    for n in (1, len(devices)):
        strategy = DataParallelStrategy(devices=devices[:n])
        with strategy.scope():
            probe = keras.Sequential(
                [keras.Input(x.shape[1:], dtype=x.dtype), keras.layers.Flatten(), keras.layers.Dense(1)]
            )
            probe.compile(optimizer="sgd", loss=lambda y_true, y_pred: keras.ops.mean(y_pred))
            probe.optimizer.build(probe.trainable_variables)
        iterator = iter(strategy.experimental_distribute_dataset(dataset))
        step = tf.function(lambda it, s=strategy, m=probe: s.run(m.train_step, args=(next(it),)))
        seconds[n] = _time(step, (iterator,), rounds)
    return max(0.0, seconds[len(devices)] - seconds[1])


def advise(
    model,
    batch,
    *,
    devices: list[str] | None = None,
    optimizer=None,
    rounds: int = 5,
    device_memory: int | None = None,
    min_speedup: float = 1.15,
) -> Advice:
    """Measures `model` on the devices at hand and recommends how to train it.

    The model is cloned (its weights and optimizer are left untouched). Times
    are medians over `rounds` rounds; the data-parallel step is predicted as
    (forward+backward of batch/N on N devices at once, measured) + (all-reduce
    of the gradient bytes, measured) + (optimizer update, measured on one
    device, for N copies at the measured concurrency).

    Recommends with `tfdist.advice.recommend`, in this order: when the model
    with its whole batch fits one device, "data parallel" if the predicted
    speed-up is at least `min_speedup`, else "one device" (communication or
    shared compute would eat the gain); when it does not fit one device,
    "data parallel" if its share of the batch fits each device; else "data
    parallel" with `ShardedDataParallelStrategy` if its weights and optimizer
    state split over the devices fit (`shard="optimizer"`, ZeRO-1, when
    splitting the optimizer slots alone is enough, else `shard="weights"`,
    ZeRO-3; `advice.bytes_per_device` is the predicted persistent bytes on
    each device, counting in full what the strategy keeps whole); else the
    model is split: into pipeline stages (`PipelineStrategy`) when it is a
    deep stack of layers that balances into stages that fit, else over a
    model axis (`ModelParallelStrategy`, the smallest that fits), "model
    parallel" with one copy of the model or "hybrid" with several.

    Args:
        model: a compiled Keras model (its loss is used; its optimizer unless
            `optimizer` is given).
        batch: one global batch of training data, `(x, y)` or
            `(x, y, sample_weight)`.
        devices: the devices to plan for, e.g. `["GPU:0", "GPU:1"]`; default
            all GPUs, else all logical CPUs (`tfdist.devices.default_devices`).
        optimizer: a Keras optimizer (or its name) to plan with instead of
            the model's.
        rounds: timing rounds per measurement, at least 1.
        device_memory: bytes of memory per device; default: the GPU's total
            (from nvidia-smi), or on CPUs the host's RAM divided by the
            number of logical CPU devices.
        min_speedup: the predicted data-parallel speed-up below which one
            device is recommended.

    Returns:
        An `Advice` (the `Measurements` and the `Recommendation`); `print(advice)`
        shows the numbers behind it.

    Raises:
        ValueError: for a model that is not compiled, a malformed `batch`, a
            batch smaller than the number of devices, or a bad `devices`,
            `rounds`, `device_memory` or `min_speedup`.

    Example:

    >>> import keras, numpy as np, tfdist
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> advice = tfdist.advise(model, (np.ones((8, 4)), np.ones((8, 1))), devices=["CPU:0"], rounds=1)
    >>> advice.recommendation
    'one device'
    """
    import tensorflow as tf

    from tfdist import _validate
    from tfdist import devices as devices_lib
    from tfdist.strategies import collectives
    from tfdist.strategies.data_parallel import DataParallelStrategy

    if getattr(model, "loss", None) is None or not getattr(model, "compiled", False):
        raise ValueError(
            "Invalid value for argument `model`: it is not compiled with a loss. Call "
            "model.compile(optimizer=..., loss=...) before tfdist.advise(model, batch)."
        )
    batch, batch_size = _check_batch(batch)
    rounds = _validate.integer("rounds", rounds, where=" of advise()")
    device_memory = _validate.integer("device_memory", device_memory, allow_none=True, where=" of advise()")
    min_speedup = _validate.positive_number("min_speedup", min_speedup)
    devices = devices_lib.device_list(devices)
    n = len(devices)
    if batch_size < n:
        raise ValueError(
            f"Invalid value for argument `batch`: {batch_size} example(s) cannot be split over {n} devices. "
            f"Pass a global batch of at least {n} examples (the batch you would train with)."
        )
    optimizer = optimizer if optimizer is not None else model.optimizer

    one = DataParallelStrategy(devices=devices[:1])
    single = _clone(model, optimizer, one)

    @tf.function
    def forward_backward(*data):
        return one.run(lambda *d: _ready(_loss_and_grads(single, *d)[1]), args=data)

    @tf.function
    def train_step(*data):
        def step(*d):
            loss, grads = _loss_and_grads(single, *d)
            single.optimizer.apply(grads, single.trainable_variables)
            return loss

        return one.run(step, args=data)

    with one.scope():
        data = tuple(tf.nest.map_structure(tf.convert_to_tensor, batch))
    one_device = {"compute": (forward_backward, data), "step": (train_step, data)}
    gradient_bytes = _bytes(single.trainable_variables)
    parameter_bytes = _bytes(single.weights)
    optimizer_bytes = _bytes(v for v in single.optimizer.variables if len(v.shape) > 0)
    activation_bytes = _activation_bytes(single, data[0])

    layer_bytes = tuple(_bytes(layer.weights) for layer in single.layers if layer.weights)
    unsharded_parameter_bytes, unsharded_optimizer_bytes = _unsharded_bytes(single, n)

    all_reduce_time, overhead_time = 0.0, 0.0
    if n == 1:
        times = _time_together(one_device, rounds)
        parallel_time = times["compute"]
    else:
        many = DataParallelStrategy(devices=devices)
        replicas = _clone(model, optimizer, many)
        per_replica = batch_size // n

        def shard(ctx):
            start = ctx.replica_id_in_sync_group * per_replica
            return tuple(tf.nest.map_structure(lambda a: a[start : start + per_replica], data))

        shards = many.experimental_distribute_values_from_function(shard)
        zeros = many.experimental_distribute_values_from_function(
            lambda _: [tf.zeros(v.shape, v.dtype) for v in replicas.trainable_variables]
        )

        @tf.function
        def parallel_forward_backward(shards):
            return many.run(lambda d: _ready(_loss_and_grads(replicas, *d)[1]), args=(shards,))

        @tf.function
        def all_reduce(grads):
            return many.run(lambda g: _ready(collectives.all_reduce_gradients(many, g)), args=(grads,))

        # One device and all of them, side by side: their ratio is the compute speed-up.
        times = _time_together({**one_device, "parallel": (parallel_forward_backward, (shards,))}, rounds)
        parallel_time = times["parallel"]
        all_reduce_time = _time(all_reduce, (zeros,), rounds)
        overhead_time = _step_overhead(data, devices, rounds)

    compute_time = times["compute"]
    step_time = max(times["step"], compute_time)
    measurements = Measurements(
        devices=tuple(devices),
        batch_size=batch_size,
        step_time=step_time,
        compute_time=compute_time,
        parallel_compute_time=parallel_time,
        gradient_bytes=gradient_bytes,
        all_reduce_time=all_reduce_time,
        overhead_time=overhead_time,
        parameter_bytes=parameter_bytes,
        optimizer_bytes=optimizer_bytes,
        activation_bytes=activation_bytes,
        device_memory=_device_memory(devices) if device_memory is None else device_memory,
        layer_bytes=layer_bytes,
        unsharded_parameter_bytes=unsharded_parameter_bytes,
        unsharded_optimizer_bytes=unsharded_optimizer_bytes,
    )
    return Advice.of(measurements, recommend(measurements, min_speedup=min_speedup))


OPTIMIZERS = ("adadelta", "adafactor", "adagrad", "adam", "adamax", "adamw", "ftrl", "lion", "nadam", "rmsprop", "sgd")
"""Valid values of `tfdist-advise --optimizer`: Keras optimizer names that need no arguments."""
_LM_HEADS = 4  # attention heads of the reference LM
MAX_ROUNDS = 100
"""The most `tfdist-advise --rounds` (each round of each measurement lasts about 0.1 s)."""


def _integer(minimum: int, maximum: int | None = None):
    """An argparse type: an integer from `minimum` to `maximum`."""

    if maximum is not None:
        valid = f"an integer from {minimum} to {maximum}"
    else:
        valid = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def parse(text: str) -> int:
        value = int(text) if re.fullmatch(r"\s*[+-]?[0-9]{1,18}\s*", text) else None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"{text} is not {valid}")
        return value

    return parse


def _gibibytes(text: str) -> int:
    """An argparse type: a positive, finite number of GiB, returned in bytes."""
    try:
        gib = float(text)
    except ValueError:
        gib = math.nan
    if not 2**-30 <= gib < math.inf:  # False for NaN
        raise argparse.ArgumentTypeError(f"{text} is not a positive, finite number of GiB (at least one byte)")
    return int(gib * 2**30)


def _reference_bytes(args, num_devices: int) -> int:
    """Host memory that measuring the reference model surely takes.

    The float32 weights of the model, of its one-device clone and of its copy on each device, one
    batch, and for the LM the attention probabilities of the batch (kept for the backward pass).
    """
    if args.model == "mlp":
        parameters = args.depth * (args.width**2 + args.width) + 10 * args.width + 10
        batch = 4 * args.batch_size * (args.width + 1)
    else:
        from tfdist import models

        parameters = models.transformer_lm_parameters(seq_len=args.seq_len, d_model=args.width, num_layers=args.depth)
        batch = 4 * args.batch_size * args.seq_len * (2 + _LM_HEADS * args.seq_len * args.depth)
    return 4 * parameters * (2 + num_devices) + batch


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage block) and exit status 2."""

    def error(self, message: str):
        from tfdist.flags import exit_with_error

        exit_with_error(self.prog, f"{message} (see {self.prog} --help)")


def run(argv: list[str] | None = None) -> int:
    """Entry point of `tfdist-advise`: advice for a reference model (MLP or transformer LM)."""
    from tfdist import devices as devices_lib
    from tfdist.flags import exit_with_error

    parser = _Parser(
        prog="tfdist-advise",
        description="Should I distribute? Measures a reference model on the devices at hand and recommends "
        "one device, data parallel (sharded when the model's state does not fit one device), model parallel "
        "or hybrid (over a mesh or in pipeline stages), with the numbers behind it.",
    )
    positive = _integer(1)
    parser.add_argument("--model", choices=("mlp", "lm"), default="mlp", help="mlp: Dense layers; lm: transformer_lm")
    parser.add_argument("--width", type=positive, default=512, help="MLP width / LM d_model")
    parser.add_argument("--depth", type=positive, default=3, help="MLP layers / LM blocks")
    parser.add_argument("--seq_len", type=positive, default=64, help="LM tokens per example")
    parser.add_argument("--batch_size", type=positive, default=256, help="global batch")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adam", help="a Keras optimizer")
    parser.add_argument(
        "--num_devices", type=_integer(1, devices_lib.MAX_SIMULATED_DEVICES), default=4,
        help=f"simulated CPU devices, 1 to {devices_lib.MAX_SIMULATED_DEVICES} (all GPUs if any)",
    )
    cores = os.cpu_count() or 1
    parser.add_argument(
        "--threads_per_device", type=_integer(0, cores), default=0,
        help=f"on CPUs: intra-op threads, 0 to {cores} (0: TensorFlow's default, every device uses all cores)",
    )
    parser.add_argument("--rounds", type=_integer(1, MAX_ROUNDS), default=5, help=f"timing rounds, 1 to {MAX_ROUNDS}")
    parser.add_argument(
        "--device_memory_gib", type=_gibibytes, default=None, dest="device_memory",
        help="memory per device in GiB (default: measured)",
    )
    args = parser.parse_args(argv)
    if args.model == "lm" and args.width % _LM_HEADS:
        parser.error(f"argument --width: {args.width} is not a multiple of {_LM_HEADS}, the LM's attention heads")

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfdist._native_log import native_stderr_silenced

    with native_stderr_silenced():
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        if args.threads_per_device:  # before simulate_devices, which starts TensorFlow's runtime
            tf.config.threading.set_intra_op_parallelism_threads(args.threads_per_device)
        devices_lib.simulate_devices(args.num_devices)
    n = len(devices_lib.default_devices())
    if args.batch_size < n:
        exit_with_error(parser.prog, f"--batch_size={args.batch_size} is less than the {n} devices. Expected >= {n}.")
    memory = devices_lib.host_memory() if not gpus else None
    need = _reference_bytes(args, n)
    if memory is not None and need > memory:
        exit_with_error(
            parser.prog,
            f"--model={args.model} --width={args.width} --depth={args.depth} --batch_size={args.batch_size}"
            + (f" --seq_len={args.seq_len}" if args.model == "lm" else "")
            + f": measuring it on {n} device(s) needs at least {need / 2**30:,.1f} GiB, more than this machine's "
            f"{memory / 2**30:,.1f} GiB. Expected sizes that fit: lower them.",
        )
    import keras
    import numpy as np

    from tfdist import models

    rng = np.random.default_rng(0)
    keras.utils.set_random_seed(0)
    if args.model == "mlp":
        model = keras.Sequential(
            [keras.Input((args.width,))]
            + [keras.layers.Dense(args.width, activation="relu") for _ in range(args.depth)]
            + [keras.layers.Dense(10)]
        )
        x = rng.normal(size=(args.batch_size, args.width)).astype("float32")
        y = rng.integers(0, 10, size=(args.batch_size,)).astype("int32")
    else:
        model = models.transformer_lm(
            seq_len=args.seq_len, d_model=args.width, num_heads=_LM_HEADS, num_layers=args.depth
        )
        x = rng.integers(0, 256, size=(args.batch_size, args.seq_len)).astype("int32")
        y = rng.integers(0, 256, size=(args.batch_size, args.seq_len)).astype("int32")
    model.compile(optimizer=args.optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    try:
        advice = advise(model, (x, y), rounds=args.rounds, device_memory=args.device_memory)
    except ValueError as e:
        exit_with_error(parser.prog, str(e))
    print(f"model: {args.model}, {model.count_params():,} parameters, {args.optimizer}")
    print(advice)
    return 0


if __name__ == "__main__":
    sys.exit(run())
