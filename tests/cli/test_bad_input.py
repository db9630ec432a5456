"""Malformed input to tfdist-train and tfdist-advise, run as a user runs them: one line, exit status 2.

Each case runs the binary in a subprocess and checks that it ends within `ERROR_TIMEOUT_S` with exit
status 2, prints nothing on stdout and exactly one line on stderr, `<binary>: error: ...`, that names
the flag, path or environment variable (and no traceback). Most cases fail while parsing flags or
reading the corpus, before TensorFlow loads (well under a second each); the rest need TensorFlow
(the devices, the cluster) and take a few seconds.
"""

import math
import os
import re
import sys
import time

import _procs
import pytest

from tfdist import _validate

ERROR_TIMEOUT_S = 60
PROGRAMS = {"tfdist-train": "tfdist.train", "tfdist-advise": "tfdist.advisor"}
CORES = os.cpu_count()
# A small corpus for the cases that get past reading it.
SMALL = "--corpus={text}"

TRAIN = [
    # Flags, refused while parsing them.
    (["--strategy=bogus"], None,
     r"flag --strategy=bogus: value should be one of "
     r"<auto\|data\|multi_worker\|model_parallel\|pipeline\|sharded_data_parallel>"),
    (["--num_devices=100000"], None, r"flag --num_devices=100000: 100000 is not an integer in the range \[1, 64\]"),
    (["--num_devices=0"], None, r"flag --num_devices=0: 0 is not an integer in the range \[1, 64\]"),
    (["--seed=-1"], None, r"flag --seed=-1: -1 is not an integer in the range \[0, 4294967295\]"),
    ([f"--seed={2**40}"], None, rf"flag --seed={2**40}: {2**40} is not an integer in the range \[0, 4294967295\]"),
    (["--seed=abc"], None, r"flag --seed=abc: invalid literal for int\(\)"),
    (["--learning_rate=nan"], None, r"flag --learning_rate=nan: expected a finite number >= 0"),
    (["--learning_rate=inf"], None, r"flag --learning_rate=inf: expected a finite number >= 0"),
    (["--learning_rate=-1"], None, r"flag --learning_rate=-1: -1\.0 is not a non-negative number"),
    (["--global_batch_size=0"], None, r"flag --global_batch_size=0: 0 is not a positive integer"),
    (["--global_batch_size="], None, r"flag --global_batch_size=: invalid literal for int\(\)"),
    (["--epochs=-3"], None, r"flag --epochs=-3: -3 is not a positive integer"),
    (["--steps=-1"], None, r"flag --steps=-1: -1 is not a non-negative integer"),
    (["--steps=1.5"], None, r"flag --steps=1\.5: invalid literal for int\(\)"),
    (["--seq_len=0"], None, r"flag --seq_len=0: 0 is not a positive integer"),
    (["--num_heads=0"], None, r"flag --num_heads=0: 0 is not a positive integer"),
    (["--num_heads=3"], None, r"flags d_model=128, num_heads=3: --num_heads must divide --d_model"),
    (["--max_corpus_bytes=0"], None, r"flag --max_corpus_bytes=0: 0 is not a positive integer"),
    (["--measure_speedup=maybe"], None, r"flag --measure_speedup=maybe: .*Non-boolean argument to boolean flag"),
    (["--no_such_flag=1"], None, r"Unknown command line flag 'no_such_flag'"),
    (["--flagfile={missing}"], None, r"Unable to open flagfile: .*No such file or directory: '{missing}'"),
    (["--flagfile={fifo}"], None, r"flag --flagfile={fifo}: '{fifo}' is not a regular file"),
    (["--flagfile={empty_dir}"], None, r"Unable to open flagfile: .*Is a directory: '{empty_dir}'"),
    (["positional"], None, r"unexpected positional arguments \['positional'\]"),
    # The corpus, read before TensorFlow loads; a FIFO is never opened.
    (["--corpus={missing}"], None, r"--corpus: Corpus path '{missing}' does not exist"),
    (["--corpus="], None, r"--corpus: Corpus path '' does not exist"),
    (["--corpus={fifo}"], None, r"--corpus: Corpus path '{fifo}' is a FIFO, not a regular file"),
    (["--corpus=/dev/zero"], None, r"--corpus: Corpus path '/dev/zero' is a character device, not a regular file"),
    (["--corpus={fifo_dir}"], None, r"--corpus: Corpus path '{fifo_dir}' holds no text.*skipped: \['{fifo_dir}/pipe"),
    (["--corpus={empty_dir}"], None, r"--corpus: Corpus path '{empty_dir}' holds no text"),
    ([SMALL, "--seq_len=5000"], None, r"--corpus / --seq_len: The corpus \(2200 bytes\) is too small for seq_len=5000"),
    ([SMALL, "--global_batch_size=1000000000"], None,
     r"--global_batch_size=1000000000 is more than the 32 training examples of the corpus \(2,200 bytes, "
     r"--seq_len=64\)\. Expected at most 32"),
    # Sizes that cannot fit in memory, and the cluster: after TensorFlow loads.
    (["--d_model=1000000", "--model_dir={out}"], None,
     r"--d_model=1000000, --num_layers=2, .*training needs at least .* GiB .*more than this machine's"),
    (["--num_layers=1000000", "--model_dir={out}"], None,
     r"--d_model=128, --num_layers=1000000, .*training needs at least"),
    ([SMALL, "--model_dir={text}"], None, r"--model_dir: cannot create '{text}/checkpoints': .*Not a directory"),
    ([SMALL], {"SLURM_JOB_NODELIST": "n[0-999999999]", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"},
     r"SLURM_JOB_NODELIST='n\[0-999999999\]' names 1000000000 node\(s\), more than SLURM_NTASKS=2"),
    ([SMALL], {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS": "²", "SLURM_PROCID": "0"},
     r"Slurm variable SLURM_NTASKS='²' is missing or not an integer from 1 to 1000000"),
    ([SMALL, "--strategy=multi_worker"], {"TFDIST_JOIN_TIMEOUT": "inf"},
     r"TFDIST_JOIN_TIMEOUT='inf' is not a positive number of seconds\. Expected a number in \(0, 1e\+09\]"),
]

ADVISE = [
    (["--threads_per_device=-1"], None, rf"argument --threads_per_device: -1 is not an integer from 0 to {CORES}"),
    (["--threads_per_device=100000"], None, r"argument --threads_per_device: 100000 is not an integer from 0 to"),
    (["--optimizer=bogus"], None, r"argument --optimizer: invalid choice: 'bogus' \(choose from 'adadelta', .*'sgd'\)"),
    (["--num_devices=100000"], None, r"argument --num_devices: 100000 is not an integer from 1 to 64"),
    (["--rounds=1000000000"], None, r"argument --rounds: 1000000000 is not an integer from 1 to 100"),
    (["--device_memory_gib=nan"], None, r"argument --device_memory_gib: nan is not a positive, finite number of GiB"),
    (["--device_memory_gib=inf"], None, r"argument --device_memory_gib: inf is not a positive, finite number of GiB"),
    (["--device_memory_gib=-1"], None, r"argument --device_memory_gib: -1 is not a positive, finite number of GiB"),
    (["--batch_size=0"], None, r"argument --batch_size: 0 is not a positive integer"),
    (["--width=²"], None, r"argument --width: ² is not a positive integer"),
    (["--model=lm", "--width=30"], None, r"argument --width: 30 is not a multiple of 4, the LM's attention heads"),
    (["--model=cnn"], None, r"argument --model: invalid choice: 'cnn' \(choose from 'mlp', 'lm'\)"),
    (["--no_such_flag"], None, r"unrecognized arguments: --no_such_flag"),
    # After TensorFlow loads (the devices are known).
    (["--batch_size=2"], None, r"--batch_size=2 is less than the 4 devices\. Expected >= 4\."),
    (["--width=1000000"], None, r"--model=mlp --width=1000000 .*needs at least .* GiB, more than this machine's"),
]

CASES = [("tfdist-train", *case) for case in TRAIN] + [("tfdist-advise", *case) for case in ADVISE]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """Placeholders of the cases: a text file, a FIFO, a directory holding only a FIFO, ..."""
    root = tmp_path_factory.mktemp("bad_input")
    for name in ("empty_dir", "fifo_dir"):
        (root / name).mkdir()
    os.mkfifo(root / "fifo")
    os.mkfifo(root / "fifo_dir" / "pipe")
    (root / "text.txt").write_text("a line of text\n" * 146 + "abcdefghij")  # 2200 bytes: 32 training windows
    return {
        "text": str(root / "text.txt"),
        "fifo": str(root / "fifo"),
        "fifo_dir": str(root / "fifo_dir"),
        "empty_dir": str(root / "empty_dir"),
        "missing": str(root / "missing"),
        "out": str(root / "model_dir"),
    }


def _case_id(case):
    prog, args, env, _ = case
    return f"{prog}:{' '.join(args)}" + (f":{','.join(f'{k}={v}' for k, v in env.items())}" if env else "")


@pytest.mark.parametrize("prog, args, env, expected", CASES, ids=[_case_id(c) for c in CASES])
def test_bad_input_ends_with_one_line_naming_it_and_exit_2(paths, prog, args, env, expected):
    for name, path in paths.items():  # fill in the placeholders, quoted in the regular expression
        args = [a.replace(f"{{{name}}}", path) for a in args]
        expected = expected.replace(f"{{{name}}}", re.escape(path))
    start = time.monotonic()
    result = _procs.run([sys.executable, "-m", PROGRAMS[prog], *args], timeout=ERROR_TIMEOUT_S, env=env)
    elapsed = time.monotonic() - start
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"{prog}: error: ")
    assert re.search(expected, lines[0]), lines[0]
    assert elapsed < ERROR_TIMEOUT_S


@pytest.mark.parametrize(
    "value, message",
    [
        (math.nan, r"Received: timeout=nan\. Expected a positive, finite number of seconds, at most 1e\+09, or None"),
        (math.inf, r"Received: timeout=inf\."),
        (-math.inf, r"Received: timeout=-inf\."),
        (1e10, r"Received: timeout=10000000000\.0\."),
        (10**400, r"Received: timeout=1000"),  # too large for a float
        (0, r"Received: timeout=0\."),
    ],
)
def test_durations_are_finite_and_fit_in_milliseconds(value, message):
    with pytest.raises(ValueError, match=message):
        _validate.positive_number("timeout", value, allow_none=True, unit="seconds")


def test_numbers_are_finite():
    assert _validate.positive_number("scale", 1e300) == 1e300
    assert _validate.positive_number("timeout", 1e9, unit="seconds") == 1e9
    assert _validate.positive_number("timeout", None, allow_none=True, unit="seconds") is None
    for value in (math.nan, math.inf, 10**400):
        with pytest.raises(ValueError, match=r"Expected a positive, finite number\.$"):
            _validate.positive_number("scale", value)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"timeout": math.nan}, r"`timeout`\. Received: timeout=nan\. .*at most 1e\+09, or None"),
        ({"heartbeat_timeout": math.inf}, r"`heartbeat_timeout`\. Received: heartbeat_timeout=inf\. .*1e\+09\."),
        ({"join_timeout": 1e12}, r"`join_timeout`\. Received: join_timeout=1000000000000\.0\."),
    ],
)
def test_multi_worker_timeouts_reject_nan_and_infinity(kwargs, message):
    import tfdist

    with pytest.raises(ValueError, match=message):
        tfdist.MultiWorkerStrategy(**kwargs)  # refused before anything of TensorFlow's starts


@pytest.mark.parametrize(
    "sizes, num_heads",
    [
        ({"seq_len": 12, "d_model": 32, "num_layers": 2}, 4),
        ({"seq_len": 7, "d_model": 24, "num_layers": 1, "vocab_size": 50, "mlp_dim": 40}, 3),
    ],
)
def test_the_memory_check_counts_the_model_parameters_exactly(sizes, num_heads):
    from tfdist import models

    built = models.transformer_lm(num_heads=num_heads, **sizes)
    assert models.transformer_lm_parameters(**sizes) == built.count_params()
