"""Shared pieces of the tfdist-launch tests: the command line, network modes, process trees, bounded reads."""

import os
import select
import shutil
import subprocess
import sys
import time

import _procs
import pytest

LAUNCH = [sys.executable, "-m", "tfdist.launch"]


def _user_namespaces_work() -> bool:
    """Checked with util-linux, independently of tfdist: can this user create a user + network namespace?"""
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--user", "--net", "true"], capture_output=True, timeout=30).returncode == 0


USER_NAMESPACES = _user_namespaces_work()
needs_user_namespaces = pytest.mark.skipif(
    not USER_NAMESPACES, reason="this OS does not let this user create user + network namespaces (unshare -Un true)"
)
# Every launcher behaviour is checked on the machine's network and in the job's private one.
NETWORKS = ["host", pytest.param("private", marks=needs_user_namespaces)]


def _parent(pid: int) -> int | None:
    """The parent of a live (not zombie) process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if state in ("Z", "X") else int(ppid)


def alive(pid: int) -> bool:
    return _parent(pid) is not None


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _parent(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def wait_gone(pids, timeout: float) -> tuple[set[int], float]:
    """Waits up to `timeout` s for `pids` to end; returns those still alive and the seconds waited."""
    start = time.monotonic()
    left = {p for p in pids if alive(p)}
    while left and time.monotonic() - start < timeout:
        time.sleep(0.05)
        left = {p for p in left if alive(p)}
    return left, time.monotonic() - start


def kill(pids) -> None:
    """Test cleanup: SIGKILL each process that is still alive, by PID."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, 9)


def start(args, *, python: str = sys.executable, **popen):
    """Starts `python -m tfdist.launch ARGS` in a session of its own, output on a pipe."""
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.STDOUT)
    popen.setdefault("env", _procs.clean_env())
    popen.setdefault("cwd", _procs.REPO)
    return subprocess.Popen([python, "-m", "tfdist.launch", *args], start_new_session=True, **popen)


class Lines:
    """Reads a process's output pipe line by line, each wait bounded."""

    def __init__(self, pipe):
        self._pipe, self._buffer, self.lines = pipe, b"", []

    def until(self, done, timeout: float = 60.0) -> list[str]:
        """Reads until `done(lines)` holds; fails after `timeout` s or at end of output."""
        deadline = time.monotonic() + timeout
        while not done(self.lines):
            left = deadline - time.monotonic()
            assert left > 0 and select.select([self._pipe], [], [], left)[0], f"timed out: {self.lines}"
            chunk = os.read(self._pipe.fileno(), 65536)
            assert chunk, f"output ended: {self.lines}"
            *complete, self._buffer = (self._buffer + chunk).split(b"\n")
            self.lines += [line.decode(errors="replace") for line in complete]
        return self.lines
