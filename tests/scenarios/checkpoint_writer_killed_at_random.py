"""Asserted by tests/callbacks/test_callbacks_fault.py.

Kill -9 at random moments of checkpoint writing (run as a script, not collected by pytest).

Usage: python tests/scenarios/checkpoint_writer_killed_at_random.py DIR TRIALS SEED OUT.json
TensorFlow is imported once, here; each trial forks a writer that saves large checkpoints (16 MiB,
every value equal to the step) back to back, keeping the last two, and SIGKILLs it. TRIALS trials kill
after a random delay (2-6 saves' time: inside a write, or between two); TRIALS // 2 more kill inside
the write of the writer's second checkpoint, after a random number of its bytes: the writer stops
itself there (SIGSTOP), and the parent, seeing it stopped, SIGKILLs it. After each kill every file
under a checkpoint name is read back in full, `latest_checkpoint` must name an intact one, and the
stale-temp cleanup of the next run must leave no temporary file.
"""

import io
import json
import os
import random
import signal
import sys
import time
import zipfile

import numpy as np

from tfdist.callbacks import _files
from tfdist.callbacks import latest_checkpoint

DIRECTORY, TRIALS, SEED, OUT = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
PATHS = ["a", "b"]
SHAPE = (1024, 2048)  # 8 MiB of float32 per array


def checkpoint(step):
    arrays = [np.full(SHAPE, step, "float32"), np.full(SHAPE, -step, "float32")]
    _files.save(DIRECTORY, "ckpt", step, PATHS, arrays, {"step": step}, rank=0)
    for _, old in _files.list_checkpoints(DIRECTORY, "ckpt")[:-2]:
        os.remove(old)


def writer(first_step, stop_at=None):
    """Saves checkpoints from `first_step` on; with `stop_at`, stops itself after that many bytes of the second."""
    if stop_at is not None:
        fdopen = os.fdopen

        class Stopping(io.BufferedWriter):  # a checkpoint file that stops this process after `stop_at` bytes
            written = 0

            def write(self, data):
                n = super().write(data)
                self.written += n
                if self.written >= stop_at:
                    os.kill(os.getpid(), signal.SIGSTOP)
                return n

        def stop_in_second(fd, mode="r", *args, **kwargs):
            if step != first_step + 1:
                return fdopen(fd, mode, *args, **kwargs)
            return Stopping(io.FileIO(fd, mode))

        os.fdopen = stop_in_second
    step = first_step
    while True:
        checkpoint(step)
        step += 1


def intact(path, step) -> bool:
    try:
        with zipfile.ZipFile(path) as z:
            if z.testzip() is not None:
                return False
        meta, arrays = _files.read_file(path)
    except (OSError, ValueError, zipfile.BadZipFile):
        return False
    return meta["step"] == step and all(
        np.array_equal(a, np.full(SHAPE, sign * step, "float32")) for a, sign in zip(arrays, (1, -1))
    )


rng = random.Random(SEED)
os.makedirs(DIRECTORY, exist_ok=True)
started = time.monotonic()
checkpoint(1)
save_seconds = time.monotonic() - started
trials = []
CHECKPOINT_BYTES = 2 * 4 * SHAPE[0] * SHAPE[1]
for trial in range(TRIALS + TRIALS // 2):
    first = _files.list_checkpoints(DIRECTORY, "ckpt")[-1][0] + 1
    stop_at = rng.randrange(1, CHECKPOINT_BYTES) if trial >= TRIALS else None
    pid = os.fork()
    if pid == 0:
        try:
            writer(first, stop_at)
        finally:
            os._exit(1)
    delay = None
    if stop_at is None:
        delay = rng.uniform(2 * save_seconds, 6 * save_seconds)
        time.sleep(delay)
    else:
        _, status = os.waitpid(pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), status  # inside the second checkpoint's write, not dead
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    names = sorted(os.listdir(DIRECTORY))
    finals = _files.list_checkpoints(DIRECTORY, "ckpt")
    latest = latest_checkpoint(DIRECTORY)
    _files.remove_stale_temps(DIRECTORY)  # what the next run's chief does before it writes
    trials.append(
        {
            "killed": os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL,
            "delay_s": delay,
            "stopped_after_bytes": stop_at,
            "mid_write": any(name.startswith(".") for name in names),
            "saved": finals[-1][0] - first + 1,
            "finals_intact": all(intact(path, step) for step, path in finals),
            "latest_is_newest_final": latest == finals[-1][1],
            "latest_intact": latest is not None and intact(latest, finals[-1][0]),
            "left_after_cleanup": sorted(set(os.listdir(DIRECTORY)) - {os.path.basename(p) for _, p in finals}),
        }
    )
with open(OUT, "w") as f:
    json.dump({"save_seconds": save_seconds, "trials": trials}, f)
print("done", flush=True)
