"""tfdist-train: trains the reference byte-level transformer LM under a tfdist strategy.

Trains `tfdist.models.transformer_lm` on a byte corpus (by default the Python
standard library's source) under any tfdist strategy (--strategy: data,
multi_worker, model_parallel with --mesh and --rules, pipeline with --stages and
--microbatches, sharded_data_parallel with --shard; auto says what it chose and
why), saves an atomic checkpoint per epoch (`tfdist.callbacks.Checkpoint`), the
final model as `model.keras` and TensorBoard logs under --model_dir (with
--profile_steps, every worker's profiler trace of those steps and the chief's
merged timeline of them), and prints a summary: devices, tokens/s, the speed against one device (measured after
training, --measure_speedup) and what would make the strategy pay, train loss,
and held-out loss and perplexity before and after training.

Examples:

    tfdist-train                                  # 4 simulated CPU devices, defaults
    tfdist-train --num_devices=2 --steps=50 --model_dir=/tmp/lm
    tfdist-train --strategy=model_parallel --mesh=batch:2,model:4   # 8 simulated devices
    tfdist-train --strategy=pipeline --stages=2 --microbatches=4    # 2 simulated devices
    tfdist-train --strategy=sharded_data_parallel --shard=optimizer # 4 simulated devices
    tfdist-launch -n 2 -- tfdist-train --profile_steps=10:15 --model_dir=/tmp/lm   # one timeline of 2 workers
    python -m tfdist.train --flagfile=lm.flags
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import atexit  # noqa: E402
import functools  # noqa: E402
import importlib.util  # noqa: E402
import itertools  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import NoReturn  # noqa: E402

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

# Neither imports TensorFlow: flags are checked, and the corpus is read, before TensorFlow loads.
from tfdist import data as data_lib  # noqa: E402
from tfdist import flags as tfdist_flags  # noqa: E402
from tfdist._native_log import native_stderr_silenced  # noqa: E402

FLAGS = tfdist_flags.FLAGS
tfdist_flags.define_flags()
flags.adopt_module_key_flags(tfdist_flags)  # --helpshort lists them

flags.DEFINE_boolean(
    "measure_speedup",
    True,
    "After training on more than one device in one process, time a few steps of the model on one device "
    "against the strategy's devices (interleaved rounds, medians; seconds on CPUs) and report the speed-up "
    "in the summary. Every strategy but multi_worker.",
)

_WARMUP_FRACTION = 0.1
_MAX_WARMUP_STEPS = 100
_SPEED_ROUNDS = 3  # interleaved rounds of --measure_speedup, each model ...
_SPEED_STEPS = 3  # ... timed over this many steps per round, after a warm-up of 2


def _fail(message: str) -> NoReturn:
    """Ends the binary with a one-line error (no traceback) and exit status 2, as a bad flag does."""
    tfdist_flags.exit_with_error("tfdist-train", message)


def _stop_on_non_finite_loss():
    """A callback that ends the binary at the first step whose loss is NaN or infinite (before any save)."""
    import keras

    steps = itertools.count(1)

    def check(batch, logs):
        step, loss = next(steps), (logs or {}).get("loss")
        if loss is not None and not math.isfinite(loss):
            _fail(
                f"training stopped at step {step}: loss is {float(loss)}, the model diverged. "
                f"Lower --learning_rate (now {FLAGS.learning_rate:g})."
            )

    return keras.callbacks.LambdaCallback(on_train_batch_end=check)


def _check_host_memory(strategy) -> None:
    """Refuses sizes whose training cannot fit this machine's memory (training on CPUs).

    Counts only what training surely holds: per copy of the model on this host (a data-parallel
    replica; a model-parallel group along the mesh's batch axis, whose rules split the weights over
    the other axes) the float32 weights, gradients and AdamW's two moments (under sharded data
    parallelism, this host's share of what it splits over the devices of all processes: the moments,
    and with --shard=weights the weights and gradients too), and the attention probabilities of this
    process's share of the batch kept for the backward pass. The sizes come from flags, so the error
    names them.
    """
    from tfdist import devices as devices_lib
    from tfdist import models
    from tfdist.strategies import topology as topology_lib
    from tfdist.strategies.sharded_data_parallel import ShardedDataParallelStrategy

    memory = devices_lib.host_memory()
    if memory is None:
        return
    parameters = models.transformer_lm_parameters(
        seq_len=FLAGS.seq_len, d_model=FLAGS.d_model, num_layers=FLAGS.num_layers
    )
    topology = topology_lib.of(strategy)
    copies = max(1, topology.data_parallel_size // topology.num_workers)
    local_batch = math.ceil(FLAGS.global_batch_size / topology.num_workers)
    held = f"{copies} cop{'y' if copies == 1 else 'ies'} on this host"
    state = 4 * parameters * copies  # float32 values: weights, gradients, two moments
    if isinstance(strategy, ShardedDataParallelStrategy):
        split = 4 if strategy.shard == "weights" else 2  # of those 4 values per parameter, split over all devices
        state = (4 - split) * parameters * copies + math.ceil(split * parameters / topology.num_workers)
        held = f"--shard={strategy.shard} over {topology.data_parallel_size} devices"
    need = 4 * (state + local_batch * FLAGS.num_heads * FLAGS.seq_len**2 * FLAGS.num_layers)
    if need > memory:
        _fail(
            f"--d_model={FLAGS.d_model}, --num_layers={FLAGS.num_layers}, --seq_len={FLAGS.seq_len}, "
            f"--num_heads={FLAGS.num_heads}, --global_batch_size={FLAGS.global_batch_size}: training needs at least "
            f"{need / 2**30:,.1f} GiB ({parameters:,} parameters with gradients and optimizer state, "
            f"{held}, and the attention of the batch), "
            "more than this machine's "
            f"{memory / 2**30:,.1f} GiB. Expected sizes that fit: lower them."
        )


def _learning_rate(peak: float, total_steps: int):
    """Linear warmup to `peak`, then cosine decay to 0 at `total_steps`: a Keras LearningRateSchedule."""
    import keras

    warmup = min(_MAX_WARMUP_STEPS, max(1, int(total_steps * _WARMUP_FRACTION)))
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0,
        decay_steps=max(1, total_steps - warmup),
        warmup_target=peak,
        warmup_steps=warmup,
    )


def _compiled_lm(strategy, *, total_steps: int):
    """The LM of the flags under `strategy`, compiled with AdamW and the learning-rate schedule."""
    import keras

    from tfdist import models

    with strategy.scope():
        model = models.transformer_lm(
            seq_len=FLAGS.seq_len,
            d_model=FLAGS.d_model,
            num_heads=FLAGS.num_heads,
            num_layers=FLAGS.num_layers,
        )
        optimizer = keras.optimizers.AdamW(learning_rate=_learning_rate(FLAGS.learning_rate, total_steps),
                                           weight_decay=0.01)
        optimizer.exclude_from_weight_decay(var_names=["bias", "gamma", "beta", "embeddings"])
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _devices_of(strategy) -> list[str]:
    """The devices of this process that `strategy` trains on."""
    from tfdist.strategies.model_parallel import ModelParallelStrategy
    from tfdist.strategies.pipeline import PipelineStrategy

    if isinstance(strategy, ModelParallelStrategy):
        return list(strategy.mesh.local_devices())
    if isinstance(strategy, PipelineStrategy):
        return [device for replica in zip(*strategy.stage_devices) for device in replica]
    return list(strategy.extended.worker_devices)


def _layout(strategy, batch: int) -> tuple[str, str, list[tuple[str, str]]]:
    """How `strategy` split the model and each batch: the summary's strategy and training words, and rows of its own."""
    from tfdist import flags as tfdist_flags
    from tfdist.strategies.model_parallel import ModelParallelStrategy
    from tfdist.strategies.pipeline import PipelineStrategy
    from tfdist.strategies.sharded_data_parallel import ShardedDataParallelStrategy

    replicas = strategy.num_replicas_in_sync
    if isinstance(strategy, ModelParallelStrategy):
        axis = strategy.batch_axis
        split = f"split {strategy.mesh_shape[axis]} ways over mesh axis {axis!r}" if axis else "whole on every device"
        mesh = f"mesh {tfdist_flags.format_mesh(strategy.mesh_shape)}"
        if isinstance(strategy, ShardedDataParallelStrategy):
            what = "weights and optimizer state (ZeRO-3)" if strategy.shard == "weights" else "optimizer state (ZeRO-1)"
            how = f"shard {strategy.shard}: {what} split over mesh axis {axis!r}, {mesh}"
        else:
            how = f"{mesh}, rules {FLAGS.rules or tfdist_flags.DEFAULT_RULES}"
        return f"{how}, {replicas} replica (one global program)", f"global batch {batch} {split}", []
    if isinstance(strategy, PipelineStrategy):
        micro = batch // (strategy.microbatches * strategy.replicas)
        plan = strategy.plan
        stages = "; ".join(
            f"{i}: {', '.join(layers)} ({params:,} parameters)"
            for i, (layers, params) in enumerate(zip(plan.layers, plan.params))
        )
        return (
            f"{strategy.stages} stages x {strategy.microbatches} micro-batches, {replicas} replica(s)",
            f"global batch {batch} in {strategy.microbatches} micro-batches of {micro} per replica",
            [("pipeline stages", f"{stages} (balanced on {plan.cost})")],
        )
    return f"{replicas} replica(s)", f"global batch {batch} over {replicas} replica(s)", []


def _speed_rows(model, build, train_ds, strategy, devices: list[str], multi_worker: bool) -> list[tuple[str, str]]:
    """The summary's rows on the strategy's speed against one device, measured now.

    Times `_SPEED_ROUNDS` rounds of `_SPEED_STEPS` steps (after a warm-up) of the trained model on
    the strategy's devices and of a copy of it, built and compiled the same way, on the first of
    them, interleaved, on one batch of the training data: the ratio of the median step times.
    """
    import time

    from tfdist import _fit_timing
    from tfdist.advisor import _LM_HEADS as _ADVISE_LM_HEADS
    from tfdist.strategies.data_parallel import DataParallelStrategy
    from tfdist.strategies.model_parallel import ModelParallelStrategy
    from tfdist.strategies.pipeline import PipelineStrategy
    from tfdist.strategies.sharded_data_parallel import ShardedDataParallelStrategy

    label = "speed vs one device"
    n = len(devices)
    if multi_worker:
        return [(label, "not measured for multi-worker training")]
    if n == 1:
        return [(label, "n/a: trained on one device")]
    start = time.perf_counter()
    single = build(DataParallelStrategy(devices=devices[:1]))
    single.set_weights(model.get_weights())
    times = _fit_timing.interleaved_step_times(
        {"one": single, "all": model}, train_ds.take(1).cache().repeat(), rounds=_SPEED_ROUNDS, steps=_SPEED_STEPS
    )
    seconds = time.perf_counter() - start
    speedup = times["one"] / times["all"]
    gpus = any("GPU" in d.upper() for d in devices)
    where = f"{n} GPUs" if gpus else f"{n} simulated CPU devices sharing {os.cpu_count()} cores"
    measured = (
        f"{speedup:.2f}x on {where} (measured after training, on one batch: {times['all'] * 1e3:.1f} ms per step "
        f"vs {times['one'] * 1e3:.1f} ms on one device, medians of {_SPEED_ROUNDS} interleaved rounds of "
        f"{_SPEED_STEPS} steps; {seconds:.1f} s, --nomeasure_speedup skips it)"
    )
    shared = "" if gpus else "these devices share the CPU, and "
    if isinstance(strategy, ShardedDataParallelStrategy):
        kind = "sharded data parallelism"
        moves = (
            "all-gathers each weight for its use and reduce-scatters its gradient"
            if strategy.shard == "weights"
            else "all-gathers each weight after its update"
        )
        why_not = (
            f"{shared}each step {moves} between the devices; it is for a model whose weights and optimizer state "
            "do not fit one device, and pays with one accelerator per device and a batch whose compute per step "
            "outweighs those collectives"
        )
    elif isinstance(strategy, ModelParallelStrategy):
        kind = "model parallelism"
        why_not = (
            f"{shared}each step adds DTensor's collectives between the mesh's devices; it pays with one accelerator "
            "per mesh device and a model too large for one device, or layers wide enough that each device's "
            "share of the matmuls outweighs the collectives"
        )
    elif isinstance(strategy, PipelineStrategy):
        kind = "pipeline parallelism"
        k, m = strategy.stages, strategy.microbatches
        why_not = (
            f"{shared}each step moves activations between the stages and leaves them idle for (K-1)/(M+K-1) = "
            f"{(k - 1) / (m + k - 1):.0%} of it (GPipe's bubble, K={k} stages, M={m} micro-batches); it pays with "
            "one accelerator per stage and a model too large for one device, and more --microbatches shrink the "
            "bubble"
        )
    else:
        kind = "data parallelism"
        advise = (
            f"; tfdist-advise --model=lm --width={FLAGS.d_model} --depth={FLAGS.num_layers} "
            f"--seq_len={FLAGS.seq_len} --batch_size={FLAGS.global_batch_size} --optimizer=adamw --num_devices={n} "
            "measures those parts for this model"
            if FLAGS.d_model % _ADVISE_LM_HEADS == 0
            else ""
        )
        accelerators = "" if gpus else "one accelerator per replica (these devices share the CPU), or "
        why_not = (
            f"it pays with {accelerators}a model or batch whose compute per step outweighs the all-reduce of the "
            f"gradients and the per-step overhead{advise}"
        )
    if speedup >= 1:
        verdict = f"pays here: {n} devices train {speedup:.2f}x as fast as one"
    else:
        one = "--num_devices=1" if kind == "data parallelism" else "one device"
        verdict = f"does not pay here ({one} trains faster); {why_not}"
    return [(label, measured), (kind, verdict)]


def _profile_callback(strategy, log_dir: str, *, total_steps: int, steps: int):
    """The `ProfileSteps` of --profile_steps (None without it), writing where every worker can: --model_dir/logs."""
    from tfdist import callbacks as tfdist_callbacks
    from tfdist.strategies import topology as topology_lib

    if FLAGS.profile_steps is None:
        return None
    first, last = FLAGS.profile_steps
    if last > total_steps:
        _fail(
            f"--profile_steps={first}:{last} ends after the last training step, {total_steps} (--epochs={FLAGS.epochs} "
            f"x {steps} steps). Expected steps from 1 to {total_steps}, e.g. --profile_steps="
            f"{min(first, total_steps)}:{total_steps}."
        )
    workers = topology_lib.of(strategy).num_workers
    if workers > 1 and not FLAGS.model_dir:
        _fail(
            f"--profile_steps with {workers} workers needs --model_dir: a directory every worker can write (on a file "
            "system they share), where each writes its trace and the chief merges them."
        )
    # The chief's log directory: the other workers write their traces there too, not into their temporary one.
    where = os.path.join(FLAGS.model_dir, "logs") if FLAGS.model_dir else log_dir
    try:
        return tfdist_callbacks.ProfileSteps(steps=(first, last), log_dir=where)
    except ValueError as e:
        _fail(f"--profile_steps: {e}")


def _timeline_row(profile, chief: bool) -> str:
    """The summary's words on the profiled steps' timeline."""
    steps = f"steps {profile.first} to {profile.last}"
    if not chief:
        return f"merged by the chief ({steps}; this worker's trace is in {profile.run_dir})"
    if profile.trace_path is None:
        return f"not written: no worker captured a trace of {steps} (see the warnings above)"
    return (
        f"{profile.trace_path} ({steps} of every worker; open it in ui.perfetto.dev or chrome://tracing; "
        f"TensorBoard's Profile tab reads the per-worker traces in {profile.run_dir})"
    )


def _perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))


def _print_summary(rows: list[tuple[str, str]]) -> None:
    width = max(len(label) for label, _ in rows) + 1
    print("\ntfdist-train summary")
    for label, value in rows:
        print(f"  {label + ':':<{width}} {value}")
    sys.stdout.flush()


_stopped_by: int | None = None  # the signal that stopped this process


def _terminated(signum, frame) -> NoReturn:
    """SIGTERM (a scheduler's stop, tfdist-launch forwarding Ctrl-C): end now, running the cleanup."""
    global _stopped_by
    _stopped_by = signum
    print(f"tfdist-train: stopped by signal {signum} (SIGTERM)", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    """Trains the LM as the flags say; see the module docstring."""
    signal.signal(signal.SIGTERM, _terminated)
    if len(argv) > 1:
        _fail(f"unexpected positional arguments {argv[1:]}; every option is a --flag (see --helpshort).")
    if importlib.util.find_spec("tensorboard") is None:
        _fail("TensorBoard logging needs the `tensorboard` package, which is not installed: pip install tensorboard")
    # TensorFlow logs each strategy and all-reduce it builds at INFO level: noise here.
    logging.getLogger("tensorflow").setLevel(logging.ERROR)
    # DTensor logs each mesh it builds (its clients and devices) through absl at INFO level: noise too.
    logging.getLogger("absl").setLevel(logging.WARNING)

    try:
        corpus = data_lib.load_corpus(FLAGS.corpus, max_bytes=FLAGS.max_corpus_bytes)
    except ValueError as e:
        _fail(f"--corpus: {e}")
    train_windows, heldout_windows = data_lib.window_counts(len(corpus), seq_len=FLAGS.seq_len)
    if 0 < train_windows < FLAGS.global_batch_size:  # (no window at all: lm_datasets says so below)
        _fail(
            f"--global_batch_size={FLAGS.global_batch_size} is more than the {train_windows:,} training examples "
            f"of the corpus ({len(corpus):,} bytes, --seq_len={FLAGS.seq_len}). Expected at most {train_windows:,}: "
            "lower it, or raise --max_corpus_bytes or use a larger --corpus."
        )
    with native_stderr_silenced():  # TensorFlow's native start-up notices
        import keras
        import tensorflow as tf

        from tfdist import callbacks as tfdist_callbacks
        from tfdist.callbacks import _files as checkpoint_files
        from tfdist.strategies import topology as topology_lib
        from tfdist.strategies.model_parallel import ModelParallelStrategy

        # On a machine without a CUDA driver the first GPU listing logs a cuInit error (TensorFlow
        # lists them when imported under app.run, and so do the strategies): list them here, quietly.
        # This does not start the runtime.
        tf.config.list_physical_devices("GPU")
    try:
        chosen, reason = tfdist_flags.resolve_strategy(FLAGS)
        tfdist_flags.configure_devices_from_flags(FLAGS)
        # The corpus is in memory: every worker holds it and keeps its share of each batch.
        strategy = tfdist_flags.strategy_from_flags(FLAGS, data_sharding="data")
    except (RuntimeError, ValueError) as e:  # ClusterError is a ValueError
        _fail(str(e))
    devices = _devices_of(strategy)
    # A model-parallel batch must divide by the mesh's batch axis, the last one of a pass too.
    batch_multiple = topology_lib.of(strategy).data_parallel_size if isinstance(strategy, ModelParallelStrategy) else 1
    cluster = getattr(strategy, "cluster", None)
    chief = cluster is None or cluster.is_chief

    # Every worker saves (saving may run collectives); only the chief writes into --model_dir,
    # the others into a temporary directory removed at exit.
    model_dir = FLAGS.model_dir if chief else None
    model_dir = model_dir or tempfile.mkdtemp(prefix="tfdist-train-")
    if not chief:
        atexit.register(shutil.rmtree, model_dir, ignore_errors=True)
    checkpoint_dir = os.path.join(model_dir, "checkpoints")
    log_dir = os.path.join(model_dir, "logs")
    try:
        os.makedirs(checkpoint_dir, exist_ok=True)
    except OSError as e:
        _fail(f"--model_dir: cannot create {checkpoint_dir!r}: {e}")

    try:
        train_ds, heldout_ds = data_lib.lm_datasets(
            corpus,
            seq_len=FLAGS.seq_len,
            global_batch_size=FLAGS.global_batch_size,
            seed=FLAGS.seed,
            repeat=FLAGS.steps > 0,
            batch_multiple=batch_multiple,
        )
    except ValueError as e:
        _fail(f"--corpus / --seq_len: {e}")
    if not any("GPU" in d.upper() for d in devices):
        _check_host_memory(strategy)
    whole = (train_windows, heldout_windows)
    train_windows, heldout_windows = data_lib.window_counts(
        len(corpus), seq_len=FLAGS.seq_len, batch_multiple=batch_multiple
    )
    batch = FLAGS.global_batch_size
    steps_per_epoch = FLAGS.steps or math.ceil(train_windows / batch)
    profile = _profile_callback(strategy, log_dir, total_steps=FLAGS.epochs * steps_per_epoch, steps=steps_per_epoch)

    if FLAGS.strategy == "auto":  # once the input is known to be good: bad input prints only its error
        print(f"tfdist-train: --strategy=auto chose {chosen}: {reason}", flush=True)
    keras.utils.set_random_seed(FLAGS.seed)
    build = functools.partial(_compiled_lm, total_steps=FLAGS.epochs * steps_per_epoch)
    model = build(strategy)

    untrained = model.evaluate(heldout_ds, verbose=0, return_dict=True)["loss"]
    # Tokens/s over every step but the first (which traces and compiles), in the logs and TensorBoard.
    throughput = tfdist_callbacks.Throughput(
        batch_size=batch, tokens_per_example=FLAGS.seq_len, skip_steps=1, log_dir=os.path.join(log_dir, "throughput")
    )
    # Atomic checkpoints (temp file, fsync, rename) of the model and optimizer after every epoch, the last 3
    # kept (restore with tfdist.callbacks.restore_checkpoint); the final model also as model.keras.
    checkpoint = tfdist_callbacks.Checkpoint(checkpoint_dir, every_n_epochs=1)
    model_path = os.path.join(model_dir, "model.keras")
    checkpoint_files.remove_stale_temps(model_dir, ending=".keras")
    try:
        history = model.fit(
            train_ds,
            epochs=FLAGS.epochs,
            steps_per_epoch=FLAGS.steps or None,  # 0: one pass over the training windows
            validation_data=heldout_ds,
            shuffle=False,  # lm_datasets shuffles the training windows.
            callbacks=[
                _stop_on_non_finite_loss(),  # first: no other callback sees the diverged step
                checkpoint,
                keras.callbacks.TensorBoard(log_dir=log_dir),
                throughput,
                *([profile] if profile else []),  # last: its step markers hold the step and the others' step ends
            ],
            verbose=1 if sys.stdout.isatty() else 2,
        )
        checkpoint_files.write_keras_model(model, model_path)
    except tfdist_callbacks.CheckpointWriteError as e:  # disk full, directory not writable: no traceback
        _fail(str(e))
    except Exception:
        # A SIGTERM that arrives while a step waits in TensorFlow is handled as the step's error is raised:
        # pybind11 then reports the SystemExit as a RuntimeError ("MISMATCH of original and normalized active
        # exception types"), or a peer stopped first fails the step. Either way the job was stopped: say only that.
        if _stopped_by is not None:
            raise SystemExit(128 + _stopped_by) from None
        raise
    trained = history.history["val_loss"][-1]

    rate = history.history.get("tokens_per_sec", [None])[-1]
    speed = (
        _speed_rows(model, build, train_ds, strategy, devices, cluster is not None) if FLAGS.measure_speedup else []
    )
    parallelism, batch_split, layout_rows = _layout(strategy, batch)
    _print_summary(
        [
            ("strategy", f"{type(strategy).__name__} ({FLAGS.strategy}), {parallelism}"),
            *([("auto strategy", f"chose {chosen}: {reason}")] if FLAGS.strategy == "auto" else []),
            ("worker", f"{cluster.task_index} of {cluster.num_workers}" + (" (chief)" if chief else "")
             if cluster is not None else "single process"),
            ("devices", ", ".join(devices)),
            *layout_rows,
            (
                "model",
                f"transformer_lm, {FLAGS.num_layers} layer(s), d_model {FLAGS.d_model}, "
                f"{FLAGS.num_heads} heads, seq_len {FLAGS.seq_len}, {model.count_params():,} parameters",
            ),
            (
                "corpus",
                f"{FLAGS.corpus or 'Python standard library'}: {len(corpus):,} bytes, "
                f"{train_windows:,} training / {heldout_windows:,} held-out windows"
                + (f" (rounded down to multiples of {batch_multiple}, the mesh's batch axis)"
                   if whole != (train_windows, heldout_windows) else ""),
            ),
            (
                "training",
                f"{FLAGS.epochs} epoch(s) x {steps_per_epoch} steps, {batch_split}",
            ),
            (
                "tokens/s",
                f"{rate:,.0f} (mean over the last epoch; the run's first, compiling step left out)"
                if rate
                else "n/a (only the first, compiling step ran)",
            ),
            *speed,
            ("train loss", f"{history.history['loss'][-1]:.4f} (mean over the last epoch)"),
            ("held-out loss (untrained)", f"{untrained:.4f}"),
            ("held-out loss (trained)", f"{trained:.4f}"),
            ("held-out perplexity (untrained)", f"{_perplexity(untrained):.2f}"),
            ("held-out perplexity (trained)", f"{_perplexity(trained):.2f}"),
            ("checkpoint", checkpoint.last_saved if chief else "written by the chief"),
            ("Keras model", model_path if chief else "written by the chief"),
            ("TensorBoard logs", log_dir if chief else "written by the chief"),
            *([("timeline", _timeline_row(profile, chief))] if profile else []),
        ]
    )
    return 0


def run() -> None:
    """Entry point of the `tfdist-train` console script."""
    app.run(main, flags_parser=functools.partial(tfdist_flags.parse_flags_or_exit, prog="tfdist-train"))


if __name__ == "__main__":
    run()
