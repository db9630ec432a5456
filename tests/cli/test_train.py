"""The tfdist-train binary, run as a user runs it: a subprocess with flags, bounded by a timeout."""

import glob
import math
import os
import re
import resource
import subprocess
import sys

import _procs
import keras
import numpy as np
import pytest

import tfdist.callbacks
from tfdist import models  # also registers the model's layers for load_model

TRAIN_TIMEOUT_S = 200
ERROR_TIMEOUT_S = 60
SEQ_LEN = 32


def run_train(*args: str, timeout: float, fresh: bool = False) -> subprocess.CompletedProcess:
    """`python -m tfdist.train ARGS`: forked from a process that imported TensorFlow, or `fresh` as a user starts it.

    Fresh where a test counts stderr's lines (TensorFlow's own start-up lines must not be among them); the
    launcher's workers, test_bad_input's binaries and the examples start fresh too.
    """
    return _procs.run([sys.executable, "-m", "tfdist.train", *args], timeout=timeout, fork=not fresh)


def summary_value(stdout: str, label: str) -> str:
    found = re.search(rf"^  {re.escape(label)}:\s+(.*)$", stdout, re.MULTILINE)
    assert found, f"no {label!r} line in the summary:\n{stdout}"
    return found.group(1)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short run on 2 simulated devices, with its flags read from a --flagfile."""
    model_dir = tmp_path_factory.mktemp("model_dir")
    flagfile = model_dir.parent / "train.flags"
    flagfile.write_text(
        "\n".join(
            [
                "--num_devices=2",
                "--global_batch_size=16",
                f"--seq_len={SEQ_LEN}",
                "--d_model=64",
                "--num_heads=2",
                "--num_layers=1",
                "--steps=0",  # whole corpus per epoch
                "--epochs=2",
                "--max_corpus_bytes=40000",
                "--learning_rate=0.005",
            ]
        )
    )
    result = run_train(f"--flagfile={flagfile}", f"--model_dir={model_dir}", timeout=TRAIN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, model_dir


def test_runs_on_two_replicas_from_a_flagfile(trained):
    result, _ = trained
    assert "tfdist-train summary" in result.stdout
    assert summary_value(result.stdout, "strategy").startswith("DataParallelStrategy (auto), 2 replica(s)")
    assert summary_value(result.stdout, "devices").count("CPU") == 2
    # 40000 bytes: 38000 training bytes -> 1151 windows of 33 -> 72 steps of 16 per epoch.
    assert summary_value(result.stdout, "training").startswith("2 epoch(s) x 72 steps, global batch 16")
    assert float(summary_value(result.stdout, "tokens/s").split()[0].replace(",", "")) > 0
    assert "Traceback" not in result.stderr


SPEED = re.compile(
    r"(?P<speedup>[0-9.]+)x on 2 simulated CPU devices sharing (?P<cores>[0-9]+) cores \(measured after training, "
    r"on one batch: (?P<many_ms>[0-9.]+) ms per step vs (?P<one_ms>[0-9.]+) ms on one device, medians of 3 "
    r"interleaved rounds of 3 steps; (?P<seconds>[0-9.]+) s, --nomeasure_speedup skips it\)"
)


def test_the_summary_states_the_speed_against_one_device_measured_in_the_run(trained):
    result, _ = trained
    row = summary_value(result.stdout, "speed vs one device")
    measured = SPEED.fullmatch(row)
    assert measured, row
    speedup, one_ms, many_ms = (float(measured.group(k)) for k in ("speedup", "one_ms", "many_ms"))
    assert int(measured.group("cores")) == os.cpu_count()
    assert all(0 < v < math.inf for v in (speedup, one_ms, many_ms, float(measured.group("seconds")))), row
    # The speed-up is the ratio of the two step times it shows (each rounded to 0.1 ms, it to 0.01).
    assert speedup == pytest.approx(one_ms / many_ms, abs=0.006 + 0.05 * (1 + speedup) / many_ms), row
    # The 2-device step measured after training is the training's own step to within the noise of a shared host.
    tokens_per_s = float(summary_value(result.stdout, "tokens/s").split()[0].replace(",", ""))
    training_ms = 1e3 * 16 * SEQ_LEN / tokens_per_s
    assert 0.25 < many_ms / training_ms < 4, (row, training_ms)
    verdict = summary_value(result.stdout, "data parallelism")
    assert verdict.startswith("pays here: 2 devices train" if speedup >= 1 else "does not pay here"), verdict


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--num_devices=2", "--nomeasure_speedup"], None),
        (["--num_devices=1"], "n/a: trained on one device"),
    ],
)
def test_the_speed_row_is_left_out_when_turned_off_and_says_so_on_one_device(tmp_path, args, expected):
    result = run_train(*args, "--global_batch_size=8", f"--seq_len={SEQ_LEN}", "--d_model=32", "--num_heads=2",
                       "--num_layers=1", "--steps=6", "--max_corpus_bytes=20000", f"--model_dir={tmp_path}",
                       timeout=TRAIN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary_value(result.stdout, "strategy").endswith(f"{args[0][-1]} replica(s)")
    if expected is None:
        assert "speed vs one device" not in result.stdout, result.stdout
    else:
        assert summary_value(result.stdout, "speed vs one device") == expected
    assert "data parallelism:" not in result.stdout, result.stdout


def test_held_out_perplexity_falls_well_below_the_untrained_model(trained):
    result, _ = trained
    untrained = float(summary_value(result.stdout, "held-out perplexity (untrained)"))
    after = float(summary_value(result.stdout, "held-out perplexity (trained)"))
    loss = float(summary_value(result.stdout, "held-out loss (trained)"))
    assert 150 < untrained < 400  # about the vocabulary size, 256, before training
    assert after < untrained / 4
    assert after == pytest.approx(math.exp(loss), rel=1e-3)


def test_writes_restorable_checkpoints_a_keras_model_and_tensorboard_events(trained):
    result, model_dir = trained
    # One atomic checkpoint per epoch (72 steps each), then the final model as model.keras.
    checkpoint = summary_value(result.stdout, "checkpoint")
    assert checkpoint == str(model_dir / "checkpoints" / "ckpt-000000144.npz")
    assert sorted(os.listdir(model_dir / "checkpoints")) == ["ckpt-000000072.npz", "ckpt-000000144.npz"]
    assert summary_value(result.stdout, "Keras model") == str(model_dir / "model.keras")
    assert sorted(os.listdir(model_dir)) == ["checkpoints", "logs", "model.keras"]  # no temporary file left
    assert summary_value(result.stdout, "TensorBoard logs") == str(model_dir / "logs")
    assert glob.glob(str(model_dir / "logs" / "train" / "events.out.tfevents.*"))
    assert glob.glob(str(model_dir / "logs" / "validation" / "events.out.tfevents.*"))
    saved = keras.saving.load_model(model_dir / "model.keras")
    assert tuple(saved(np.zeros((1, SEQ_LEN), np.int32)).shape) == (1, SEQ_LEN, 256)
    # The last checkpoint restores into a fresh model: the trained weights and optimizer state, exactly.
    fresh = models.transformer_lm(seq_len=SEQ_LEN, d_model=64, num_heads=2, num_layers=1)
    fresh.compile(optimizer=keras.optimizers.AdamW.from_config(saved.optimizer.get_config()))
    meta = tfdist.callbacks.restore_checkpoint(fresh, model_dir / "checkpoints")
    assert (meta["step"], meta["epoch"]) == (144, 2)
    assert len(fresh.weights) == len(saved.weights) > 0
    for a, b in zip(fresh.weights + fresh.optimizer.variables, saved.weights + saved.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_a_failed_checkpoint_write_ends_with_one_line_naming_the_file(tmp_path):
    # A file size limit makes the kernel refuse the checkpoint's bytes (EFBIG) part way, as a full disk
    # does (ENOSPC; injected in tests/callbacks/test_checkpoint_files.py): the write fails inside the file.
    model_dir = tmp_path / "model_dir"
    limit = 100_000  # bytes: the log files stay below it, the first checkpoint (~385 KB) does not

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = _procs.run(
        [sys.executable, "-m", "tfdist.train", "--global_batch_size=8", f"--seq_len={SEQ_LEN}", "--d_model=32",
         "--num_heads=2", "--num_layers=1", "--steps=6", "--max_corpus_bytes=20000", f"--model_dir={model_dir}"],
        timeout=TRAIN_TIMEOUT_S,
        preexec_fn=limit_file_size,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    target = model_dir / "checkpoints" / "ckpt-000000006.npz"
    assert result.stderr.strip().splitlines()[-1] == (
        f"tfdist-train: error: [Errno 27] Cannot write {str(target)!r}: File too large. Nothing was written under "
        "that name and the files already there are intact; free disk space or make the directory writable, then "
        "try again."
    )
    assert os.listdir(model_dir / "checkpoints") == []  # neither a torn checkpoint nor its temporary file
    assert not (model_dir / "model.keras").exists()


# One small LM trained under each strategy: 39,600 bytes give 1,140 training and 60 held-out windows, even
# counts, so the 2x4 mesh's batch axis leaves none out and every strategy sees the same batches.
SMALL_LM = ["--global_batch_size=16", f"--seq_len={SEQ_LEN}", "--d_model=32", "--num_heads=4", "--num_layers=1",
            "--steps=12", "--max_corpus_bytes=39600", "--learning_rate=0.01"]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """SMALL_LM on one device with --strategy=auto (outside a cluster: data): the reference run."""
    result = run_train(*SMALL_LM, "--num_devices=1", f"--model_dir={tmp_path_factory.mktemp('one')}",
                       timeout=TRAIN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_auto_says_what_it_chose_and_why(one_device):
    reason = ("no cluster (no TF_CONFIG or Slurm job), so data parallelism over this process's devices; "
              "model_parallel, pipeline and sharded_data_parallel run only when --strategy names them")
    assert one_device.stdout.splitlines()[0] == f"tfdist-train: --strategy=auto chose data: {reason}"
    assert summary_value(one_device.stdout, "auto strategy") == f"chose data: {reason}"
    assert summary_value(one_device.stdout, "strategy") == "DataParallelStrategy (auto), 1 replica(s)"


def assert_trains_as_one_device(result, one_device, *, trained_abs=2e-4):
    """The same held-out and train losses as the one-device run (4 decimals), and a perplexity well down.

    `trained_abs`: the tolerance of the losses after training (before it, they always agree to 4 decimals).
    """
    assert "Traceback" not in result.stderr
    for label, tolerance in (("held-out loss (untrained)", 2e-4), ("held-out loss (trained)", trained_abs),
                             ("train loss", trained_abs)):
        got, want = (float(summary_value(r.stdout, label).split()[0]) for r in (result, one_device))
        assert got == pytest.approx(want, abs=tolerance), label
    untrained = float(summary_value(result.stdout, "held-out perplexity (untrained)"))
    assert float(summary_value(result.stdout, "held-out perplexity (trained)")) < untrained / 4


def test_model_parallel_on_a_2x4_mesh_trains_as_one_device(tmp_path, one_device):
    result = run_train(*SMALL_LM, "--strategy=model_parallel", "--mesh=batch:2,model:4", f"--model_dir={tmp_path}",
                       timeout=TRAIN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary_value(result.stdout, "strategy") == (
        "ModelParallelStrategy (model_parallel), mesh batch:2,model:4, rules transformer, "
        "1 replica (one global program)"
    )
    assert summary_value(result.stdout, "devices").count("CPU") == 8  # simulated: no --num_devices
    assert summary_value(result.stdout, "training") == (
        "1 epoch(s) x 12 steps, global batch 16 split 2 ways over mesh axis 'batch'"
    )
    assert_trains_as_one_device(result, one_device)
    speed = summary_value(result.stdout, "speed vs one device")
    assert re.fullmatch(r"[0-9.]+x on 8 simulated CPU devices sharing \d+ cores \(measured after training, .*\)", speed)
    assert re.match(r"(pays here|does not pay here \(one device trains faster\); .*DTensor's collectives)",
                    summary_value(result.stdout, "model parallelism"))
    assert summary_value(result.stdout, "checkpoint") == str(tmp_path / "checkpoints" / "ckpt-000000012.npz")
    saved = keras.saving.load_model(tmp_path / "model.keras")  # whole tensors: loads on one device
    assert tuple(saved(np.zeros((1, SEQ_LEN), np.int32)).shape) == (1, SEQ_LEN, 256)


def test_model_parallel_over_two_launched_processes_trains_as_one_device(tmp_path, one_device):
    """tfdist-launch -n 2: one {"batch": 2, "model": 4} mesh over both processes (4 simulated CPUs each)."""
    cmd = [sys.executable, "-m", "tfdist.launch", "-n", "2", "--join_timeout=120", "--", sys.executable, "-m",
           "tfdist.train", *SMALL_LM, "--nomeasure_speedup", "--strategy=model_parallel", "--mesh=batch:2,model:4",
           f"--model_dir={tmp_path / 'two'}"]
    result = _procs.run(cmd, timeout=2 * TRAIN_TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for worker in (0, 1):
        lines = "\n".join(
            line.split("] ", 1)[1] for line in result.stdout.splitlines() if line.startswith(f"[worker {worker}] ")
        )
        assert summary_value(lines, "worker") == f"{worker} of 2" + (" (chief)" if worker == 0 else "")
        assert summary_value(lines, "devices").count(f"/job:worker/replica:0/task:{worker}/device:CPU:") == 4
        assert summary_value(lines, "training") == (
            "1 epoch(s) x 12 steps, global batch 16 split 2 ways over mesh axis 'batch'"
        )
        assert_trains_as_one_device(subprocess.CompletedProcess(cmd, 0, lines, ""), one_device)
    assert "DataShardingWarning" not in result.stdout + result.stderr  # the binary asks for DATA sharding
    saved = keras.saving.load_model(tmp_path / "two" / "model.keras")  # written by worker 0, loads on one device
    assert tuple(saved(np.zeros((1, SEQ_LEN), np.int32)).shape) == (1, SEQ_LEN, 256)


def test_pipeline_of_two_stages_trains_as_one_device(tmp_path, one_device):
    result = run_train(*SMALL_LM, "--strategy=pipeline", "--stages=2", "--microbatches=2", "--nomeasure_speedup",
                       f"--model_dir={tmp_path}", timeout=TRAIN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary_value(result.stdout, "strategy") == (
        "PipelineStrategy (pipeline), 2 stages x 2 micro-batches, 1 replica(s)"
    )
    assert summary_value(result.stdout, "devices") == "/device:CPU:0, /device:CPU:1"  # simulated: no --num_devices
    assert summary_value(result.stdout, "pipeline stages").startswith("0: token_embedding")
    assert summary_value(result.stdout, "training").endswith("global batch 16 in 2 micro-batches of 8 per replica")
    assert_trains_as_one_device(result, one_device)


def test_sharded_data_parallel_on_two_devices_trains_as_one_device(tmp_path, one_device):
    result = run_train(*SMALL_LM, "--strategy=sharded_data_parallel", "--num_devices=2", "--nomeasure_speedup",
                       f"--model_dir={tmp_path}", timeout=TRAIN_TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary_value(result.stdout, "strategy") == (  # --shard=weights by default
        "ShardedDataParallelStrategy (sharded_data_parallel), shard weights: weights and optimizer state (ZeRO-3) "
        "split over mesh axis 'batch', mesh batch:2, 1 replica (one global program)"
    )
    assert summary_value(result.stdout, "devices").count("CPU") == 2
    assert summary_value(result.stdout, "training") == (
        "1 epoch(s) x 12 steps, global batch 16 split 2 ways over mesh axis 'batch'"
    )
    assert_trains_as_one_device(result, one_device)
    assert summary_value(result.stdout, "checkpoint") == str(tmp_path / "checkpoints" / "ckpt-000000012.npz")
    saved = keras.saving.load_model(tmp_path / "model.keras")  # whole tensors: loads on one device
    assert tuple(saved(np.zeros((1, SEQ_LEN), np.int32)).shape) == (1, SEQ_LEN, 256)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--strategy=bogus"], r"--strategy=bogus.*auto\|data\|multi_worker\|model_parallel\|pipeline"),
        (["--strategy=model_parallel", "--mesh=batch:2,model:x"],
         r"flag --mesh=batch:2,model:x: 'model:x': the size 'x' of axis 'model' is not a positive integer\. "
         r"Expected axis:size pairs separated by commas, e\.g\. --mesh=batch:2,model:4"),
        (["--strategy=model_parallel", "--mesh=batch2"], r"flag --mesh=batch2: 'batch2' is not an axis:size pair"),
        (["--strategy=data", "--mesh=batch:2,model:4"],
         r"--mesh is used only with --strategy=model_parallel, not --strategy=data"),
        (["--stages=2"], r"--stages is used only with --strategy=pipeline, not --strategy=auto"),
        (["--strategy=model_parallel", "--global_batch_size=15"],
         r"--global_batch_size=15 must be a multiple of the size of the batch axis of --mesh=batch:2,model:4"),
        (["--strategy=model_parallel", "--mesh=batch:2,model:4", "--num_devices=4", "--max_corpus_bytes=20000"],
         r"--mesh=batch:2,model:4 needs 8 devices, but there are 4 \(--num_devices=4 simulated CPU devices\)\. "
         r"Expected a --mesh whose sizes multiply to 4, e\.g\. --mesh=batch:1,model:4, or --num_devices=8"),
        (["--strategy=pipeline", "--stages=3", "--num_devices=2", "--max_corpus_bytes=20000"],
         r"--stages=3 needs at least 3 devices, but there are 2"),
        (["--strategy=sharded_data_parallel", "--shard=zero3"],
         r"flag --shard=zero3: value should be one of <weights\|optimizer>"),
        (["--shard=optimizer"], r"--shard is used only with --strategy=sharded_data_parallel, not --strategy=auto"),
        (["--strategy=sharded_data_parallel", "--num_devices=3", "--max_corpus_bytes=20000"],
         r"--global_batch_size=32 must be a multiple of the 3 devices that --strategy=sharded_data_parallel splits "
         r"each batch over\. Expected a multiple of 3, e\.g\. --global_batch_size=30, or another --num_devices\."),
        # --shard reaches the strategy: the memory check counts what it splits
        (["--strategy=sharded_data_parallel", "--shard=optimizer", "--d_model=1000000", "--max_corpus_bytes=20000"],
         r"training needs at least .* GiB \([0-9,]+ parameters with gradients and optimizer state, --shard=optimizer "
         r"over 4 devices, and the attention of the batch\)"),
        (["--global_batch_size=0"], r"--global_batch_size=0.*not a positive integer"),
        (["--num_heads=3"], r"--num_heads must divide --d_model"),
        (["positional"], r"unexpected positional arguments \['positional'\]"),
    ],
)
def test_bad_flags_fail_naming_the_flag(args, expected):
    result = run_train(*args, timeout=ERROR_TIMEOUT_S, fresh=True)
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1, result.stderr[-2000:]
    assert re.search(expected, result.stderr), result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_a_diverging_loss_stops_training_with_one_line_and_exit_2(tmp_path):
    model_dir = tmp_path / "model_dir"
    result = run_train("--learning_rate=1e30", "--num_devices=1", "--global_batch_size=8", f"--seq_len={SEQ_LEN}",
                       "--d_model=16", "--num_heads=1", "--num_layers=1", "--steps=20", "--max_corpus_bytes=20000",
                       f"--model_dir={model_dir}", timeout=TRAIN_TIMEOUT_S, fresh=True)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    stopped = re.fullmatch(
        r"tfdist-train: error: training stopped at step (\d+): loss is (nan|inf), the model diverged\. "
        r"Lower --learning_rate \(now 1e\+30\)\.",
        lines[0],
    )
    assert stopped and int(stopped.group(1)) < 20, lines[0]
    assert os.listdir(model_dir / "checkpoints") == []  # nothing of the diverged model saved
    assert not (model_dir / "model.keras").exists()


def test_corpus_without_text_fails_naming_the_path(tmp_path):
    empty = tmp_path / "empty_corpus"
    empty.mkdir()
    result = run_train(f"--corpus={empty}", f"--model_dir={tmp_path / 'out'}", timeout=ERROR_TIMEOUT_S)
    assert result.returncode != 0
    assert re.search(rf"--corpus: Corpus path '{re.escape(str(empty))}' holds no text", result.stderr)
    assert "Traceback" not in result.stderr


def test_two_workers_under_the_launcher_train_in_step(tmp_path):
    """tfdist-launch -n 2 -- tfdist-train --strategy=multi_worker; only the chief writes model_dir."""
    model_dir = tmp_path / "model_dir"
    flags = ["--global_batch_size=8", f"--seq_len={SEQ_LEN}", "--d_model=32", "--num_heads=2", "--num_layers=1",
             "--steps=6", "--max_corpus_bytes=20000", f"--model_dir={model_dir}", "--strategy=multi_worker"]
    result = _procs.run(
        [sys.executable, "-m", "tfdist.launch", "-n", "2", "--join_timeout=60", "--",
         sys.executable, "-m", "tfdist.train", *flags],
        timeout=TRAIN_TIMEOUT_S,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    per_worker = {
        i: "\n".join(line[len(f"[worker {i}] "):] for line in result.stdout.splitlines()
                     if line.startswith(f"[worker {i}] "))
        for i in (0, 1)
    }
    for i, out in per_worker.items():
        assert summary_value(out, "strategy").startswith("MultiWorkerStrategy (multi_worker), 2 replica(s)"), out
        assert summary_value(out, "worker").startswith(f"{i} of 2")
    # Synchronous training: both workers end with the same held-out loss.
    assert summary_value(per_worker[0], "held-out loss (trained)") == summary_value(
        per_worker[1], "held-out loss (trained)"
    )
    assert [p.name for p in (model_dir / "checkpoints").iterdir()] == ["ckpt-000000006.npz"]
    assert summary_value(per_worker[0], "checkpoint") == str(model_dir / "checkpoints" / "ckpt-000000006.npz")
    assert sorted(os.listdir(model_dir)) == ["checkpoints", "logs", "model.keras"]
    for label in ("checkpoint", "Keras model"):
        assert summary_value(per_worker[1], label) == "written by the chief"


@pytest.mark.parametrize(
    "tf_config,expected",
    [
        (None, "data"),
        ('{"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "worker", "index": 0}}',
         "multi_worker"),
        ('{"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}', "data"),
    ],
)
def test_auto_strategy_is_multi_worker_inside_a_cluster(monkeypatch, tf_config, expected):
    from absl import flags

    from tfdist import flags as tfdist_flags

    for name in ("TF_CONFIG", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(name, raising=False)
    if tf_config:
        monkeypatch.setenv("TF_CONFIG", tf_config)
    flag_values = flags.FlagValues()
    tfdist_flags.define_flags(flag_values)
    flag_values(["prog"])
    assert tfdist_flags.resolved_strategy_name(flag_values) == expected


def test_the_rules_choices_are_the_layout_presets_and_none():
    from tfdist import flags as tfdist_flags
    from tfdist import layouts

    presets = [name for name in layouts.__all__ if callable(getattr(layouts, name)) and name[0].islower()]
    assert sorted(tfdist_flags.RULES) == sorted([*presets, "none"])
