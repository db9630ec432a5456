"""Scenario children forked from a process that has already imported TensorFlow and Keras.

Importing TensorFlow and Keras costs a new Python process about 4 s of CPU on the 2-core CI machine, and
the suite starts over a hundred scenario processes (`tests/scenarios/*.py`, test modules run as scripts):
a fifth of the suite's CPU went to the same imports. A fork server per environment imports them once
(nothing else: not tfdist, not TensorFlow's runtime, so no thread and no device exists yet) and forks each
child from there; the child then runs its script as `python script.py ARGS` would, in its own environment,
directory, session and output files, and reports its exit status like `subprocess.Popen`.

What a forked child shares with its server, and a fresh interpreter would not: the string hash seed. Two
servers per environment ("slots") give the workers of one job different seeds, as separate processes have:
a job whose workers disagree on the order of a set still shows it. NumPy's global random state is reseeded
in each child (Python's `random` reseeds itself after a fork).

Run as a script, this file is the server: `python _forkserver.py SOCKET`.
"""

import atexit
import json
import os
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

REQUEST_BYTES = 1 << 20


# ------------------------------------------------------------------------------------------------ the server
def _serve(path: str):
    """Accepts requests until its parent ends; returns the request in a forked child, never in the server."""
    parent = os.getppid()
    import keras  # noqa: F401
    import numpy  # noqa: F401
    import tensorflow  # noqa: F401

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children = {}  # pid -> the connection its status goes to
    while os.getppid() == parent:  # the pytest process that started it is still there
        for key, _ in selector.select(timeout=0.02):
            conn, _ = key.fileobj.accept()
            message, fds, _, _ = socket.recv_fds(conn, REQUEST_BYTES, 3)
            pid = os.fork()
            if pid == 0:
                selector.close()
                listener.close()
                return json.loads(message), fds, conn
            for fd in fds:
                os.close(fd)
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"exit {os.waitstatus_to_exitcode(status)}".encode())
                except OSError:  # the client is gone
                    pass
                conn.close()
    sys.exit(0)  # its children are left to their owners' kills by PID


def _become(request: dict, fds: list[int], conn: socket.socket) -> None:
    """Turns this forked process into `request`'s `python SCRIPT ARGS` (or `python -m MODULE ARGS`), run as __main__.

    Its pid goes to the client once it leads its own session (when asked), so that a signal to its process
    group from then on reaches it.
    """
    if request["new_session"]:
        os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    conn.sendall(f"pid {os.getpid()}".encode())
    conn.close()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    import numpy as np

    np.random.seed()  # the legacy global state, seeded from the OS as a fresh import of NumPy would
    if request["argv"][1] == "-m":  # python -m MODULE ARGS: the module's file as argv[0], the directory on sys.path
        module, *args = request["argv"][2:]
        sys.argv = [module, *args]
        sys.path[0] = os.getcwd()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    script, *args = request["argv"][1:]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


# ------------------------------------------------------------------------------------------------ the client
class ForkedProcess:
    """A `subprocess.Popen`-like handle on a child of a fork server: pid, poll, wait, signals, returncode."""

    def __init__(self, conn: socket.socket, args):
        self.args = args
        self._conn = conn
        self.pid = int(conn.recv(64).decode().split()[1])
        self.returncode = None

    def poll(self):
        if self.returncode is None:
            try:
                self._read(socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._conn.settimeout(left)
            try:
                self._read()
            except TimeoutError:
                pass
        return self.returncode

    def _read(self, flags: int = 0) -> None:
        message = self._conn.recv(64, flags)
        if not message:  # the server ended before the child: its status is lost
            raise RuntimeError(f"the fork server of pid {self.pid} ({self.args[1]}) ended before it")
        self.returncode = int(message.decode().split()[1])
        self._conn.close()

    def send_signal(self, sig) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    """One fork server process and its socket."""

    def __init__(self, directory: str, name: str, env: dict, cwd: str):
        self.path = os.path.join(directory, f"{name}.sock")
        self.log = open(os.path.join(directory, f"{name}.log"), "wb")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.path], env=env, cwd=cwd,
                                     stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)

    def fork(self, argv, env, cwd, fds, new_session: bool) -> ForkedProcess:
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path):  # the server is still importing
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the fork server for {argv[1]} did not start (its log: {self.log.name})")
            time.sleep(0.05)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(self.path)
        request = {"argv": list(argv), "env": env, "cwd": cwd, "new_session": new_session}
        socket.send_fds(conn, [json.dumps(request).encode()], fds)
        return ForkedProcess(conn, list(argv))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


# Read by the child at run time only (a server's imports do not depend on them): they may differ among the
# children of one server. pytest names the running test in PYTEST_CURRENT_TEST.
RUNTIME_ONLY = ("TF_CONFIG", "TFDIST_", "SLURM_", "DTENSOR_", "PYTEST_")
SLOTS = 2
_servers: dict = {}
_directory = None


def _import_env(env: dict) -> dict:
    """What of `env` a server's imports may read: all but `RUNTIME_ONLY`."""
    return {k: v for k, v in env.items() if not k.startswith(RUNTIME_ONLY)}


def popen(argv, *, env: dict, cwd: str, stdout, stderr=None, new_session: bool = False, slot: int = 0):
    """`python SCRIPT ARGS` forked from the server for `env` (and `slot`); a `ForkedProcess`.

    `stdout` and `stderr` are open files (`stderr` None: `stdout`'s); stdin is /dev/null.
    """
    global _directory
    if _directory is None:
        _directory = tempfile.mkdtemp(prefix="tfdist-forkserver-")
        atexit.register(stop_all)
    server_env = _import_env(env)
    key = slot % SLOTS, tuple(sorted(server_env.items()))
    if key not in _servers:
        _servers[key] = _Server(_directory, f"server{len(_servers)}", server_env, cwd)
    with open(os.devnull, "rb") as devnull:
        fds = [devnull.fileno(), stdout.fileno(), (stderr or stdout).fileno()]
        return _servers[key].fork(argv, env, cwd, fds, new_session)


def stop_all() -> None:
    """Ends every fork server of this process (their children are left to their owners)."""
    global _directory

    for server in _servers.values():
        server.stop()
    _servers.clear()
    if _directory is not None:
        shutil.rmtree(_directory, ignore_errors=True)
        _directory = None


if __name__ == "__main__":
    _become(*_serve(sys.argv[1]))
