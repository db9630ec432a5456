"""`tfdist-launch`: start N local workers of a multi-worker job on 127.0.0.1.

    tfdist-launch -n 2 -- python train.py --epochs=3
    tfdist-launch -n 2 -- tfdist-train --strategy=multi_worker

Each worker gets its own `TF_CONFIG` (free loopback ports, worker i is task i)
and `TFDIST_JOIN_TIMEOUT`, which `tfdist.MultiWorkerStrategy` uses as its
default `join_timeout`. Every output line is prefixed with `[worker i]`.
Ctrl-C / SIGTERM are forwarded to every worker's process group. When a worker
fails, the others are stopped (SIGTERM, then SIGKILL after `--grace` seconds)
and the launcher exits with the failed worker's status. When a worker has not
started its TensorFlow server within `--join_timeout` seconds, the job is
stopped too. The launcher only uses loopback addresses; see the README for
real clusters.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from tfdist import _validate
from tfdist import cluster as cluster_lib

HOST = "127.0.0.1"
_POLL = 0.1


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


class _Output:
    """Copies worker output line by line, each line prefixed with its worker."""

    def __init__(self, stream):
        self._stream = stream
        self._lock = threading.Lock()

    def write(self, line: bytes) -> None:
        with self._lock:
            self._stream.write(line)
            self._stream.flush()

    def pump(self, prefix: bytes, pipe) -> threading.Thread:
        def run():
            for line in iter(pipe.readline, b""):
                self.write(prefix + (line if line.endswith(b"\n") else line + b"\n"))
            pipe.close()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


class Launcher:
    """Runs one command as `num_workers` local workers and supervises them.

    Args:
        command: the command line each worker runs.
        num_workers: number of workers, at least 1.
        join_timeout: seconds every worker has to start its TensorFlow server
            (to listen on its port) before the job is stopped.
        grace: seconds between SIGTERM and SIGKILL when stopping workers.
        out: binary stream for the prefixed output; defaults to stdout.

    Raises:
        ValueError: for an empty command or invalid numbers.

    Example:

    >>> import sys
    >>> Launcher(command=[sys.executable, "-c", "pass"], num_workers=2).run()
    0
    """

    def __init__(
        self,
        *,
        command: Sequence[str],
        num_workers: int,
        join_timeout: float = 300.0,
        grace: float = 10.0,
        out=None,
    ):
        if isinstance(command, str) or not command:
            raise ValueError(
                f"Invalid value for argument `command`. Received: command={command!r}. Expected a "
                "non-empty list such as ['python', 'train.py']."
            )
        _validate.integer("num_workers", num_workers)
        _validate.positive_number("join_timeout", join_timeout, unit="seconds")
        _validate.positive_number("grace", grace, unit="seconds")
        self.command = list(command)
        self.num_workers = num_workers
        self.join_timeout = float(join_timeout)
        self.grace = float(grace)
        self._output = _Output(out if out is not None else sys.stdout.buffer)
        self._procs: list[subprocess.Popen] = []
        self._signal: int | None = None

    def _say(self, text: str) -> None:
        self._output.write(f"[tfdist-launch] {text}\n".encode())

    def _start(self) -> list[int]:
        ports = free_ports(self.num_workers)
        workers = tuple(f"{HOST}:{p}" for p in ports)
        threads = []
        for i in range(self.num_workers):
            env = dict(os.environ)
            env["TF_CONFIG"] = cluster_lib.Cluster(workers=workers, task_index=i).to_tf_config()
            env[cluster_lib.JOIN_TIMEOUT_ENV] = str(self.join_timeout)
            env["PYTHONUNBUFFERED"] = "1"
            proc = subprocess.Popen(
                self.command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self._procs.append(proc)
            threads.append(self._output.pump(f"[worker {i}] ".encode(), proc.stdout))
        self._threads = threads
        return ports

    def _signal_all(self, sig: int) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, sig)

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

        Returns:
            0 when every worker exits 0; else the first failed worker's exit
            status (128 + signal when killed by a signal), 128 + signal when the
            launcher itself was interrupted, or 1 when a worker did not join.
        """
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            return self._supervise()
        finally:
            if any(p.poll() is None for p in self._procs):
                self._stop_all()
            for thread in getattr(self, "_threads", []):
                thread.join(timeout=5)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _supervise(self) -> int:
        ports = self._start()
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
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                i, code = failed[0]
                status = _exit_status(code)
                others = [j for j, c in enumerate(codes) if c is None]
                self._say(
                    f"worker {i} failed with exit status {status}"
                    + (f"; stopping workers {others}" if others else "")
                )
                self._stop_all()
                return status
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


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parses `tfdist-launch` arguments (everything after `--` is the command)."""
    parser = argparse.ArgumentParser(
        prog="tfdist-launch",
        description="Run CMD as N local multi-worker TensorFlow workers on 127.0.0.1.",
        usage="tfdist-launch -n N [--join_timeout S] [--grace S] -- CMD [ARGS...]",
    )
    parser.add_argument("-n", "--num_workers", type=int, required=True, help="number of workers (>= 1)")
    parser.add_argument(
        "--join_timeout", type=float, default=300.0, help="seconds for every worker to start (default 300)"
    )
    parser.add_argument(
        "--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL (default 10)"
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
    if args.num_workers < 1:
        parser.error(f"-n/--num_workers must be >= 1; received {args.num_workers}")
    if args.join_timeout <= 0 or args.grace <= 0:
        parser.error(
            f"--join_timeout and --grace must be positive; received {args.join_timeout:g}, {args.grace:g}"
        )
    args.command = command
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `tfdist-launch`; returns the exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    launcher = Launcher(
        command=args.command, num_workers=args.num_workers, join_timeout=args.join_timeout, grace=args.grace
    )
    try:
        return launcher.run()
    except FileNotFoundError as e:
        print(f"tfdist-launch: cannot run {args.command[0]!r}: {e}", file=sys.stderr)
        return 127


def run() -> None:
    """Console-script wrapper around `main`."""
    sys.exit(main())


if __name__ == "__main__":
    run()
