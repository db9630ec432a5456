"""Child processes for the tests: the repository root, one clean environment, hard timeouts, kills by PID.

Every test that starts a process builds its environment with `clean_env`: this process's
environment without cluster descriptions or tfdist settings, the repository and tests/_support (these
helpers, so that a scenario script or a test module run as a script can `import _procs`) on PYTHONPATH.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import _forkserver

from tfdist import cluster as cluster_lib
from tfdist import launch

SUPPORT = os.path.dirname(os.path.abspath(__file__))  # tests/_support
REPO = os.path.dirname(os.path.dirname(SUPPORT))
WORKER = os.path.join(REPO, "tests", "scenarios", "multi_worker_fit.py")
# Not inherited: a cluster (TF_CONFIG, Slurm), tfdist-launch's settings, and the DTensor option that
# `import tfdist` sets in this process (a child starts without it, as a user's process does).
NOT_INHERITED = ("TF_CONFIG", "SLURM_", "TFDIST_", "DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION")
TESTS = os.path.join(REPO, "tests") + os.sep
FORK_SERVER = True  # scenario scripts forked from a process that imported TensorFlow (`_forkserver`)


def forkable(cmd) -> bool:
    """Whether `cmd` is `python SCRIPT ...` for a script of tests/ (a scenario, or a test module run as a script).

    Those start from a fork server (`_forkserver`): the same script, environment and process, without paying
    for TensorFlow's import again (`run(..., fork=True)` forks a `python -m MODULE` as well). Everything else
    (`-c` snippets, other `-m tfdist.train` runs, the launcher, the examples, the notebooks) starts as a user
    starts it.
    """
    return (FORK_SERVER and len(cmd) > 1 and cmd[0] == sys.executable and cmd[1].endswith(".py")
            and os.path.abspath(cmd[1]).startswith(TESTS))


def popen(cmd, *, env: dict, stdout, new_session: bool, slot: int = 0):
    """Starts `cmd` from the repository root with output (stderr too) to `stdout`: forked when `forkable`."""
    if forkable(cmd):
        return _forkserver.popen(cmd, env=env, cwd=REPO, stdout=stdout, new_session=new_session, slot=slot)
    return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT, cwd=REPO,
                            start_new_session=new_session)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a child process: this one's less `NOT_INHERITED`, then `extra`.

    PYTHONPATH is the repository and `SUPPORT` (these helpers: a scenario script imports them as a test does).
    TensorFlow's C++ info and warning logs are off (TF_CPP_MIN_LOG_LEVEL=2) and Python's output
    is unbuffered, unless `extra` says otherwise.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(NOT_INHERITED)}
    env.update(PYTHONPATH=os.pathsep.join((REPO, SUPPORT)), TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run(args, *, timeout: float, env: dict | None = None, fork: bool = False, **popen) -> subprocess.CompletedProcess:
    """Runs `args` to the end in `clean_env(**env)` from the repository root, output captured as text.

    `fork=True`, for `python -m MODULE ...` (a tfdist binary) whose start-up is not what the test checks:
    forked from a fork server (`_forkserver`), as scenarios are, instead of importing TensorFlow again.

    Raises:
        subprocess.TimeoutExpired: after `timeout` seconds (the process is killed).
    """
    if fork and FORK_SERVER:
        assert args[:2] == [sys.executable, "-m"] and not popen, (args, popen)
        return _run_forked(args, timeout=timeout, env=clean_env(**(env or {})))
    popen.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env=clean_env(**(env or {})), cwd=REPO, **popen
    )


def wait_or_kill(proc, timeout: float) -> int:
    """`proc`'s exit status once it ends; killed (and reaped) if it is still running after `timeout` s.

    Raises:
        subprocess.TimeoutExpired: when it was killed.
    """
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _run_forked(args, *, timeout: float, env: dict) -> subprocess.CompletedProcess:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        code = wait_or_kill(_forkserver.popen(args, env=env, cwd=REPO, stdout=out, stderr=err), timeout)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(args, code, out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


def run_python(code: str, *, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs `code` (dedented) in a fresh Python process; see `run`."""
    return run([sys.executable, "-c", textwrap.dedent(code)], timeout=timeout, env=env)


def run_child(script: str, out, *args: str, timeout: float) -> dict:
    """Runs `python script out ARGS` (its output to `out/log.txt`), killed after `timeout` s; its `out/result.json`.

    Raises:
        AssertionError: with the log's tail, when the child exits non-zero.
    """
    with open(os.path.join(out, "log.txt"), "w") as log:
        proc = popen([sys.executable, script, str(out), *args], env=clean_env(TF_CPP_MIN_LOG_LEVEL="3"), stdout=log,
                      new_session=False)
        code = wait_or_kill(proc, timeout)
    with open(os.path.join(out, "log.txt")) as log:
        assert code == 0, log.read()[-8000:]
    with open(os.path.join(out, "result.json")) as result:
        return json.load(result)


class Procs:
    """Started processes (each in its own session), their logs, and their start (monotonic) and exit times."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.procs, self.logs, self.started, self.ended = [], [], [], []

    def start(self, cmd, env) -> int:
        i = len(self.procs)
        log = self.tmp_path / f"proc{i}.log"
        with open(log, "wb") as f:  # slot i: the workers of one job fork from different servers (hash seeds)
            self.procs.append(popen(cmd, env=env, stdout=f, new_session=True, slot=i))
        self.logs.append(log)
        self.started.append(time.monotonic())
        self.ended.append(None)
        return i

    def start_worker(self, workers, index, out, mode, *runs: str, **opts) -> int:
        """Worker `index` of `workers` running `WORKER OUT MODE [RUN ...] [key=value ...]`."""
        tf_config = cluster_lib.Cluster(workers=workers, task_index=index).to_tf_config()
        args = [*runs, *(f"{k}={v}" for k, v in opts.items())]
        return self.start([sys.executable, WORKER, str(out), mode, *args], clean_env(TF_CONFIG=tf_config))

    def wait(self, indices=None, timeout=120.0):
        """Waits for the given processes (all by default); returns their return codes (None: still running)."""
        indices = range(len(self.procs)) if indices is None else indices
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, p in enumerate(self.procs):
                if self.ended[i] is None and p.poll() is not None:
                    self.ended[i] = time.time()
            if all(self.ended[i] is not None for i in indices):
                break
            time.sleep(0.1)
        return [self.procs[i].poll() for i in indices]

    def log(self, i) -> str:
        return self.logs[i].read_text(errors="replace")

    def kill(self, i):
        """SIGKILLs process `i`'s session if it is still running, and reaps it."""
        p = self.procs[i]
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        p.wait()

    def kill_all(self):
        for i in range(len(self.procs)):
            self.kill(i)


def workers(n):
    return tuple(f"127.0.0.1:{p}" for p in launch.free_ports(n))


class Queue:
    """Commands run as child processes `parallel` at a time, in the order added, each killed `timeout` s after start.

    `result(key)` runs the queue until `key`'s process has ended: a test waits only for what it checks, while
    the next commands already run. Every process still running is killed by `kill_all` (test teardown).
    """

    def __init__(self, tmp_path, *, parallel: int = 2, timeout: float = 300):
        self.procs, self.parallel, self.timeout = Procs(tmp_path), parallel, timeout
        self.todo, self.running, self.ended = [], {}, {}

    def add(self, key, cmd, env: dict, after=None) -> None:
        """Queues `cmd`; with `after`, it starts only once the process of that (earlier added) key has ended."""
        assert after is None or after in {k for k, *_ in self.todo} | set(self.running) | set(self.ended), after
        self.todo.append((key, cmd, env, after))

    def _poll(self) -> None:
        for key, i in list(self.running.items()):
            running = self.procs.procs[i].poll() is None
            if running and time.monotonic() - self.procs.started[i] < self.timeout:
                continue
            self.procs.kill(i)  # reaps a process that ended by itself
            del self.running[key]
            self.ended[key] = (None if running else self.procs.procs[i].returncode, i)
        for item in list(self.todo):
            key, cmd, env, after = item
            if len(self.running) >= self.parallel:
                break
            if after is None or after in self.ended:
                self.todo.remove(item)
                self.running[key] = self.procs.start(cmd, env)

    def result(self, key) -> tuple[int | None, str]:
        """Waits for `key`'s process: its exit status (None: killed after `timeout` s) and its output."""
        while key not in self.ended:
            self._poll()
            time.sleep(0.1)
        code, i = self.ended[key]
        return code, self.procs.log(i)

    def kill_all(self) -> None:
        self.procs.kill_all()
