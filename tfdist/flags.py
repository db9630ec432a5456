"""Command-line flags shared by tfdist binaries.

Only binaries import this module (it defines absl flags); library code takes
plain keyword arguments. A binary calls `define_flags()` at import time, then
in `main()` calls `configure_devices_from_flags()` before anything touches
TensorFlow's runtime, then `strategy_from_flags()`.

Every flag has a default; bad values fail at parse time with absl's message
naming the flag and the valid range (e.g. `flag --global_batch_size=0: 0 is
not a positive integer`, `flag --seed=-1: -1 is not an integer in the range
[0, 4294967295]`, `flag --strategy=bogus: value should be one of <auto|data>`);
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

STRATEGIES = ("auto", "data", "multi_worker")
"""Valid values of --strategy."""

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
        f"On a machine without GPUs, split the CPU into this many simulated devices "
        f"(tfdist.simulate_devices), 1 to {devices_lib.MAX_SIMULATED_DEVICES}. With GPUs, all GPUs are used "
        "and this flag is ignored.",
        flag_values,
        lower_bound=1,
        upper_bound=devices_lib.MAX_SIMULATED_DEVICES,
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
    _define(
        "integer",
        "seed",
        0,
        f"Seed for weight initialization and data order, 0 to {MAX_SEED}.",
        flag_values,
        lower_bound=0,
        upper_bound=MAX_SEED,
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
    import tensorflow as tf

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
        from tfdist.strategies.data_parallel import DataParallelStrategy

        return DataParallelStrategy()
    if name == "multi_worker":
        from tfdist.strategies.multi_worker import MultiWorkerStrategy

        return MultiWorkerStrategy(sharding=data_sharding)
    raise ValueError(f"Invalid value for flag --strategy. Received: --strategy={name!r}. Expected one of {STRATEGIES}.")
