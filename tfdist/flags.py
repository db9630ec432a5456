"""Command-line flags shared by tfdist binaries.

Only binaries import this module (it defines absl flags); library code takes
plain keyword arguments. A binary calls `define_flags()` at import time, then
in `main()` calls `configure_devices_from_flags()` before anything touches
TensorFlow's runtime, then `strategy_from_flags()`.

Every flag has a default; bad values fail at parse time with absl's message
naming the flag (e.g. `flag --global_batch_size=0: 0 is not a positive
integer`, `flag --strategy=bogus: value should be one of <auto|data>`).
"""

from __future__ import annotations

import tensorflow as tf
from absl import flags

from tfdist import cluster as cluster_lib
from tfdist import data as data_lib
from tfdist import devices as devices_lib
from tfdist.strategies.data_parallel import DataParallelStrategy
from tfdist.strategies.multi_worker import MultiWorkerStrategy

FLAGS = flags.FLAGS

STRATEGIES = ("auto", "data", "multi_worker")
"""Valid values of --strategy."""


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
        "over the cluster's processes (tfdist.MultiWorkerStrategy).",
        flag_values,
        enum_values=list(STRATEGIES),
    )
    _define(
        "integer",
        "num_devices",
        4,
        "On a machine without GPUs, split the CPU into this many simulated devices "
        "(tfdist.simulate_devices). With GPUs, all GPUs are used and this flag is ignored.",
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
            lambda f: f["d_model"] % f["num_heads"] == 0,
            message="--num_heads must divide --d_model",
            flag_values=flag_values,
        )
    _define("integer", "num_layers", 2, "Number of transformer blocks.", flag_values, **positive)
    _define("float", "learning_rate", 3e-3, "Peak AdamW learning rate.", flag_values, lower_bound=0.0)
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
    _define("integer", "seed", 0, "Seed for weight initialization and data order.", flag_values)


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
    name = flag_values.strategy
    if name == "auto":
        cluster = cluster_lib.resolve()
        return "multi_worker" if cluster is not None and cluster.num_workers > 1 else "data"
    return name


def configure_devices_from_flags(flag_values: flags.FlagValues = FLAGS) -> list[str]:
    """Sets up the local devices that --num_devices asks for.

    Without GPUs the host CPU is split into `--num_devices` simulated devices;
    with GPUs nothing changes and all GPUs are used. Multi-worker training
    leaves the devices alone (each worker process is one replica on CPU, or
    uses its GPUs). Call it before anything starts TensorFlow's runtime (any
    tensor, model or strategy).

    Args:
        flag_values: parsed flags from `define_flags`.

    Returns:
        The names of the devices a data-parallel strategy will use; empty for
        multi-worker training (the strategy picks them when it is built).

    Raises:
        RuntimeError: if TensorFlow's runtime already started with another
            number of CPU devices.

    Example:

    >>> from absl import flags
    >>> fv = flags.FlagValues()
    >>> define_flags(fv)
    >>> _ = fv(["prog", "--num_devices=1"])
    >>> len(configure_devices_from_flags(fv)) >= 1
    True
    """
    if resolved_strategy_name(flag_values) == "multi_worker":
        return []  # MultiWorkerStrategy must be built before TensorFlow's runtime starts.
    if not tf.config.list_physical_devices("GPU"):
        devices_lib.simulate_devices(flag_values.num_devices)
    return devices_lib.default_devices()


def strategy_from_flags(
    flag_values: flags.FlagValues = FLAGS, *, data_sharding: str = "auto"
) -> tf.distribute.Strategy:
    """Builds the strategy that --strategy names.

    Args:
        flag_values: parsed flags from `define_flags`.
        data_sharding: for multi-worker training, how datasets are split over
            workers (`tfdist.MultiWorkerStrategy`'s `sharding`); a binary whose
            data is in memory passes "data".

    Returns:
        A `tf.distribute.Strategy`: for "data" (and "auto" outside a cluster) a
        `tfdist.DataParallelStrategy` over all GPUs, else all logical CPUs; for
        "multi_worker" (and "auto" in a cluster) a `tfdist.MultiWorkerStrategy`
        over the cluster that TF_CONFIG or Slurm describes.

    Raises:
        ValueError: if --strategy is not one of `STRATEGIES`.
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
        return DataParallelStrategy()
    if name == "multi_worker":
        return MultiWorkerStrategy(sharding=data_sharding)
    raise ValueError(f"Invalid value for flag --strategy. Received: --strategy={name!r}. Expected one of {STRATEGIES}.")
