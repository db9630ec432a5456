"""Fault tests of tfdist.callbacks with real processes: crashes, SIGTERM, kill -9 mid-write.

Every process runs in its own session with a hard timeout and is killed by process group in
teardown. The uninterrupted reference is a single-process run with the same seed and global batch.
"""

import contextlib
import json
import os
import signal
import sys
import textwrap
import time

import _procs
import numpy as np
import pytest

WORKER = os.path.join(_procs.REPO, "tests", "scenarios", "callbacks_training_with_faults.py")
ATOL = 1e-5  # the bar for SGD; measured differences are ~6e-7


def _start(procs, out, mode, addresses=None, index=0, **opts):
    env = _procs.clean_env()
    if addresses is not None:
        from tfdist import cluster as cluster_lib

        env["TF_CONFIG"] = cluster_lib.Cluster(workers=addresses, task_index=index).to_tf_config()
    return procs.start([sys.executable, WORKER, str(out), mode, *[f"{k}={v}" for k, v in opts.items()]], env)


def _wait_for(procs, i, text, timeout=90.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in procs.log(i):
            return
        assert procs.procs[i].poll() is None, procs.log(i)[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"process {i} never printed {text!r}: {procs.log(i)[-3000:]}")


def _weights(path):
    result = np.load(path)
    return [result[k] for k in sorted(result.files) if k.startswith("arr_")], int(result["steps"])


def _assert_same(path, reference):
    got, steps = _weights(path)
    want, want_steps = _weights(reference)
    assert steps == want_steps == 15
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)
    # The resumed epoch's logs include its batches from before the restart (restored metric state).
    for key in ("loss", "mae"):
        np.testing.assert_allclose(np.load(path)[key][-1], np.load(reference)[key][-1], rtol=1e-5)


def test_data_parallel_crash_then_sigterm_then_resume_equals_uninterrupted(procs, tmp_path):
    backup = tmp_path / "backup"
    opts = {"backup": backup, "save_freq": 2, "shuffle": 1}  # 5 steps per epoch, 3 epochs
    ref = _start(procs, tmp_path / "ref.npz", "single", shuffle=1)
    # Run 1 dies (os._exit) after step 7; its newest backup is step 6 (epoch 1, batch 1).
    first = _start(procs, tmp_path / "x.npz", "data", crash_at=7, **opts)
    assert procs.wait([ref, first], timeout=150) == [0, 17], procs.log(first)[-3000:]
    assert sorted(os.listdir(backup / "worker-0")) == ["backup-000000004.npz", "backup-000000006.npz"]
    # Run 2 resumes at step 6 and gets SIGTERM after step 11: it saves step 11 and exits 0.
    second = _start(procs, tmp_path / "x.npz", "data", term_at=11, **opts)
    _wait_for(procs, second, "waiting for SIGTERM")
    sent = time.monotonic()
    procs.procs[second].send_signal(signal.SIGTERM)
    assert procs.wait([second], timeout=60) == [0], procs.log(second)[-3000:]
    assert time.monotonic() - sent < 30
    assert "saved step 11 (epoch 2, batch 1)" in procs.log(second)
    assert "restored step" not in procs.log(second)  # code after fit did not run
    # Run 3 resumes at step 11 and finishes; the backups are deleted at the end.
    third = _start(procs, tmp_path / "x.npz", "data", **opts)
    assert procs.wait([third], timeout=120) == [0], procs.log(third)[-3000:]
    assert "restored step 11" in procs.log(third)
    assert not backup.exists()
    _assert_same(tmp_path / "x.npz", tmp_path / "ref.npz")


@pytest.mark.serial  # bounds the seconds from SIGTERM to the save
def test_multi_worker_crash_and_sigterm_to_one_worker_resume_equals_uninterrupted(procs, tmp_path):
    backup, ckpt = tmp_path / "backup", tmp_path / "ckpt"
    opts = {"backup": backup, "save_freq": 2}
    outs = [tmp_path / f"w{i}.npz" for i in range(2)]
    ref = _start(procs, tmp_path / "ref.npz", "single")
    # Run 1: worker 1 dies after step 7; worker 0 is killed as a cluster manager would.
    addresses = _procs.workers(2)
    run = [_start(procs, outs[i], "multi", addresses, i, crash_rank=1, crash_at=7, **opts) for i in range(2)]
    assert procs.wait([run[1]], timeout=150) == [17], procs.log(run[1])[-3000:]
    with contextlib.suppress(ProcessLookupError):  # it may already have failed on the lost heartbeat
        os.killpg(procs.procs[run[0]].pid, signal.SIGKILL)
    assert procs.wait([ref], timeout=60) == [0]
    for i in range(2):
        assert "backup-000000006.npz" in os.listdir(backup / f"worker-{i}")
    # Run 2: SIGTERM to worker 1 only, after step 11: both workers save step 11 and exit 0.
    addresses = _procs.workers(2)
    run = [_start(procs, outs[i], "multi", addresses, i, term_rank=1, term_at=11, **opts) for i in range(2)]
    _wait_for(procs, run[1], "waiting for SIGTERM")
    procs.procs[run[1]].send_signal(signal.SIGTERM)
    assert procs.wait(run, timeout=60) == [0, 0], [procs.log(i)[-3000:] for i in run]
    for i in run:
        assert "saved step 11 (epoch 2, batch 1)" in procs.log(i)
    # Run 3: both resume at step 11 and finish, with SyncCheck, MetricAverage and a Checkpoint running.
    addresses = _procs.workers(2)
    run = [_start(procs, outs[i], "multi", addresses, i, ckpt=ckpt, **opts) for i in range(2)]
    assert procs.wait(run, timeout=150) == [0, 0], [procs.log(i)[-3000:] for i in run]
    for rank, i in enumerate(run):
        assert "restored step 11" in procs.log(i)
        assert f"topology Topology(worker_index={rank}, num_workers=2, data_parallel_size=2)" in procs.log(i)
    for out in outs:
        _assert_same(out, tmp_path / "ref.npz")
    # MetricAverage: each worker timed its own steps (Throughput), yet both logged the same averages.
    times = [np.load(out)["step_time_ms"] for out in outs]
    assert len(times[0]) == 1 and times[0][0] > 0  # the one epoch run after the restart at step 11
    np.testing.assert_array_equal(times[0], times[1])
    # The chief wrote the checkpoints (the last 2 of steps 12 and 15); the other worker left nothing behind.
    assert sorted(os.listdir(ckpt)) == ["ckpt-000000012.npz", "ckpt-000000015.npz"]
    from tfdist.callbacks import _files

    meta, arrays = _files.read_file(str(ckpt / "ckpt-000000015.npz"))
    for a, b in zip(arrays[: len(_weights(outs[0])[0])], _weights(outs[0])[0]):
        np.testing.assert_array_equal(a, b)


def test_sync_check_stops_every_worker_when_one_diverges(procs, tmp_path):
    addresses = _procs.workers(2)
    run = [_start(procs, tmp_path / f"w{i}.npz", "multi", addresses, i, sync=1, diverge_at=4) for i in range(2)]
    assert procs.wait(run, timeout=120) == [1, 1], [procs.log(i)[-3000:] for i in run]
    for i in run:
        log = procs.log(i)
        assert "SyncError: tfdist SyncCheck at step 4: variable 'sequential/dense/kernel' differs between " in log
        assert "differs between workers: worker 0 vs worker(s) [1]" in log


KILL_DURING_WRITE = """
import os, sys, time
import numpy as np
import tfdist.callbacks
import keras
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512), keras.layers.Dense(1)])
model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
x, y = np.ones((16, 64), "float32"), np.ones((16, 1), "float32")
ckpt = tfdist.callbacks.Checkpoint(sys.argv[1], every_n_epochs=1)
model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[ckpt])
np.savez(sys.argv[2], *model.get_weights())
real_fsync = os.fsync
def slow_fsync(fd):  # the second checkpoint's bytes are written; hang before the rename
    print("writing", flush=True)
    time.sleep(60)
os.fsync = slow_fsync
model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[ckpt])
print("finished", flush=True)
"""


def test_kill_9_during_checkpoint_write_leaves_previous_checkpoint_intact(procs, tmp_path):
    import tfdist.callbacks

    directory = tmp_path / "ckpt"
    i = procs.start(
        [sys.executable, "-c", textwrap.dedent(KILL_DURING_WRITE), str(directory), str(tmp_path / "first.npz")],
        _procs.clean_env(),
    )
    _wait_for(procs, i, "writing")
    os.killpg(procs.procs[i].pid, signal.SIGKILL)
    assert procs.wait([i], timeout=30) == [-signal.SIGKILL]
    # The interrupted write left only its hidden temporary file; the first checkpoint is intact.
    temp, first_ckpt = sorted(os.listdir(directory))
    assert first_ckpt == "ckpt-000000002.npz" and temp.startswith(".ckpt-000000004.npz.tmp-")
    assert tfdist.callbacks.latest_checkpoint(directory) == str(directory / "ckpt-000000002.npz")
    meta, arrays = tfdist.callbacks.checkpoint._files.read_file(str(directory / "ckpt-000000002.npz"))
    first = np.load(tmp_path / "first.npz")
    assert meta["step"] == 2
    for k, a in enumerate([first[f"arr_{j}"] for j in range(4)]):
        np.testing.assert_array_equal(arrays[k], a)
    # The next run's chief removes the stale temporary file before it writes.
    tfdist.callbacks.checkpoint._files.remove_stale_temps(str(directory))
    assert os.listdir(directory) == ["ckpt-000000002.npz"]


def test_kill_9_at_random_moments_of_checkpoint_writing_never_leaves_a_torn_checkpoint(procs, tmp_path):
    # 10 writers saving 16 MiB checkpoints back to back, each SIGKILLed after a random 2-6 saves' time, and 5
    # SIGKILLed inside their second checkpoint's write, after a random number of its bytes.
    out = tmp_path / "kills.json"
    i = procs.start(
        [
            sys.executable,
            os.path.join(_procs.REPO, "tests", "scenarios", "checkpoint_writer_killed_at_random.py"),
            str(tmp_path / "ckpt"),
            "10",
            "0",
            str(out),
        ],
        _procs.clean_env(),
    )
    assert procs.wait([i], timeout=240) == [0], procs.log(i)[-3000:]
    trials = json.loads(out.read_text())["trials"]
    assert len(trials) == 15 and all(t["killed"] for t in trials)
    for t in trials:
        assert t["finals_intact"] and t["latest_is_newest_final"] and t["latest_intact"], t
        assert t["left_after_cleanup"] == [], t
    timed, inside = trials[:10], trials[10:]
    assert all(t["mid_write"] and t["saved"] == 1 for t in inside), inside  # the torn file was the second's
    assert sum(t["saved"] for t in timed) >= 10  # the writers made progress between the kills


@pytest.mark.parametrize("tfdata", ["shuffle", "repeat"])
def test_resume_recreates_the_data_order_of_reshuffling_and_repeated_tf_data(procs, tmp_path, tfdata):
    # "shuffle": a new order at every iterator Keras makes (one per epoch, one per epoch end, one for the
    # build); "repeat": one iterator for the whole fit (steps_per_epoch=5), reshuffled at each repetition.
    # The reference is the same strategy uninterrupted: the shuffle seeds depend on the strategy's graph.
    opts = {"backup": tmp_path / "backup", "save_freq": 2, "tfdata": tfdata}
    ref = _start(procs, tmp_path / "ref.npz", "data", tfdata=tfdata)
    first = _start(procs, tmp_path / "x.npz", "data", crash_at=7, **opts)
    assert procs.wait([ref, first], timeout=150) == [0, 17], procs.log(first)[-3000:]
    resumed = _start(procs, tmp_path / "x.npz", "data", **opts)
    assert procs.wait([resumed], timeout=120) == [0], procs.log(resumed)[-3000:]
    assert "restored step 6" in procs.log(resumed)
    got, want = _weights(tmp_path / "x.npz"), _weights(tmp_path / "ref.npz")
    assert got[1] == want[1] == 15
    for a, b in zip(got[0], want[0]):
        np.testing.assert_array_equal(a, b)
