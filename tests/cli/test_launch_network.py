"""tfdist-launch --network: in the private network nothing outside the job reaches a worker's port."""

import fcntl
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile

import _procs
import pytest
from _launchers import LAUNCH
from _launchers import NETWORKS
from _launchers import Lines
from _launchers import descendants
from _launchers import kill
from _launchers import needs_user_namespaces
from _launchers import start
from _launchers import wait_gone

# Listens on 0.0.0.0 at its TF_CONFIG port (as TensorFlow's gRPC server does) and answers every connection
# with argv[2] and its index; writes a file into argv[1]; worker 1 connects to worker 0 and prints the answer.
LISTENER = r"""
import json, os, socket, sys, threading, time
out, token = sys.argv[1], sys.argv[2]
config = json.loads(os.environ["TF_CONFIG"])
index, workers = config["task"]["index"], config["cluster"]["worker"]
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", int(workers[index].rsplit(":", 1)[1])))
server.listen()
def serve():
    while True:
        connection, _ = server.accept()
        connection.sendall(f"{token} {index}".encode())
        connection.close()
threading.Thread(target=serve, daemon=True).start()
open(os.path.join(out, f"file-{index}"), "w").close()
print("listening uid", os.getuid(), "gid", os.getgid(), flush=True)
if index == 1:
    host, port = workers[0].rsplit(":", 1)
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2) as peer:
                print("peer answered", peer.recv(100).decode(), flush=True)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                print("peer unreachable", e, flush=True)
                break
            time.sleep(0.1)
time.sleep(300)
"""


def host_addresses() -> list[str]:
    """127.0.0.1 and every other IPv4 address of this machine's interfaces (SIOCGIFADDR)."""
    addresses = ["127.0.0.1"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(s, 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:  # an interface without an IPv4 address
                continue
            address = socket.inet_ntoa(reply[20:24])
            if address not in addresses:
                addresses.append(address)
    return addresses


def answer(address: str, port: int) -> str:
    """What a server at address:port says on connecting, or the connection error."""
    try:
        with socket.create_connection((address, port), timeout=2) as s:
            s.settimeout(2)
            return s.recv(100).decode()
    except OSError as e:
        return f"unreachable: {e}"


def _runs_as(drop, python: str, path: str) -> bool:
    """Whether the user `drop` switches to can start `python` and import tfdist.launch from `path`."""
    try:
        probe = subprocess.run(
            [python, "-c", "import tfdist.launch"], env=_procs.clean_env(PYTHONPATH=path), cwd=path,
            preexec_fn=drop, capture_output=True, timeout=60,
        )  # fmt: skip
    except PermissionError:  # the interpreter itself is out of that user's reach (a private checkout's venv)
        return False
    return probe.returncode == 0


@pytest.fixture
def user():
    """(uid, gid, preexec_fn, python, PYTHONPATH) the launcher runs with: an unprivileged user when the tests run
    as root, so that the file ownership check and the private network are tried without privileges.

    A private checkout (a clone under a directory of mode 0700, or this interpreter under root's home) is not
    readable by that user: the launcher is stdlib-only, so it then runs from a copy of the package in a
    directory anyone can read, with the first interpreter that user can start."""
    if os.geteuid() != 0:
        yield os.getuid(), os.getgid(), None, sys.executable, _procs.REPO
        return

    def drop():
        os.setgroups([])
        os.setgid(54321)
        os.setuid(54321)

    if _runs_as(drop, sys.executable, _procs.REPO):
        yield 54321, 54321, drop, sys.executable, _procs.REPO
        return
    staged = tempfile.mkdtemp(prefix="tfdist-launch-code-")
    os.chmod(staged, 0o755)
    shutil.copytree(os.path.join(_procs.REPO, "tfdist"), os.path.join(staged, "tfdist"),
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    for root, dirs, files in os.walk(staged):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
        for name in files:
            os.chmod(os.path.join(root, name), 0o644)
    candidates = [sys.executable, getattr(sys, "_base_executable", ""), "/usr/bin/python3", "/usr/local/bin/python3"]
    usable = [c for c in dict.fromkeys(candidates) if c and os.path.exists(c) and _runs_as(drop, c, staged)]
    assert usable, f"no interpreter of {candidates} starts as uid 54321 with tfdist copied to {staged}"
    yield 54321, 54321, drop, usable[0], staged
    shutil.rmtree(staged, ignore_errors=True)


@pytest.mark.parametrize("network", NETWORKS)
def test_only_the_jobs_workers_reach_a_worker_in_the_private_network(network, user):
    uid, gid, drop, python, path = user
    out = tempfile.mkdtemp(prefix="tfdist-launch-")
    os.chown(out, uid, gid)
    token = secrets.token_hex(8)
    proc = start(
        ["-n", "2", "--grace", "3", f"--network={network}", "--", python, "-c", LISTENER, out, token],
        python=python, env=_procs.clean_env(PYTHONPATH=path), cwd=path, preexec_fn=drop,
    )
    tree = set()
    try:
        lines = Lines(proc.stdout).until(
            lambda lines: sum(line.startswith("[worker ") and " listening " in line for line in lines) == 2
            and any(line.startswith("[worker 1] peer ") for line in lines)
        )
        tree = descendants(proc.pid)
        started = next(line for line in lines if "started 2 worker(s)" in line)
        ports = [int(p) for p in started.split("ports [")[1].split("]")[0].split(", ")]
        assert f"[worker 1] peer answered {token} 0" in lines, lines  # the workers reach each other
        for i in range(2):
            assert f"[worker {i}] listening uid {uid} gid {gid}" in lines, lines
            owner = os.stat(os.path.join(out, f"file-{i}"))
            assert (owner.st_uid, owner.st_gid) == (uid, gid)
        answers = {(a, p): answer(a, p) for a in host_addresses() for p in ports}
        assert len(answers) >= 2 * 2, answers  # loopback and at least one other address, each port
        if network == "private":
            assert "[tfdist-launch] private network: only the job's workers reach their ports" in lines
            assert not [k for k, text in answers.items() if token in text], answers
        else:
            assert answers == {(a, p): f"{token} {ports.index(p)}" for a, p in answers}, answers
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        left, _ = wait_gone(tree, timeout=5)
        assert not left, (left, tree)
    finally:
        kill([proc.pid, *tree])
        proc.wait()
        shutil.rmtree(out)


def without_user_namespaces(*launch_args):
    """Runs tfdist-launch where creating a user namespace fails (a namespace allowing no more of them)."""
    script = 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"'
    command = ["unshare", "--user", "--map-root-user", "sh", "-c", script, "sh", *LAUNCH, *launch_args]
    return _procs.run(command, timeout=60)


@needs_user_namespaces
def test_without_user_namespaces_auto_says_the_job_is_not_isolated():
    result = without_user_namespaces("-n", "2", "--", sys.executable, "-c", "print('ran')")
    assert result.returncode == 0, result.stdout + result.stderr
    notice = [line for line in result.stdout.splitlines() if "NOT isolated" in line]
    assert notice == [
        "[tfdist-launch] NOT isolated (no private network: unshare(CLONE_NEWUSER | CLONE_NEWNET) failed: No space "
        "left on device); the workers' ports are open on every interface, see --network"
    ], result.stdout
    assert "[worker 0] ran" in result.stdout and "[worker 1] ran" in result.stdout, result.stdout


@needs_user_namespaces
def test_without_user_namespaces_private_refuses_to_start():
    result = without_user_namespaces("-n", "2", "--network=private", "--", sys.executable, "-c", "print('ran')")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        "tfdist-launch: error: --network=private: this machine cannot give the job a private network: "
        "unshare(CLONE_NEWUSER | CLONE_NEWNET) failed: No space left on device (see tfdist-launch --help)"
    ]
