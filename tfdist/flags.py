"""Command-line flags shared by tfdist binaries.

Only binaries import this module (it defines absl flags); library code takes
plain keyword arguments. A binary calls `define_flags()` at import time, then
in `main()` calls `configure_devices_from_flags()` before anything touches
TensorFlow's runtime, then `strategy_from_flags()`.

Every flag has a default; bad values fail at parse time with absl's message
naming the flag and the valid range (e.g. `flag --global_batch_size=0: 0 is
not a positive integer`, `flag --seed=-1: -1 is not an integer in the range
[0, 4294967295]`, `flag --strategy=bogus: value should be one of <auto|data|...>`, `flag
--mesh=batch:2,model:x: ...`); flags that belong to another strategy than
--strategy's (`--mesh` with `--strategy=data`) fail too.
`parse_flags_or_exit` turns it into one line and exit status 2. Importing this
module and parsing flags does not import TensorFlow, so a bad flag fails at
once.
"""

from __future__ import annotations

import math
import os
import stat
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import NoReturn

from absl import flags

from tfdist import cluster as cluster_lib
from tfdist import data as data_lib
from tfdist import devices as devices_lib

if TYPE_CHECKING:
    import tensorflow as tf

FLAGS = flags.FLAGS

STRATEGIES = ("auto", "data", "multi_worker", "model_parallel", "pipeline", "sharded_data_parallel")
"""Valid values of --strategy."""

SHARDS = ("weights", "optimizer")
"""Valid values of --shard: the `shard` modes of `tfdist.ShardedDataParallelStrategy`."""

DEFAULT_SHARD = "weights"
"""The --shard of --strategy=sharded_data_parallel without --shard (ZeRO-3 / FSDP)."""

RULES = ("transformer", "auto", "conv", "data_parallel", "none")
"""Valid values of --rules: the presets of `tfdist.layouts`, and "none" (every weight replicated)."""

DEFAULT_MESH = {"batch": 2, "model": 4}
"""The mesh of --strategy=model_parallel without --mesh (`tfdist.ModelParallelStrategy`'s default)."""

DEFAULT_RULES = "transformer"
"""The --rules of --strategy=model_parallel without --rules: the job trains `tfdist.models.transformer_lm`."""

DEFAULT_STAGES = 2
"""The --stages of --strategy=pipeline without --stages."""

DEFAULT_MICROBATCHES = 4
"""The --microbatches of --strategy=pipeline without --microbatches."""

_MESH_EXAMPLE = "--mesh=batch:2,model:4"

# Flags that only one strategy reads: given with another --strategy, they are an error.
_STRATEGY_FLAGS = {
    "model_parallel": ("mesh", "rules"),
    "pipeline": ("stages", "microbatches"),
    "sharded_data_parallel": ("shard",),
}

# Strategies whose one device mesh spans every process of a cluster (each process simulates its share on CPUs).
_MESH_STRATEGIES = ("model_parallel", "sharded_data_parallel")

MAX_SEED = 2**32 - 1
"""The largest --seed (what `keras.utils.set_random_seed` and NumPy accept)."""


def exit_with_error(prog: str, message: str) -> NoReturn:
    """Ends a binary with `<prog>: error: <message>` as one line on stderr and exit status 2.

    Args:
        prog: the binary's name, e.g. "tfdist-train".
        message: what is wrong, naming the flag, variable or path and what is valid; line breaks
            in it become spaces.
    """
    sys.stderr.write(f"{prog}: error: {' '.join(str(message).split())}\n")
    sys.stderr.flush()
    sys.exit(2)


def parse_flags_or_exit(argv: Sequence[str], *, prog: str, flag_values: flags.FlagValues = FLAGS) -> list[str]:
    """Parses `argv` into `flag_values`; a bad flag ends the binary with one line and exit status 2.

    Pass it to `absl.app.run` (absl's own parser prints two lines and exits with 1):
    `app.run(main, flags_parser=functools.partial(parse_flags_or_exit, prog="tfdist-train"))`.

    Args:
        argv: the command line, program name first.
        prog: the binary's name for the error line.
        flag_values: the `absl.flags.FlagValues` to parse into.

    Returns:
        The arguments that are not flags, program name first.

    Example:

    >>> from absl import flags
    >>> fv = flags.FlagValues()
    >>> define_flags(fv)
    >>> parse_flags_or_exit(["prog", "--seed=7"], prog="prog", flag_values=fv), fv.seed
    (['prog'], 7)
    """
    try:
        _check_flagfiles(argv)
        return flag_values(list(argv))
    except flags.Error as e:
        exit_with_error(prog, f"{e} (see {prog} --helpshort)")


def _check_flagfiles(argv: Sequence[str]) -> None:
    """Refuses a --flagfile that is not a regular file: absl would block reading a FIFO, or never end."""
    args = list(argv[1:])
    for i, arg in enumerate(args):
        if arg == "--":
            return
        name, has_value, path = arg.lstrip("-").partition("=")
        if not arg.startswith("-") or name != "flagfile":
            continue
        if not has_value:
            path = args[i + 1] if i + 1 < len(args) else ""
        try:
            mode = os.stat(path).st_mode
        except OSError:
            continue  # absl says it cannot open it
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise flags.Error(f"flag --flagfile={path}: {path!r} is not a regular file")


def parse_mesh(text: str) -> dict[str, int]:
    """Parses a --mesh value, "axis:size" pairs separated by commas, into an axis name -> size dict.

    Args:
        text: e.g. "batch:2,model:4".

    Returns:
        The axes in order, e.g. `{"batch": 2, "model": 4}`.

    Raises:
        ValueError: naming the part that does not parse and showing the valid form.

    Example:

    >>> parse_mesh("batch:2,model:4")
    {'batch': 2, 'model': 4}
    >>> parse_mesh("batch:2,model")
    Traceback (most recent call last):
    ...
    ValueError: 'model' is not an axis:size pair. Expected axis:size pairs separated by commas, \
e.g. --mesh=batch:2,model:4 (sizes multiply to the number of devices)
    """
    axes: dict[str, int] = {}
    for part in str(text).split(","):
        name, colon, size = (p.strip() for p in part.partition(":"))
        if not colon:
            problem = f"{part.strip()!r} is not an axis:size pair" if part.strip() else "an axis:size pair is empty"
        elif not name.isidentifier():
            problem = f"{part.strip()!r}: the axis name {name!r} is not an identifier such as batch or model"
        elif not (size.isascii() and size.isdigit()) or int(size) < 1:
            problem = f"{part.strip()!r}: the size {size!r} of axis {name!r} is not a positive integer"
        elif name in axes:
            problem = f"{part.strip()!r}: axis {name!r} is given twice"
        else:
            axes[name] = int(size)
            continue
        raise ValueError(
            f"{problem}. Expected axis:size pairs separated by commas, e.g. {_MESH_EXAMPLE} "
            "(sizes multiply to the number of devices)"
        )
    return axes


def format_mesh(mesh: dict[str, int]) -> str:
    """The --mesh value of an axis name -> size dict (the inverse of `parse_mesh`).

    Example:

    >>> format_mesh({"batch": 2, "model": 4})
    'batch:2,model:4'
    """
    return ",".join(f"{name}:{size}" for name, size in mesh.items())


def parse_profile_steps(text: str) -> tuple[int, int]:
    """Parses a --profile_steps value, "FIRST:LAST" (both included) or one step "N", into (first, last).

    Args:
        text: e.g. "10:15".

    Returns:
        The first and last step to profile, e.g. `(10, 15)`.

    Raises:
        ValueError: naming what does not parse and showing the valid form.

    Example:

    >>> parse_profile_steps("10:15"), parse_profile_steps("7")
    ((10, 15), (7, 7))
    >>> parse_profile_steps("15:10")
    Traceback (most recent call last):
    ...
    ValueError: '15:10' is not FIRST:LAST with 1 <= FIRST <= LAST. Expected step numbers (counted from 1) such as \
--profile_steps=10:15 (steps 10 to 15, both included) or --profile_steps=10
    """
    parts = [p.strip() for p in str(text).split(":")]
    if 1 <= len(parts) <= 2 and all(p.isascii() and p.isdigit() for p in parts):
        first, last = int(parts[0]), int(parts[-1])
        if 1 <= first <= last:
            return first, last
    raise ValueError(
        f"{str(text)!r} is not FIRST:LAST with 1 <= FIRST <= LAST. Expected step numbers (counted from 1) such as "
        "--profile_steps=10:15 (steps 10 to 15, both included) or --profile_steps=10"
    )


class _ProfileStepsParser(flags.ArgumentParser):
    """absl parser of --profile_steps: "10:15" -> (10, 15)."""

    syntactic_help = "FIRST:LAST, steps counted from 1, both included (or one step N)"

    def parse(self, argument):
        return tuple(argument) if isinstance(argument, (tuple, list)) else parse_profile_steps(argument)

    def flag_type(self):
        return "steps"


class _ProfileStepsSerializer(flags.ArgumentSerializer):
    def serialize(self, value):
        return f"{value[0]}:{value[1]}"


class _MeshParser(flags.ArgumentParser):
    """absl parser of --mesh: "batch:2,model:4" -> {"batch": 2, "model": 4}."""

    syntactic_help = "axis:size pairs separated by commas, e.g. batch:2,model:4"

    def parse(self, argument):
        return dict(argument) if isinstance(argument, dict) else parse_mesh(argument)

    def flag_type(self):
        return "mesh"


class _MeshSerializer(flags.ArgumentSerializer):
    def serialize(self, value):
        return format_mesh(value)


def _define(kind: str, name: str, default, help_text: str, flag_values: flags.FlagValues, **kwargs) -> bool:
    """Defines one flag unless `flag_values` has it; returns whether it defined it."""
    if name in flag_values:
        return False
    getattr(flags, f"DEFINE_{kind}")(name, default, help=help_text, flag_values=flag_values, **kwargs)
    return True


def define_flags(flag_values: flags.FlagValues = FLAGS) -> None:
    """Defines the tfdist training flags; calling it again is a no-op.

    Args:
        flag_values: the `absl.flags.FlagValues` to define them in.

    Example:

    >>> from absl import flags
    >>> fv = flags.FlagValues()
    >>> define_flags(fv)
    >>> define_flags(fv)
    >>> fv(["prog", "--strategy=data"])[1:], fv.strategy
    ([], 'data')
    """
    positive = {"lower_bound": 1}
    _define(
        "enum",
        "strategy",
        "auto",
        "How to distribute training. auto: multi_worker when this process belongs to a cluster "
        "(TF_CONFIG or Slurm, e.g. under tfdist-launch), else data; data: synchronous data parallelism "
        "over the local devices (tfdist.DataParallelStrategy); multi_worker: synchronous data parallelism "
        "over the cluster's processes (tfdist.MultiWorkerStrategy); model_parallel: the weights split over a "
        "device mesh by layout rules (tfdist.ModelParallelStrategy, --mesh, --rules); pipeline: consecutive "
        "layers on --stages devices, each batch in --microbatches micro-batches (tfdist.PipelineStrategy); "
        "sharded_data_parallel: data parallelism with the weights and optimizer state split over the devices "
        "(tfdist.ShardedDataParallelStrategy, --shard), over the local devices or, in a cluster, over every "
        "process's. auto never picks model_parallel, pipeline or sharded_data_parallel: name them "
        "(tfdist-advise says when the model's state needs sharding).",
        flag_values,
        enum_values=list(STRATEGIES),
    )
    _define(
        "integer",
        "num_devices",
        4,
        f"On a machine without GPUs, split the CPU into this many simulated devices "
        f"(tfdist.simulate_devices), 1 to {devices_lib.MAX_SIMULATED_DEVICES}; without it, model_parallel and "
        "pipeline simulate as many as they need (the product of the --mesh sizes, --stages). With GPUs, all GPUs "
        "are used and this flag is ignored.",
        flag_values,
        lower_bound=1,
        upper_bound=devices_lib.MAX_SIMULATED_DEVICES,
    )
    new = "mesh" not in flag_values
    if new:
        flags.DEFINE(
            _MeshParser(),
            "mesh",
            None,
            f"--strategy=model_parallel only: the device mesh, axis:size pairs (default "
            f"{format_mesh(DEFAULT_MESH)}). The batch axis splits each batch (--global_batch_size must be a "
            "multiple of its size), the rules split weights over the others. The sizes multiply to the number "
            "of devices; without GPUs that many CPU devices are simulated.",
            flag_values,
            _MeshSerializer(),
        )
    _define(
        "enum",
        "rules",
        None,
        f"--strategy=model_parallel only: the tfdist.layouts preset that places the weights (default "
        f"{DEFAULT_RULES}: Megatron-style MLP, attention heads and vocabulary split over the mesh's model axis); "
        "auto: the same splits, found by layer type and position instead of layer names; "
        "conv: convolution output channels; data_parallel or none: every weight replicated.",
        flag_values,
        enum_values=list(RULES),
    )
    _define(
        "enum",
        "shard",
        None,
        f"--strategy=sharded_data_parallel only: what is split over the devices (default {DEFAULT_SHARD}). "
        "weights: weights and optimizer state (ZeRO-3 / FSDP; each weight is gathered for its use); optimizer: "
        "the optimizer state only, the weights stay whole on every device (ZeRO-1).",
        flag_values,
        enum_values=list(SHARDS),
    )
    _define(
        "integer",
        "stages",
        None,
        f"--strategy=pipeline only: pipeline stages, one device each (default {DEFAULT_STAGES}); without GPUs "
        "that many CPU devices are simulated.",
        flag_values,
        **positive,
    )
    _define(
        "integer",
        "microbatches",
        None,
        f"--strategy=pipeline only: micro-batches per step (default {DEFAULT_MICROBATCHES}); "
        "--global_batch_size must be a multiple of it.",
        flag_values,
        **positive,
    )
    _define("integer", "global_batch_size", 32, "Examples per step over all replicas.", flag_values, **positive)
    _define("integer", "epochs", 1, "Number of epochs.", flag_values, **positive)
    _define(
        "integer",
        "steps",
        300,
        "Steps per epoch; 0 = one pass over the training corpus per epoch.",
        flag_values,
        lower_bound=0,
    )
    _define("integer", "seq_len", 64, "Bytes per training example (the context length).", flag_values, **positive)
    _define("integer", "d_model", 128, "Width of the transformer's residual stream.", flag_values, **positive)
    if _define("integer", "num_heads", 4, "Attention heads; must divide --d_model.", flag_values, **positive):
        flags.register_multi_flags_validator(
            ["d_model", "num_heads"],
            lambda f: f["num_heads"] < 1 or f["d_model"] % f["num_heads"] == 0,  # < 1: its own bound fails
            message="--num_heads must divide --d_model",
            flag_values=flag_values,
        )
    _define("integer", "num_layers", 2, "Number of transformer blocks.", flag_values, **positive)
    lr_help = "Peak AdamW learning rate, finite and >= 0."
    if _define("float", "learning_rate", 3e-3, lr_help, flag_values, lower_bound=0.0):
        flags.register_validator(
            "learning_rate", math.isfinite, message="expected a finite number >= 0", flag_values=flag_values
        )
    _define(
        "string",
        "corpus",
        None,
        "A text file or a directory of text files to train on; default: the Python standard library's own source.",
        flag_values,
    )
    _define(
        "integer",
        "max_corpus_bytes",
        data_lib.DEFAULT_MAX_BYTES,
        "Read at most this many bytes of the corpus.",
        flag_values,
        **positive,
    )
    _define(
        "string",
        "model_dir",
        None,
        "Directory for checkpoints (model_dir/checkpoints) and TensorBoard logs (model_dir/logs); "
        "default: a new temporary directory.",
        flag_values,
    )
    if "profile_steps" not in flag_values:
        flags.DEFINE(
            _ProfileStepsParser(),
            "profile_steps",
            None,
            "Profile these training steps on every worker, FIRST:LAST (counted from 1, both included), e.g. 10:15: "
            "each worker writes TensorFlow's profiler trace to model_dir/logs/plugins/profile/<run>/"
            "worker-<i>.xplane.pb (TensorBoard's Profile tab reads them) and the chief merges them into one "
            "timeline, <run>/timeline.json, for ui.perfetto.dev or chrome://tracing (tfdist.callbacks.ProfileSteps). "
            "With more than one worker, --model_dir must be a directory every worker can write.",
            flag_values,
            _ProfileStepsSerializer(),
        )
    _define(
        "integer",
        "seed",
        0,
        f"Seed for weight initialization and data order, 0 to {MAX_SEED}.",
        flag_values,
        lower_bound=0,
        upper_bound=MAX_SEED,
    )
    if new:
        _register_strategy_validators(flag_values)


def _register_strategy_validators(flag_values: flags.FlagValues) -> None:
    """Refuses flags of another strategy than --strategy's, and batch sizes the strategy cannot split."""

    def only_with(strategy: str, names: tuple[str, ...]):
        def check(f):
            given = [f"--{n}" for n in names if f[n] is not None]
            if given and f["strategy"] != strategy:
                raise flags.ValidationError(
                    f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} used only with "
                    f"--strategy={strategy}, not --strategy={f['strategy']}: drop {' and '.join(given)}, "
                    f"or pass --strategy={strategy}"
                )
            return True

        return check

    def splits_batch(strategy: str, name: str):
        def check(f):
            batch = f["global_batch_size"]
            if f["strategy"] != strategy or batch < 1:  # < 1: its own bound fails
                return True
            if name == "mesh":
                mesh = f["mesh"] or DEFAULT_MESH
                parts, what = mesh.get("batch", 1), f"the size of the batch axis of --mesh={format_mesh(mesh)}"
            else:
                parts = f["microbatches"] or DEFAULT_MICROBATCHES
                what = f"--microbatches={parts} (each step splits the batch into that many micro-batches)"
            if batch % parts:
                raise flags.ValidationError(
                    f"--global_batch_size={batch} must be a multiple of {what}. Expected a multiple of {parts}, "
                    f"e.g. --global_batch_size={max(parts, batch - batch % parts)}"
                )
            return True

        return check

    for strategy, names in _STRATEGY_FLAGS.items():
        flags.register_multi_flags_validator(
            ["strategy", *names], only_with(strategy, names), message="", flag_values=flag_values
        )
    for strategy, name in (("model_parallel", "mesh"), ("pipeline", "microbatches")):
        flags.register_multi_flags_validator(
            ["strategy", "global_batch_size", name], splits_batch(strategy, name), message="", flag_values=flag_values
        )


def resolve_strategy(flag_values: flags.FlagValues = FLAGS) -> tuple[str, str]:
    """The strategy --strategy stands for, and why, in words for a log line.

    "auto" becomes "multi_worker" when TF_CONFIG or Slurm describe a cluster
    of more than one worker, else "data"; it never becomes "model_parallel",
    "pipeline" or "sharded_data_parallel" (they change how the model is split
    or stored, so they are named; `tfdist-advise` says when a model needs one).

    Args:
        flag_values: parsed flags from `define_flags`.

    Returns:
        `(name, reason)`, e.g. `("data", "--strategy=data")`.

    Raises:
        tfdist.cluster.ClusterError: for an invalid cluster description.

    Example:

    >>> from absl import flags
    >>> fv = flags.FlagValues()
    >>> define_flags(fv)
    >>> _ = fv(["prog", "--strategy=pipeline"])
    >>> resolve_strategy(fv)
    ('pipeline', '--strategy=pipeline')
    """
    name = flag_values.strategy
    if name != "auto":
        return name, f"--strategy={name}"
    cluster = cluster_lib.resolve()
    if _is_multi_worker(cluster):
        return "multi_worker", (
            f"this process is worker {cluster.task_index} of a {cluster.num_workers}-worker cluster "
            "(TF_CONFIG or Slurm), so data parallelism over the workers"
        )
    where = "a one-worker cluster" if cluster is not None else "no cluster (no TF_CONFIG or Slurm job)"
    return "data", (
        f"{where}, so data parallelism over this process's devices; model_parallel, pipeline and "
        "sharded_data_parallel run only when --strategy names them"
    )


def resolved_strategy_name(flag_values: flags.FlagValues = FLAGS) -> str:
    """The strategy --strategy stands for: "auto" becomes "multi_worker" in a cluster, else "data".

    Example:

    >>> from absl import flags
    >>> fv = flags.FlagValues()
    >>> define_flags(fv)
    >>> _ = fv(["prog", "--strategy=data"])
    >>> resolved_strategy_name(fv)
    'data'
    """
    return resolve_strategy(flag_values)[0]


def mesh_from_flags(flag_values: flags.FlagValues = FLAGS) -> dict[str, int]:
    """The mesh of --strategy=model_parallel: --mesh, or `DEFAULT_MESH` without it.

    Example:

    >>> from absl import flags
    >>> fv = flags.FlagValues()
    >>> define_flags(fv)
    >>> _ = fv(["prog", "--strategy=model_parallel", "--mesh=batch:4,model:2"])
    >>> mesh_from_flags(fv)
    {'batch': 4, 'model': 2}
    """
    return dict(flag_values.mesh or DEFAULT_MESH)


def _is_multi_worker(cluster: cluster_lib.Cluster | None) -> bool:
    return cluster is not None and cluster.num_workers > 1


def _in_cluster() -> bool:
    """Whether TF_CONFIG or Slurm put this process in a cluster of more than one worker."""
    return _is_multi_worker(cluster_lib.resolve())


def _devices_needed(flag_values: flags.FlagValues, name: str) -> tuple[int, str] | None:
    """The local devices model_parallel or pipeline needs, and the flag that asks for them; None for the others."""
    if name == "model_parallel":
        mesh = mesh_from_flags(flag_values)
        return math.prod(mesh.values()), f"--mesh={format_mesh(mesh)}"
    if name == "pipeline":
        stages = flag_values.stages or DEFAULT_STAGES
        return stages, f"--stages={stages}"
    return None


def configure_devices_from_flags(flag_values: flags.FlagValues = FLAGS) -> list[str]:
    """Sets up the local devices that the flags ask for.

    Without GPUs the host CPU is split into simulated devices: `--num_devices`
    of them, or, when --num_devices is not given, as many as the strategy
    needs (the product of the --mesh sizes for model_parallel, --stages for
    pipeline). With GPUs nothing changes and all GPUs are used. Multi-worker
    training leaves the devices alone (each worker process is one replica on
    CPU, or uses its GPUs). In a cluster, model_parallel and
    sharded_data_parallel build one mesh over every process: on CPUs each
    process simulates its share (--num_devices for sharded_data_parallel).
    Call it before anything starts TensorFlow's runtime (any tensor, model or
    strategy).

    Args:
        flag_values: parsed flags from `define_flags`.

    Returns:
        The names of this process's devices (all GPUs, else the logical
        CPUs); empty for multi-worker training and for model_parallel and
        sharded_data_parallel in a cluster (the strategy picks them when it is
        built).

    Raises:
        RuntimeError: if TensorFlow's runtime already started with another
            number of CPU devices.
        ValueError: if the --mesh needs more devices than can be simulated.

    Example:

    >>> from absl import flags
    >>> fv = flags.FlagValues()
    >>> define_flags(fv)
    >>> _ = fv(["prog", "--num_devices=1"])
    >>> len(configure_devices_from_flags(fv)) >= 1
    True
    """
    name = resolved_strategy_name(flag_values)
    if name == "multi_worker":
        return []  # MultiWorkerStrategy must be built before TensorFlow's runtime starts.
    import tensorflow as tf

    cluster = cluster_lib.resolve() if name in _MESH_STRATEGIES else None
    if _is_multi_worker(cluster):
        # One mesh over every process: each gives total / workers devices. Listing them would start
        # TensorFlow's runtime, which must wait for ModelParallelStrategy to join the other processes.
        if not tf.config.list_physical_devices("GPU"):
            count = flag_values.num_devices
            needed = _devices_needed(flag_values, name)
            if needed is not None and not flag_values["num_devices"].present:
                total, asked_by = needed
                if total % cluster.num_workers:
                    raise ValueError(
                        f"{asked_by} needs {total} devices, which do not split evenly over the "
                        f"{cluster.num_workers} processes of the cluster {list(cluster.addresses)}. Expected a "
                        f"--mesh whose sizes multiply to a multiple of {cluster.num_workers}, e.g. "
                        f"--mesh=batch:{cluster.num_workers},model:4."
                    )
                count = total // cluster.num_workers
            devices_lib.simulate_devices(count)
        return []

    if not tf.config.list_physical_devices("GPU"):
        count = flag_values.num_devices
        needed = _devices_needed(flag_values, name)
        if needed is not None and not flag_values["num_devices"].present and not _in_cluster():
            count, asked_by = needed
            if count > devices_lib.MAX_SIMULATED_DEVICES:
                raise ValueError(
                    f"{asked_by} needs {count} devices; at most {devices_lib.MAX_SIMULATED_DEVICES} CPU devices "
                    f"can be simulated. Expected at most {devices_lib.MAX_SIMULATED_DEVICES}, e.g. "
                    f"{'--mesh=batch:2,model:4' if name == 'model_parallel' else '--stages=4'}."
                )
        devices_lib.simulate_devices(count)
    return devices_lib.default_devices()


def _check_device_count(flag_values: flags.FlagValues, name: str) -> None:
    """Refuses a --mesh whose size is not this process's device count, or more --stages than devices."""
    needed = _devices_needed(flag_values, name)
    if needed is None or _in_cluster():  # in a cluster the strategy counts the devices of all processes
        return
    count, asked_by = needed
    available = devices_lib.default_devices()
    if name == "model_parallel" and count == len(available) or name == "pipeline" and count <= len(available):
        return
    if any("GPU" in d.upper() for d in available):
        have = f"this machine has {len(available)} GPU(s)"
    else:
        have = f"there are {len(available)} (--num_devices={flag_values.num_devices} simulated CPU devices)"
    if name == "model_parallel":
        expected = (
            f"Expected a --mesh whose sizes multiply to {len(available)}, e.g. --mesh=batch:1,model:{len(available)}"
        )
    else:
        expected = f"Expected --stages={len(available)} or fewer"
    fix = "" if "GPU" in have else f", or --num_devices={count} (or no --num_devices: it then simulates {count})"
    raise ValueError(f"{asked_by} needs {'' if name == 'model_parallel' else 'at least '}{count} devices, "
                     f"but {have}. {expected}{fix}.")


def strategy_from_flags(
    flag_values: flags.FlagValues = FLAGS, *, data_sharding: str = "auto"
) -> tf.distribute.Strategy:
    """Builds the strategy that --strategy names.

    Args:
        flag_values: parsed flags from `define_flags`.
        data_sharding: for training over several processes, how datasets are
            split over them (the `sharding` of `tfdist.MultiWorkerStrategy`
            and `tfdist.ModelParallelStrategy`); a binary whose data is in
            memory passes "data".

    Returns:
        A `tf.distribute.Strategy`: for "data" (and "auto" outside a cluster) a
        `tfdist.DataParallelStrategy` over all GPUs, else all logical CPUs; for
        "multi_worker" (and "auto" in a cluster) a `tfdist.MultiWorkerStrategy`
        over the cluster that TF_CONFIG or Slurm describes; for
        "model_parallel" a `tfdist.ModelParallelStrategy` with --mesh and the
        --rules preset of `tfdist.layouts`; for "pipeline" a
        `tfdist.PipelineStrategy` with --stages and --microbatches; for
        "sharded_data_parallel" a `tfdist.ShardedDataParallelStrategy` with
        --shard over all GPUs, else all logical CPUs (in a cluster, those of
        every process).

    Raises:
        ValueError: if --strategy is not one of `STRATEGIES`; for
            model_parallel, a --mesh whose size is not the number of devices
            or that the --rules do not fit; for pipeline, more --stages than
            devices; for sharded_data_parallel, a --global_batch_size that
            the devices do not divide. Each message names the flag.
        tfdist.cluster.ClusterError: for an invalid cluster description.

    Example:

    >>> from absl import flags
    >>> fv = flags.FlagValues()
    >>> define_flags(fv)
    >>> _ = fv(["prog", "--strategy=data"])
    >>> type(strategy_from_flags(fv)).__name__
    'DataParallelStrategy'
    """
    name = resolved_strategy_name(flag_values)
    if name == "data":
        from tfdist.strategies.data_parallel import DataParallelStrategy

        return DataParallelStrategy()
    if name == "multi_worker":
        from tfdist.strategies.multi_worker import MultiWorkerStrategy

        return MultiWorkerStrategy(sharding=data_sharding)
    if name == "model_parallel":
        from tfdist import layouts
        from tfdist.strategies.model_parallel import ModelParallelStrategy

        _check_device_count(flag_values, name)
        mesh, preset = mesh_from_flags(flag_values), flag_values.rules or DEFAULT_RULES
        try:
            # In a cluster (TF_CONFIG, Slurm) the mesh spans every process; the strategy finds the cluster.
            return ModelParallelStrategy(
                mesh=mesh, rules=None if preset == "none" else getattr(layouts, preset)(), sharding=data_sharding
            )
        except ValueError as e:
            raise ValueError(f"--mesh={format_mesh(mesh)} --rules={preset}: {e}") from e
    if name == "pipeline":
        from tfdist.strategies.pipeline import PipelineStrategy

        _check_device_count(flag_values, name)
        return PipelineStrategy(
            stages=flag_values.stages or DEFAULT_STAGES, microbatches=flag_values.microbatches or DEFAULT_MICROBATCHES
        )
    if name == "sharded_data_parallel":
        import tensorflow as tf

        from tfdist.strategies.sharded_data_parallel import ShardedDataParallelStrategy

        # In a cluster (TF_CONFIG, Slurm) the batch axis spans every process's devices; the strategy finds the cluster.
        strategy = ShardedDataParallelStrategy(shard=flag_values.shard or DEFAULT_SHARD, sharding=data_sharding)
        size, batch = strategy.mesh_shape[strategy.batch_axis], flag_values.global_batch_size
        if batch % size:
            raise ValueError(
                f"--global_batch_size={batch} must be a multiple of the {size} devices that "
                f"--strategy=sharded_data_parallel splits each batch over. Expected a multiple of {size}, e.g. "
                f"--global_batch_size={max(size, batch - batch % size)}"
                + ("" if tf.config.list_physical_devices("GPU") else ", or another --num_devices")
                + "."
            )
        return strategy
    raise ValueError(f"Invalid value for flag --strategy. Received: --strategy={name!r}. Expected one of {STRATEGIES}.")
