"""tfdist-launch never leaves processes behind: SIGKILL of the launcher, a closed terminal, a finished job."""

import fcntl
import os
import pty
import signal
import subprocess
import sys
import termios
import time

import pytest
from _launchers import NETWORKS
from _launchers import alive
from _launchers import descendants
from _launchers import kill
from _launchers import start
from _launchers import wait_gone

pytestmark = pytest.mark.serial  # waits on processes ending within bounds

# A worker that leaves its PID in the directory argv[1], then sleeps (or exits after argv[2] seconds).
SLEEPER = r"""
import os, sys, time
open(os.path.join(sys.argv[1], f"pid-{os.getpid()}"), "w").close()
time.sleep(float(sys.argv[2]))
"""


def commands(kind, directory, seconds=300):
    """(CMD, PID files per worker): python itself, or a shell script that starts python."""
    python = [sys.executable, "-c", SLEEPER, str(directory), str(seconds)]
    if kind == "python":
        return python, 1
    script = 'touch "$0/pid-$$"; "$@" & wait'
    return ["sh", "-c", script, str(directory), *python], 2


def wait_for_pid_files(proc, directory, count, timeout=60):
    deadline = time.monotonic() + timeout
    while len(os.listdir(directory)) < count:
        assert proc.poll() is None and time.monotonic() < deadline, (proc.poll(), os.listdir(directory))
        time.sleep(0.05)
    return {int(name.split("-")[1]) for name in os.listdir(directory)}


@pytest.mark.parametrize("kind", ["python", "sh"])
@pytest.mark.parametrize("network", NETWORKS)
def test_sigkill_of_the_launcher_ends_every_worker_and_their_children(tmp_path, network, kind):
    command, per_worker = commands(kind, tmp_path)
    proc = start(["-n", "2", "--grace", "3", f"--network={network}", "--", *command], stdout=subprocess.DEVNULL)
    tree = set()
    try:
        workers = wait_for_pid_files(proc, tmp_path, 2 * per_worker)
        tree = descendants(proc.pid)
        assert workers <= tree and len(tree) == len(workers) + 1, (workers, tree)  # + the reaper
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        left, seconds = wait_gone(tree, timeout=15)
        assert not left, f"still alive 15 s after SIGKILL of the launcher: {left} of {tree}"
        print(f"{network}/{kind}: {len(tree)} processes gone {seconds:.2f} s after SIGKILL of the launcher")
    finally:
        kill([proc.pid, *tree])
        proc.wait()


@pytest.mark.parametrize("network", NETWORKS)
def test_closing_the_terminal_stops_the_job(tmp_path, network):
    """The launcher's controlling terminal goes away: SIGHUP, forwarded, exit 129, nothing left."""
    command, _ = commands("python", tmp_path)
    controller, terminal = pty.openpty()
    proc = start(
        ["-n", "2", "--grace", "3", f"--network={network}", "--", *command],
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
    )
    os.close(terminal)
    tree = set()
    try:
        wait_for_pid_files(proc, tmp_path, 2)
        tree = descendants(proc.pid)
        os.close(controller)
        assert proc.wait(timeout=30) == 128 + signal.SIGHUP
        left, _ = wait_gone(tree, timeout=5)
        assert not left, (left, tree)
    finally:
        kill([proc.pid, *tree])
        proc.wait()


@pytest.mark.parametrize("network", NETWORKS)
def test_a_finished_job_leaves_no_process(tmp_path, network):
    command, _ = commands("python", tmp_path, seconds=1)
    proc = start(["-n", "2", f"--network={network}", "--", *command])
    tree = set()
    try:
        wait_for_pid_files(proc, tmp_path, 2)
        tree = descendants(proc.pid)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output
        assert len(tree) == 3 and not [p for p in tree if alive(p)], tree  # 2 workers + the reaper
    finally:
        kill([proc.pid, *tree])
        proc.wait()
