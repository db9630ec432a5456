"""Real worker processes for the multi-worker tests: loopback ports, hard timeouts, killed by PID."""

import contextlib
import os
import signal
import subprocess
import sys
import time

from tfdist import cluster as cluster_lib
from tfdist import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "_mw_worker.py")


def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TF_CONFIG", "SLURM_", "TFDIST_"))}
    env.update(PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", **extra)
    return env


class Procs:
    """Started processes (each in its own session), their logs, and their exit times."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.procs, self.logs, self.ended = [], [], []

    def start(self, cmd, env) -> int:
        i = len(self.procs)
        log = self.tmp_path / f"proc{i}.log"
        with open(log, "wb") as f:
            self.procs.append(
                subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
            )
        self.logs.append(log)
        self.ended.append(None)
        return i

    def start_worker(self, workers, index, out, mode, **opts) -> int:
        tf_config = cluster_lib.Cluster(workers=workers, task_index=index).to_tf_config()
        args = [f"{k}={v}" for k, v in opts.items()]
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

    def kill_all(self):
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def workers(n):
    return tuple(f"127.0.0.1:{p}" for p in launch.free_ports(n))
