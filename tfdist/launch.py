"""`tfdist-launch`: start N local workers of a multi-worker job on 127.0.0.1.

    tfdist-launch -n 2 -- python train.py --epochs=3
    tfdist-launch -n 2 -- tfdist-train --strategy=multi_worker

Each worker gets its own `TF_CONFIG` (free loopback ports, worker i is task i),
`TFDIST_JOIN_TIMEOUT`, which `tfdist.MultiWorkerStrategy` uses as its
default `join_timeout`, and `TFDIST_RUN_DIR`, the job's run directory where
each worker's flight recorder keeps its status (`tfdist.flight`; `--run_dir`
keeps it after the job). Every output line is prefixed with `[worker i]`.
Ctrl-C / SIGTERM / SIGHUP are forwarded to every worker's process group. When a
worker fails, the others print their flight-recorder summary and are stopped
(SIGTERM, then SIGKILL after `--grace` seconds); the launcher then prints a
one-screen report (which worker failed first, how, its last lines of output,
every worker's state and last reported step) and exits with the failed
worker's status. When a worker
has not started its TensorFlow server within `--join_timeout` seconds, the job
is stopped too. Workers never outlive the launcher, even one killed with
SIGKILL: each dies with it (Linux's parent-death signal) and a small reaper
process ends what is left of their process groups.

TensorFlow's gRPC server listens on every interface, unauthenticated. With
`--network=private` (the default `auto` when the OS allows it) the launcher
first moves itself into a new user and network namespace, so the workers share
a loopback device that nothing outside the job can reach. See the README for
real clusters.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import dataclasses
import fcntl
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import NoReturn

from tfdist import _validate
from tfdist import cluster as cluster_lib
from tfdist import flight

HOST = "127.0.0.1"
MAX_WORKERS = 256
"""Most workers one launcher starts: each is a process with its own port and pipe on this machine."""
_POLL = 0.1
LAST_LINES = 8
"""Lines of the first failed worker's output the failure report repeats."""
REPORT_WAIT = 3.0
"""Seconds the launcher gives the surviving workers to print their flight-recorder summary before stopping them."""
_LINE = 160
_REPORT_ROWS = 16

_LIBC = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1

# Started by the launcher in a session of its own; reads one worker process group per line. "done" means
# the launcher finished its job; end of input without it means the launcher died: the reaper signals every
# group (SIGTERM, SIGKILL after the grace period given as argv[1]) and exits.
_REAPER = """
import os, signal, sys, time
groups = []
for line in sys.stdin.buffer:
    if line == b"done\\n":
        sys.exit(0)
    groups.append(int(line))
def signal_all(sig):
    alive = []
    for group in groups:
        try:
            os.killpg(group, sig)
            alive.append(group)
        except (ProcessLookupError, PermissionError):
            pass
    return alive
groups = signal_all(signal.SIGTERM)
deadline = time.monotonic() + float(sys.argv[1])
while groups and time.monotonic() < deadline:
    time.sleep(0.1)
    groups = signal_all(0)
signal_all(signal.SIGKILL)
"""


def free_ports(n: int) -> list[int]:
    """Returns `n` distinct free TCP ports on 127.0.0.1 (all held open until all are chosen)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _listening(port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) == 0


def _exit_status(returncode: int) -> int:
    """Shell-style status: 128 + signal for a process killed by a signal."""
    return 128 - returncode if returncode < 0 else returncode


def _check_command(command) -> list[str]:
    """Returns `command` as a list if its program is an executable file (a path, or a name on PATH)."""
    if isinstance(command, str) or not command or not all(isinstance(a, str) for a in command):
        raise _validate.invalid("command", command, "a non-empty list of strings such as ['python', 'train.py']")
    program = command[0]
    path = program if os.sep in program else shutil.which(program)
    if path is None:
        problem = f"{program!r} is not a program on PATH"
        if os.path.exists(program):
            problem += f" (for the file in this directory write {os.path.join(os.curdir, program)!r})"
    elif not os.path.exists(path):
        problem = f"{program!r} does not exist"
    elif os.path.isdir(path):
        problem = f"{program!r} is a directory"
    elif not os.access(path, os.X_OK):
        problem = f"{program!r} is not executable (chmod +x it, or run it with its interpreter)"
    else:
        return list(command)
    expected = "its first item to be an executable file or a program on PATH"
    raise _validate.invalid("command", list(command), expected, problem=problem)


def _die_with(launcher_pid: int):
    """A `preexec_fn`: the worker gets SIGKILL when the launcher (the thread that starts it) exits."""

    prctl = _LIBC.prctl  # looked up before the fork

    def preexec():
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != launcher_pid:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


class _Output:
    """Copies worker output line by line, each line prefixed with its worker.

    Output is dropped once the stream is gone (a closed terminal or pipe); the job goes on.
    """

    def __init__(self, stream):
        self._stream = stream
        self._lock = threading.Lock()

    def write(self, line: bytes) -> None:
        with self._lock, contextlib.suppress(OSError):
            self._stream.write(line)
            self._stream.flush()

    def pump(self, prefix: bytes, pipe, tail: collections.deque) -> threading.Thread:
        """Copies `pipe` to the stream in a thread; `tail` keeps its last lines (bytes, without the newline)."""

        def run():
            for line in iter(pipe.readline, b""):
                line = line.rstrip(b"\n")
                tail.append(line)
                self.write(prefix + line + b"\n")
            pipe.close()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def describe_exit(returncode: int) -> str:
    """A process' end in words, its signal by name.

    Example:

    >>> describe_exit(-9), describe_exit(1), describe_exit(0), describe_exit(137)
    ('killed by SIGKILL', 'exited with code 1', 'exited with code 0', 'exited with code 137 (128 + SIGKILL)')
    """
    if returncode < 0:
        return f"killed by {_signal_name(-returncode)}"
    text = f"exited with code {returncode}"
    if returncode > 128 and _signal_name(returncode - 128).startswith("SIG"):
        text += f" (128 + {_signal_name(returncode - 128)})"
    return text


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclasses.dataclass(frozen=True)
class WorkerOutcome:
    """One worker of a failed job, as the launcher's report shows it.

    Attributes:
        index, address, pid: the worker.
        when_failed: its state when the first worker failed: "running",
            "stopped by SIGSTOP", "killed by SIGKILL", "exited with code 1", ...
        ended: how it ended (the same text when nothing changed after that).
        last_report: what its flight recorder last reported (e.g. "train step
            12 (done 0.3 s ago)"), or "" when it wrote no status.
    """

    index: int
    address: str
    pid: int
    when_failed: str
    ended: str
    last_report: str = ""

    @property
    def who(self) -> str:
        return f"worker {self.index} ({self.address})"


def format_report(outcomes: Sequence[WorkerOutcome], first: int, last_lines: Sequence[str], *, note: str = "") -> str:
    """The launcher's one-screen report of a failed job.

    Args:
        outcomes: every worker, by index.
        first: the index of the worker that failed first.
        last_lines: its last lines of output.
        note: appended to the headline, e.g. "8.1 s before any worker ended".

    Example:

    >>> w = [WorkerOutcome(0, "127.0.0.1:2222", 10, "running", "stopped by tfdist-launch (SIGTERM)", "train step 4"),
    ...      WorkerOutcome(1, "127.0.0.1:2223", 11, "killed by SIGKILL", "killed by SIGKILL", "train step 3")]
    >>> print(format_report(w, 1, ["Epoch 1/5"]))
    job failed: worker 1 (127.0.0.1:2223, pid 11) failed first: killed by SIGKILL
    its last output:
      | Epoch 1/5
    workers (state when it failed -> how it ended; last reported step):
      worker 0 (127.0.0.1:2222): running -> stopped by tfdist-launch (SIGTERM); train step 4
      worker 1 (127.0.0.1:2223): killed by SIGKILL; train step 3
    """
    culprit = outcomes[first]
    lines = [
        f"job failed: worker {culprit.index} ({culprit.address}, pid {culprit.pid}) failed first: "
        f"{culprit.when_failed}{' (' + note + ')' if note else ''}"
    ]
    if last_lines:
        lines.append("its last output:")
        lines += [f"  | {line if len(line) <= _LINE else line[: _LINE - 3] + '...'}" for line in last_lines]
    else:
        lines.append("its last output: none")
    lines.append("workers (state when it failed -> how it ended; last reported step):")
    # One screen: with many workers, those that were not simply running come first, the rest are counted.
    shown = list(outcomes)
    if len(shown) > _REPORT_ROWS:
        shown = sorted(shown, key=lambda o: (o.index != first, o.when_failed == "running", o.index))
        shown = sorted(shown[: _REPORT_ROWS - 1], key=lambda o: o.index)
    for o in shown:
        ended = f" -> {o.ended}" if o.ended != o.when_failed else ""
        lines.append(f"  {o.who}: {o.when_failed}{ended}; {o.last_report or 'no flight-recorder status'}")
    if len(shown) < len(outcomes):
        lines.append(f"  ... and {len(outcomes) - len(shown)} more workers")
    return "\n".join(lines)


class Launcher:
    """Runs one command as `num_workers` local workers and supervises them.

    The workers use this process's network; `tfdist-launch` gives them a
    private one by moving itself into new namespaces first (`--network`).
    Workers die with the launcher, even when it is killed with SIGKILL.

    Args:
        command: the command line each worker runs; its program must be an
            executable file (a path, or a name found on PATH).
        num_workers: number of workers, 1 to `MAX_WORKERS` (256).
        join_timeout: seconds every worker has to start its TensorFlow server
            (to listen on its port) before the job is stopped; finite, > 0.
        grace: seconds between SIGTERM and SIGKILL when stopping workers;
            finite, > 0.
        run_dir: the job's run directory, where the workers' flight
            recorders keep their status (`tfdist.flight`): made if missing
            and kept; None: a temporary one, removed after the job.
        out: binary stream for the prefixed output; defaults to stdout.

    Raises:
        ValueError: naming the argument, for an empty or non-executable
            command or a number out of range.

    Example:

    >>> import io, sys
    >>> out = io.BytesIO()
    >>> Launcher(command=[sys.executable, "-c", "print('hi')"], num_workers=2, out=out).run()
    0
    >>> b"[worker 1] hi" in out.getvalue()
    True
    """

    def __init__(
        self,
        *,
        command: Sequence[str],
        num_workers: int,
        join_timeout: float = 300.0,
        grace: float = 10.0,
        run_dir: str | None = None,
        out=None,
    ):
        self.command = _check_command(command)
        self.num_workers = _validate.integer("num_workers", num_workers, maximum=MAX_WORKERS)
        self.join_timeout = _validate.positive_number("join_timeout", join_timeout, unit="seconds")
        self.grace = _validate.positive_number("grace", grace, unit="seconds")
        if run_dir is not None and (not isinstance(run_dir, str) or not run_dir or os.path.isfile(run_dir)):
            raise _validate.invalid("run_dir", run_dir, "a directory path (made if missing), or None")
        self.run_dir = run_dir
        self._output = _Output(out if out is not None else sys.stdout.buffer)
        self._procs: list[subprocess.Popen] = []
        self._threads: list[threading.Thread] = []
        self._tails: list[collections.deque] = []
        self._addresses: tuple[str, ...] = ()
        self._signal: int | None = None
        self._run_dir: str | None = None
        self._failed_at: dict[int, float] = {}  # worker -> when its failed exit was first seen (monotonic)
        self._stops: dict[int, tuple[int, float]] = {}  # worker -> (stop signal, when), while it is stopped
        self._signalled: dict[int, int] = {}  # worker -> the signal the launcher stopped it with
        self._report: tuple | None = None  # (outcomes, first, note) of a failed job, printed at the very end

    def _say(self, text: str) -> None:
        self._output.write(f"[tfdist-launch] {text}\n".encode())

    def _make_run_dir(self) -> str:
        if self.run_dir is None:
            return tempfile.mkdtemp(prefix="tfdist-run-")
        run_dir = os.path.abspath(self.run_dir)
        os.makedirs(run_dir, exist_ok=True)
        for name in os.listdir(run_dir):  # a previous job's files would read as this one's
            if name == flight.STOP_FILE or re.fullmatch(r"worker-\d+\.(status|flight\.txt)", name):
                os.remove(os.path.join(run_dir, name))
        return run_dir

    def _start(self, reaper: subprocess.Popen) -> list[int]:
        ports = free_ports(self.num_workers)
        workers = self._addresses = tuple(f"{HOST}:{p}" for p in ports)
        preexec = _die_with(os.getpid())
        for i in range(self.num_workers):
            env = dict(os.environ)
            env["TF_CONFIG"] = cluster_lib.Cluster(workers=workers, task_index=i).to_tf_config()
            env[cluster_lib.JOIN_TIMEOUT_ENV] = str(self.join_timeout)
            env[cluster_lib.RUN_DIR_ENV] = self._run_dir
            env["PYTHONUNBUFFERED"] = "1"
            proc = subprocess.Popen(
                self.command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=preexec,
            )
            self._procs.append(proc)
            with contextlib.suppress(OSError):  # a reaper that is gone protects nothing; the job goes on
                reaper.stdin.write(b"%d\n" % proc.pid)
                reaper.stdin.flush()
        # Output threads start after the last fork: `preexec_fn` runs in a child of a single thread.
        self._tails = [collections.deque(maxlen=LAST_LINES) for _ in self._procs]
        self._threads = [
            self._output.pump(f"[worker {i}] ".encode(), p.stdout, self._tails[i]) for i, p in enumerate(self._procs)
        ]
        return ports

    def _signal_all(self, sig: int) -> None:
        for i, proc in enumerate(self._procs):
            if proc.poll() is None:
                self._signalled[i] = sig
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)
                    os.killpg(proc.pid, signal.SIGCONT)  # a stopped worker acts on the signal only once resumed

    def _stop_all(self, sig: int = signal.SIGTERM) -> None:
        self._signal_all(sig)
        deadline = time.monotonic() + self.grace
        while time.monotonic() < deadline and any(p.poll() is None for p in self._procs):
            time.sleep(_POLL)
        alive = [i for i, p in enumerate(self._procs) if p.poll() is None]
        if alive:
            self._say(f"workers {alive} still running {self.grace:g}s after signal {sig}; killing them")
            self._signal_all(signal.SIGKILL)
        for proc in self._procs:
            proc.wait()

    def _on_signal(self, signum, frame):
        self._signal = signum

    def run(self) -> int:
        """Starts the workers and waits for them.

        When a worker fails, the others first get `REPORT_WAIT` seconds to
        print their flight-recorder summary (see `tfdist.flight`), and after
        the job ended the launcher prints a report: the worker that failed
        first (a worker stopped by a signal counts from then), how it ended,
        its last lines of output, and every worker's state, end and last
        reported step.

        Returns:
            0 when every worker exits 0; else the first failed worker's exit
            status (128 + signal when killed by a signal), 128 + signal when the
            launcher itself was interrupted (SIGINT, SIGTERM, SIGHUP), 1 when a
            worker did not join, or 126 when the command could not be started.
        """
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                previous[sig] = signal.signal(sig, self._on_signal)
        reaper = subprocess.Popen(
            [sys.executable, "-S", "-c", _REAPER, str(self.grace)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            self._run_dir = self._make_run_dir()
            return self._supervise(reaper)
        finally:
            if any(p.poll() is None for p in self._procs):
                self._stop_all()
            for thread in self._threads:
                thread.join(timeout=5)
            with contextlib.suppress(OSError):
                reaper.stdin.write(b"done\n")
                reaper.stdin.close()
            reaper.wait()
            if self._report is not None:
                outcomes, first, note = self._report
                tail = [line.decode(errors="replace") for line in self._tails[first]]
                for line in format_report(outcomes, first, tail, note=note).splitlines():
                    self._say(line)
            if self._run_dir is not None and self.run_dir is None:
                shutil.rmtree(self._run_dir, ignore_errors=True)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _status(self, i: int) -> flight.Status | None:
        return flight.read_status(flight.status_path(self._run_dir, i)) if self._run_dir else None

    def _watch(self, codes: list[int | None]) -> None:
        """Notes when each worker fails, and when one is stopped by a signal (or resumed)."""
        now = time.monotonic()
        for i, code in enumerate(codes):
            if code is not None:
                if code != 0:
                    self._failed_at.setdefault(i, now)
                self._stops.pop(i, None)
                continue
            with contextlib.suppress(ChildProcessError, OSError):
                info = os.waitid(os.P_PID, self._procs[i].pid, os.WSTOPPED | os.WCONTINUED | os.WNOHANG)
                if info is not None and info.si_code == os.CLD_STOPPED:
                    self._stops.setdefault(i, (info.si_status, now))
                elif info is not None and info.si_code == os.CLD_CONTINUED:
                    self._stops.pop(i, None)

    def _first_failure(self) -> tuple[int, int]:
        """(the worker that failed first, the first worker that exited failing).

        A worker stopped by a signal failed when it stopped. Failures seen in
        the same poll go first to a worker whose flight recorder did not
        report (the others reported because they saw a peer fail), then by index.
        """
        def key(i, when):
            status = self._status(i)
            return when, bool(status and status.reported), i

        exits = sorted(key(i, t) for i, t in self._failed_at.items())
        stops = sorted(key(i, t) for i, (_, t) in self._stops.items())
        return min(exits + stops)[2], exits[0][2]

    def _state(self, i: int, code: int | None) -> str:
        """Worker `i`'s state in words: exited (how), stopped (by which signal), or running."""
        if code is not None:
            return describe_exit(code)
        if i in self._stops:
            return f"stopped by {_signal_name(self._stops[i][0])}"
        status = self._status(i)  # the command may be a wrapper (a shell) around the process that trains
        if status is not None and flight.process_state(status.pid) == "stopped":
            return "stopped by a signal"
        return "running"

    def _collect_reports(self, reason: str) -> None:
        """Asks the workers to print their flight-recorder summary and waits (bounded) until the live ones did."""
        stop = os.path.join(self._run_dir, flight.STOP_FILE)
        with open(stop + ".tmp", "w") as f:
            f.write(reason)
        os.replace(stop + ".tmp", stop)
        deadline = time.monotonic() + min(self.grace, REPORT_WAIT)
        while time.monotonic() < deadline:
            waiting = []
            for i, proc in enumerate(self._procs):
                status = self._status(i) if proc.poll() is None else None
                if status is not None and not status.reported and flight.process_state(status.pid) == "running":
                    waiting.append(i)
            if not waiting:
                return
            time.sleep(_POLL / 2)

    def _ended(self, i: int) -> str:
        """How worker `i` ended, in words, once it did: by the launcher's signal, or by itself."""
        code, sig = self._procs[i].returncode, self._signalled.get(i)
        if sig is not None and code in (-sig, -signal.SIGKILL):
            return f"stopped by tfdist-launch ({_signal_name(-code)})"
        if sig is not None and code == 128 + sig:  # its handler exited as a shell reports the signal
            return f"stopped by tfdist-launch ({_signal_name(sig)}; exit code {code})"
        return describe_exit(code)

    def _fail(self, codes: list[int | None]) -> int:
        """Stops the job after a failure (the survivors report first); returns the exit status, sets the report."""
        first, first_exit = self._first_failure()
        status = _exit_status(codes[first_exit])
        others = [j for j, c in enumerate(codes) if c is None]
        self._say(
            f"worker {first_exit} failed with exit status {status}" + (f"; stopping workers {others}" if others else "")
        )
        when_failed = [self._state(i, c) for i, c in enumerate(codes)]
        self._collect_reports(f"worker {first} ({self._addresses[first]}) {when_failed[first]}")
        self._stop_all()
        now = time.time()
        outcomes = []
        for i, proc in enumerate(self._procs):
            report = self._status(i)
            outcomes.append(
                WorkerOutcome(
                    index=i,
                    address=self._addresses[i],
                    pid=report.pid if report else proc.pid,
                    when_failed=when_failed[i],
                    ended=when_failed[i] if codes[i] is not None else self._ended(i),
                    last_report=f"last reported {report.describe(now)}" if report and report.phase else "",
                )
            )
        note = ""
        if first != first_exit:
            seconds = self._failed_at[first_exit] - self._stops[first][1]
            note = f"{seconds:.1f} s before worker {first_exit} {describe_exit(codes[first_exit])}"
        self._report = (outcomes, first, note)
        return status

    def _supervise(self, reaper: subprocess.Popen) -> int:
        try:
            ports = self._start(reaper)
        except OSError as e:
            started = list(range(len(self._procs)))
            self._say(
                f"cannot start worker {len(self._procs)}: {e.strerror}: {self.command[0]!r}"
                + (f"; stopping workers {started}" if started else "")
            )
            self._stop_all()
            return 126
        self._say(f"started {self.num_workers} worker(s) on {HOST} ports {ports}: {' '.join(self.command)}")
        joined = [False] * self.num_workers
        join_deadline = time.monotonic() + self.join_timeout
        while True:
            if self._signal is not None:
                sig = self._signal
                self._say(f"received signal {sig}; forwarding it to all workers")
                self._stop_all(sig)
                return 128 + sig
            codes = [p.poll() for p in self._procs]
            self._watch(codes)
            if self._failed_at:
                return self._fail(codes)
            if all(c == 0 for c in codes):
                self._say("all workers finished")
                return 0
            for i, port in enumerate(ports):
                if not joined[i]:
                    joined[i] = codes[i] == 0 or _listening(port)
            if not all(joined) and time.monotonic() > join_deadline:
                missing = [f"worker {i} ({HOST}:{ports[i]})" for i in range(self.num_workers) if not joined[i]]
                self._say(
                    f"{', '.join(missing)} did not start its TensorFlow server within "
                    f"--join_timeout={self.join_timeout:g}s; stopping all workers"
                )
                self._stop_all()
                return 1
            time.sleep(_POLL)


def _enter_private_network() -> None:
    """Moves this single-threaded process into a new user + network namespace and brings its loopback up.

    The user namespace maps this process's user and group to themselves, so
    files the workers write belong to the invoking user; a worker that is not
    root has no privileges in it.

    Raises:
        OSError: whose `strerror` says which step failed.
    """
    uid, gid = os.geteuid(), os.getegid()
    if _LIBC.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWUSER | CLONE_NEWNET) failed: {os.strerror(err)}")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
        except OSError as e:
            raise OSError(e.errno, f"cannot write {text!r} to /proc/self/{name}: {e.strerror}") from e
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            flags = struct.unpack_from("16sH", fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack("16sH22x", b"lo", 0)))[1]
            fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP))
    except OSError as e:
        raise OSError(e.errno, f"cannot bring up the loopback device of the new network namespace: {e.strerror}") from e


def _private_network_unavailable() -> str | None:
    """Why `_enter_private_network` would fail here (tried in a forked child), or None when it works."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            _enter_private_network()
        except Exception as e:  # every failure is a reason, which the parent reports
            os.write(write, (e.strerror if isinstance(e, OSError) else repr(e)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        reason = f.read().decode()
    os.waitpid(pid, 0)
    return reason or None


def _usage_error(message: str) -> NoReturn:
    """Ends `tfdist-launch` with a one-line error (no traceback) and exit status 2."""
    print(f"tfdist-launch: error: {message} (see tfdist-launch --help)", file=sys.stderr)
    sys.exit(2)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        _usage_error(message)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parses `tfdist-launch` arguments (everything after `--` is the command).

    A bad argument ends the program with one line on stderr and exit status 2.

    Example:

    >>> parse_args(["-n", "2", "--", "python", "train.py"]).command
    ['python', 'train.py']
    """
    parser = _Parser(
        prog="tfdist-launch",
        description="Run CMD as N local multi-worker TensorFlow workers on 127.0.0.1.",
        usage="tfdist-launch -n N [--join_timeout S] [--grace S] [--network MODE] [--run_dir DIR] -- CMD [ARGS...]",
    )
    parser.add_argument(
        "-n", "--num_workers", type=int, required=True, help=f"number of workers (1 to {MAX_WORKERS})"
    )
    parser.add_argument(
        "--join_timeout", type=float, default=300.0, help="seconds for every worker to start (default 300)"
    )
    parser.add_argument(
        "--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL (default 10)"
    )
    parser.add_argument(
        "--network",
        choices=("auto", "private", "host"),
        default="auto",
        help="private: the workers reach only each other (a new user + network namespace); host: this "
        "machine's network, the workers' ports open on every interface; auto (default): private when the "
        "OS allows it, else host with a notice",
    )
    parser.add_argument(
        "--run_dir",
        default=None,
        help="directory for the workers' flight-recorder status files, kept after the job (default: a temporary "
        "one, removed); each worker's ring buffer lands there as worker-i.flight.txt when the job fails",
    )
    argv = list(argv)
    if "--" in argv:
        split = argv.index("--")
        own, command = argv[:split], argv[split + 1 :]
    else:
        own, command = argv, []
    args = parser.parse_args(own)
    if not command:
        parser.error("no command given. Expected: tfdist-launch -n N -- CMD [ARGS...]")
    args.command = command
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `tfdist-launch`; returns the exit status.

    Unless `--network=host`, this process itself moves into the job's private
    network before it starts the workers.
    """
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        launcher = Launcher(
            command=args.command,
            num_workers=args.num_workers,
            join_timeout=args.join_timeout,
            grace=args.grace,
            run_dir=args.run_dir,
        )
    except ValueError as e:
        _usage_error(str(e))
    if args.network != "host":
        reason = _private_network_unavailable()
        if reason is None:
            _enter_private_network()
            launcher._say("private network: only the job's workers reach their ports")
        elif args.network == "private":
            _usage_error(f"--network=private: this machine cannot give the job a private network: {reason}")
        else:
            launcher._say(
                f"NOT isolated (no private network: {reason}); the workers' ports are open on every "
                "interface, see --network"
            )
    return launcher.run()


def run() -> None:
    """Console-script wrapper around `main`."""
    sys.exit(main())


if __name__ == "__main__":
    run()
