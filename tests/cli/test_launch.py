"""tfdist-launch: real worker processes on 127.0.0.1, exit codes, prefixes, signals, join timeout."""

import os
import re
import signal
import subprocess
import sys
import time

import _procs
import numpy as np
import pytest
from _launchers import LAUNCH
from _launchers import NETWORKS

from tfdist import launch

# A worker that reports its TF_CONFIG, then behaves as its argv says; "ready" once its signal handlers are set.
WORKER = r"""
import json, os, signal, sys, time
task = json.loads(os.environ["TF_CONFIG"])
i = task["task"]["index"]
print("pid", os.getpid(), "index", i, "workers", ",".join(task["cluster"]["worker"]),
      "join", os.environ["TFDIST_JOIN_TIMEOUT"], flush=True)
sys.stderr.write("to stderr\n")
mode = sys.argv[1]
if mode == "fail" and i == 1:
    time.sleep(1)
    sys.exit(5)
if mode == "trap":
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, f: (print("got signal", s, flush=True), sys.exit(0)))
if mode == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode != "ok":
    print("ready", flush=True)
    time.sleep(300)
"""


def launch_cmd(*args, mode="ok"):
    return [*LAUNCH, *args, "--", sys.executable, "-c", WORKER, mode]


def run(cmd, timeout=120):
    return _procs.run(cmd, timeout=timeout)


def worker_lines(output, i):
    return [line[len(f"[worker {i}] ") :] for line in output.splitlines() if line.startswith(f"[worker {i}] ")]


def pids(output, n):
    return [int(re.search(r"pid (\d+)", worker_lines(output, i)[0]).group(1)) for i in range(n)]


def assert_gone(pid_list):
    for pid in pid_list:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_workers_get_their_tf_config_and_prefixed_output():
    result = run(launch_cmd("-n", "3", "--join_timeout", "30"))
    assert result.returncode == 0, result.stdout + result.stderr
    addresses = None
    for i in range(3):
        lines = worker_lines(result.stdout, i)
        assert f"index {i} " in lines[0] and "join 30.0" in lines[0], lines
        assert "to stderr" in lines
        workers = lines[0].split("workers ")[1].split()[0].split(",")
        addresses = addresses or workers
        assert workers == addresses
    assert len(set(addresses)) == 3 and all(a.startswith("127.0.0.1:") for a in addresses)
    assert "[tfdist-launch] all workers finished" in result.stdout


@pytest.mark.serial  # bounds how long the launcher takes to end the job
def test_a_failed_worker_stops_the_others_and_sets_the_exit_status():
    start = time.monotonic()
    result = run(launch_cmd("-n", "3", "--grace", "5", mode="fail"))
    assert result.returncode == 5, result.stdout + result.stderr
    assert time.monotonic() - start < 60
    assert "worker 1 failed with exit status 5; stopping workers [0, 2]" in result.stdout
    assert_gone(pids(result.stdout, 3))


def _start_and_signal(mode, sig, grace="30", network="auto"):
    proc = subprocess.Popen(
        launch_cmd("-n", "2", "--grace", grace, f"--network={network}", mode=mode),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_procs.clean_env(),
        start_new_session=True,
    )
    try:
        lines = []
        # Signalled only once both workers have set their handlers: a signal between a worker's start and
        # its signal.signal call would end it by the default action, never reaching its handler.
        while sum(line.startswith("[worker ") and line.endswith("] ready\n") for line in lines) < 2:
            line = proc.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
        start = time.monotonic()
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=60)
        return proc.returncode, "".join(lines) + rest, time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("network", NETWORKS)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signals_are_forwarded_to_every_worker(sig, network):
    code, output, _ = _start_and_signal("trap", sig, network=network)
    assert code == 128 + sig, output
    for i in range(2):
        assert f"got signal {int(sig)}" in worker_lines(output, i), output
    assert_gone(pids(output, 2))


@pytest.mark.serial  # times the grace period
def test_a_worker_ignoring_sigterm_is_killed_after_the_grace_period():
    code, output, seconds = _start_and_signal("ignore", signal.SIGTERM, grace="2")
    assert code == 128 + signal.SIGTERM, output
    assert "still running 2s after signal 15; killing them" in output
    assert 2 <= seconds < 30
    assert_gone(pids(output, 2))


@pytest.mark.serial  # a join timeout, bounded
def test_workers_that_never_join_are_bounded():
    start = time.monotonic()
    result = run(launch_cmd("-n", "2", "--join_timeout", "3", "--grace", "2", mode="sleep"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert time.monotonic() - start < 30
    assert re.search(
        r"worker 0 \(127\.0\.0\.1:\d+\), worker 1 \(127\.0\.0\.1:\d+\) did not start its TensorFlow server "
        r"within --join_timeout=3s; stopping all workers",
        result.stdout,
    ), result.stdout
    assert_gone(pids(result.stdout, 2))


HERE = os.path.dirname(os.path.abspath(__file__))  # a directory
NOT_EXECUTABLE = os.path.join(os.path.dirname(HERE), "_support", "_procs.py")  # a file without the executable bit
SECONDS = "Expected a positive, finite number of seconds"


@pytest.mark.parametrize(
    "args, message",
    [
        (["-n", "2"], "no command given"),
        (["--", "true"], "the following arguments are required: -n/--num_workers"),
        (["-n", "two", "--", "true"], "argument -n/--num_workers: invalid int value: 'two'"),
        (["-n", "0", "--", "true"], "num_workers=0. Expected an integer from 1 to 256"),
        (["-n", "100000", "--", "true"], "num_workers=100000. Expected an integer from 1 to 256"),
        (["-n", "2", "--join_timeout", "0", "--", "true"], "join_timeout=0.0. " + SECONDS),
        (["-n", "2", "--join_timeout=inf", "--", "true"], "join_timeout=inf. " + SECONDS),
        (["-n", "2", "--join_timeout=nan", "--", "true"], "join_timeout=nan. " + SECONDS),
        (["-n", "2", "--grace=nan", "--", "true"], "grace=nan. " + SECONDS),
        (["-n", "2", "--grace=inf", "--", "true"], "grace=inf. " + SECONDS),
        (["-n", "2", "--network=open", "--", "true"], "argument --network: invalid choice: 'open' (choose from"),
        (["-n", "2", "--", HERE], f"command=[{HERE!r}]; {HERE!r} is a directory. Expected its first item to be"),
        (["-n", "2", "--", NOT_EXECUTABLE], f"{NOT_EXECUTABLE!r} is not executable (chmod +x it"),
        (["-n", "2", "--", "tfdist-no-such-program"], "'tfdist-no-such-program' is not a program on PATH"),
        (["-n", "2", "--", "/nonexistent/tfdist-x"], "'/nonexistent/tfdist-x' does not exist"),
    ],
)
def test_bad_input_ends_with_one_line_and_exit_status_2(args, message):
    result = run([*LAUNCH, *args], timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""  # no worker started
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("tfdist-launch: error: ") and message in result.stderr, result.stderr


def test_a_command_that_cannot_be_executed_ends_the_job_with_status_126(tmp_path):
    script = tmp_path / "train"
    script.write_text("echo no interpreter line\n")
    script.chmod(0o755)
    result = run([*LAUNCH, "-n", "2", "--", str(script)], timeout=60)
    assert result.returncode == 126, result.stdout + result.stderr
    assert f"[tfdist-launch] cannot start worker 0: Exec format error: {str(script)!r}" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"command": "python x.py", "num_workers": 1}, r"command='python x.py'"),
        ({"command": [HERE], "num_workers": 1}, r"is a directory"),
        ({"command": [NOT_EXECUTABLE], "num_workers": 1}, r"is not executable"),
        ({"command": ["tfdist-no-such-program"], "num_workers": 1}, r"is not a program on PATH"),
        ({"command": ["true"], "num_workers": 0}, r"num_workers=0"),
        ({"command": ["true"], "num_workers": 257}, r"num_workers=257\. Expected an integer from 1 to 256"),
        ({"command": ["true"], "num_workers": 1, "grace": -1}, r"grace=-1"),
        ({"command": ["true"], "num_workers": 1, "grace": float("nan")}, r"grace=nan"),
        ({"command": ["true"], "num_workers": 1, "join_timeout": float("inf")}, r"join_timeout=inf"),
    ],
)
def test_launcher_validates_arguments(kwargs, match):
    with pytest.raises(ValueError, match=r"Invalid value for argument `\w+`\. .*" + match):
        launch.Launcher(**kwargs)


def test_free_ports_are_distinct_loopback_ports():
    ports = launch.free_ports(8)
    assert len(set(ports)) == 8 and all(0 < p < 65536 for p in ports)


@pytest.mark.parametrize(
    "num_workers,num_examples",
    [(2, 200), (3, 193)],  # 193: the last global batch holds 1 example, so two workers get none
)
def test_tutorial_example_under_the_launcher_matches_one_process(tmp_path, num_workers, num_examples):
    """examples/multi_worker_cnn.py (CNN, SGD, tf.data global batch, BackupAndRestore) on several workers."""
    script = os.path.join(_procs.REPO, "examples", "multi_worker_cnn.py")
    example = [sys.executable, "-W", "ignore::UserWarning", script, f"--num_examples={num_examples}"]
    single = run([*example, f"--out={tmp_path / 'one'}"], timeout=180)
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    launch = [*LAUNCH, "-n", str(num_workers), "--join_timeout", "60", "--"]
    result = run([*launch, *example, f"--out={tmp_path / 'many'}"], timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for i in range(num_workers):
        assert f"[worker {i}] worker {i} done" in result.stdout
    reference = np.load(tmp_path / "one" / "weights-0.npz")
    weights = [np.load(tmp_path / "many" / f"weights-{i}.npz") for i in range(num_workers)]
    for k in reference.files:
        for w in weights[1:]:
            np.testing.assert_array_equal(w[k], weights[0][k])
        np.testing.assert_allclose(weights[0][k], reference[k], rtol=0, atol=1e-6)
