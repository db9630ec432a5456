"""tfdist-check: is tfdist-train's model exact under a strategy? Finds the first step and variable that differ.

Builds `tfdist.models.transformer_lm` with tfdist-train's sizes (--seq_len,
--d_model, --num_heads, --num_layers) and optimizer, trains --steps steps on
one device and under the strategy that tfdist-train's flags choose (--strategy,
--mesh, --rules, --shard, --stages, --microbatches, --num_devices) from the same
initial weights on the same random token batches (--global_batch_size,
--seed), and prints `tfdist.check`'s report: the loss, every gradient and every
variable on every device, per step, against --rtol / --atol (default: by
optimizer, see `tfdist.divergence.default_tolerance`). Exit status 0 when equal
within tolerance, 1 when something differs, 2 for a bad flag.

Examples:

    tfdist-check --strategy=model_parallel --mesh=batch:2,model:4   # 8 simulated devices
    tfdist-check --strategy=data --num_devices=8 --optimizer=sgd
    tfdist-check --strategy=pipeline --stages=2 --microbatches=4 --steps=5
    tfdist-check --strategy=sharded_data_parallel --shard=optimizer --rtol=1e-4
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dataclasses  # noqa: E402
import functools  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
from typing import NoReturn  # noqa: E402

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from tfdist import flags as tfdist_flags  # noqa: E402
from tfdist._native_log import native_stderr_silenced  # noqa: E402

FLAGS = tfdist_flags.FLAGS
PROG = "tfdist-check"
OPTIMIZERS = ("adamw", "adam", "sgd")
"""Valid values of --optimizer: tfdist-train's AdamW, Adam, SGD with momentum 0.9."""

# Defined before tfdist-train's flags, so that `define_flags` keeps this --steps.
flags.DEFINE_integer("steps", 3, "Training steps to compare.", lower_bound=1)
tfdist_flags.define_flags()
flags.DEFINE_enum(
    "optimizer",
    "adamw",
    list(OPTIMIZERS),
    "adamw: tfdist-train's (weight decay 0.01, not on biases, norms and embeddings); adam; sgd: momentum 0.9. "
    "Sets the default tolerance: SGD is compared at 1e-5, adaptive optimizers' values at 1e-3.",
)
flags.DEFINE_float("rtol", None, "Relative tolerance of the loss, gradients and values; default: by --optimizer.")
flags.DEFINE_float("atol", None, "Absolute tolerance; default 1e-7.")
for _name in ("rtol", "atol"):
    flags.register_validator(
        _name, lambda v: v is None or (math.isfinite(v) and v >= 0), message="expected a finite number >= 0"
    )

_USED = (
    "strategy", "num_devices", "mesh", "rules", "shard", "stages", "microbatches", "global_batch_size", "seq_len",
    "d_model", "num_heads", "num_layers", "learning_rate", "seed",
)
# tfdist-train's flags this binary does not read: given, they are an error rather than silently ignored.
_TRAINING_ONLY = ("epochs", "corpus", "max_corpus_bytes", "model_dir", "profile_steps")
for _name in _USED:
    flags.declare_key_flag(_name)


@dataclasses.dataclass(frozen=True)
class LmConfig:
    """The model and optimizer of a check, from the flags.

    Attributes:
        seq_len, d_model, num_heads, num_layers: `tfdist.models.transformer_lm`'s sizes.
        optimizer: one of `OPTIMIZERS`.
        learning_rate: a constant learning rate (tfdist-train's peak).
    """

    seq_len: int
    d_model: int
    num_heads: int
    num_layers: int
    optimizer: str
    learning_rate: float

    def build(self):
        """A compiled `transformer_lm` with this configuration (called with no strategy and in its scope)."""
        import keras

        from tfdist import models

        model = models.transformer_lm(
            seq_len=self.seq_len, d_model=self.d_model, num_heads=self.num_heads, num_layers=self.num_layers
        )
        if self.optimizer == "sgd":
            optimizer = keras.optimizers.SGD(self.learning_rate, momentum=0.9)
        elif self.optimizer == "adam":
            optimizer = keras.optimizers.Adam(self.learning_rate)
        else:
            optimizer = keras.optimizers.AdamW(self.learning_rate, weight_decay=0.01)
            optimizer.exclude_from_weight_decay(var_names=["bias", "gamma", "beta", "embeddings"])
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model


def token_batches(*, steps: int, batch_size: int, seq_len: int, seed: int):
    """`(inputs, next tokens)`: `steps * batch_size` random byte sequences of `seq_len`, shifted by one."""
    import numpy as np

    tokens = np.random.default_rng(seed).integers(0, 256, (steps * batch_size, seq_len + 1)).astype("int32")
    return tokens[:, :-1], tokens[:, 1:]


def _fail(message: str) -> NoReturn:
    tfdist_flags.exit_with_error(PROG, message)


def main(argv: list[str]) -> int:
    """Runs the check the flags describe; see the module docstring. Returns 0 if equal, 1 if not."""
    if len(argv) > 1:
        _fail(f"unexpected positional arguments {argv[1:]}; every option is a --flag (see --helpshort).")
    given = [f"--{name}" for name in _TRAINING_ONLY if FLAGS[name].present]
    if given:
        _fail(f"{', '.join(given)}: tfdist-train flags that tfdist-check does not read (it trains on random tokens, "
              "saves nothing). Drop them.")
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    logging.getLogger("absl").setLevel(logging.WARNING)
    with native_stderr_silenced():
        import keras
        import tensorflow as tf

        tf.config.list_physical_devices("GPU")
    try:
        tfdist_flags.configure_devices_from_flags(FLAGS)
        strategy = tfdist_flags.strategy_from_flags(FLAGS, data_sharding="data")
    except (RuntimeError, ValueError) as e:
        _fail(str(e))
    from tfdist import divergence

    config = LmConfig(
        seq_len=FLAGS.seq_len,
        d_model=FLAGS.d_model,
        num_heads=FLAGS.num_heads,
        num_layers=FLAGS.num_layers,
        optimizer=FLAGS.optimizer,
        learning_rate=FLAGS.learning_rate,
    )
    data = token_batches(steps=FLAGS.steps, batch_size=FLAGS.global_batch_size, seq_len=config.seq_len, seed=FLAGS.seed)
    keras.utils.set_random_seed(FLAGS.seed)
    print(
        f"{PROG}: transformer_lm ({config.num_layers} layer(s), d_model {config.d_model}, {config.num_heads} heads, "
        f"seq_len {config.seq_len}), {config.optimizer} at {config.learning_rate:g}, global batch "
        f"{FLAGS.global_batch_size}, {strategy!r}",
        flush=True,
    )
    report = divergence.check(
        config.build, data, strategy, steps=FLAGS.steps, batch_size=FLAGS.global_batch_size, rtol=FLAGS.rtol,
        atol=FLAGS.atol,
    )
    print(report, flush=True)
    return 0 if report.equal else 1


def run() -> None:
    """Entry point of the `tfdist-check` console script."""
    app.run(main, flags_parser=functools.partial(tfdist_flags.parse_flags_or_exit, prog=PROG))


if __name__ == "__main__":
    run()
