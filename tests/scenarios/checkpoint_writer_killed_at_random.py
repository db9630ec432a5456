"""Asserted by tests/callbacks/test_callbacks_fault.py.

Kill -9 at random moments of checkpoint writing (run as a script, not collected by pytest).

Usage: python tests/scenarios/checkpoint_writer_killed_at_random.py DIR TRIALS SEED OUT.json
TensorFlow is imported once, here; each trial forks a writer that saves large checkpoints (16 MiB,
every value equal to the step) back to back, keeping the last two, and SIGKILLs it after a random
delay. After each kill every file under a checkpoint name is read back in full, `latest_checkpoint`
must name an intact one, and the stale-temp cleanup of the next run must leave no temporary file.
"""

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


def writer(first_step):
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
for _ in range(TRIALS):
    first = _files.list_checkpoints(DIRECTORY, "ckpt")[-1][0] + 1
    pid = os.fork()
    if pid == 0:
        try:
            writer(first)
        finally:
            os._exit(1)
    delay = rng.uniform(2 * save_seconds, 6 * save_seconds)
    time.sleep(delay)
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
