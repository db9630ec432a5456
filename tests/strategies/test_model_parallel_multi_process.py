"""ModelParallelStrategy over several processes: real worker processes on 127.0.0.1, 4 simulated CPUs each.

Each process is `tests/scenarios/model_parallel_multi_process_worker.py` with its cluster in TF_CONFIG (as
`tfdist-launch` gives it). Results are compared with the same model trained in one process on 8 devices and on one
device.
"""

import json
import re
import signal
import sys
import time
from pathlib import Path

import _procs
import numpy as np
import pytest

WORKER = str(Path(_procs.REPO) / "tests" / "scenarios" / "model_parallel_multi_process_worker.py")
HYBRID, ACROSS = "batch:2,model:4", "batch:1,model:8"
LOSS_RTOL = 1e-4
WEIGHT_ATOL = 1e-4  # Adam, 8 steps at lr 1e-2: the sums run in other orders on a mesh
SHARDED = ("token_embedding/embeddings", "attention/query/kernel", "mlp_in/kernel", "mlp_out/kernel", "logits/kernel")


def _start(procs, addresses, out, mode, **opts):
    """Starts one process of a cluster per address; returns their indices."""
    from tfdist import cluster as cluster_lib

    indices = []
    for i in range(len(addresses)):
        tf_config = cluster_lib.Cluster(workers=addresses, task_index=i).to_tf_config()
        args = [f"{k}={v}" for k, v in opts.items()]
        cmd = [sys.executable, WORKER, f"{out}{i}.npz", mode, *args]
        indices.append(procs.start(cmd, _procs.clean_env(TF_CONFIG=tf_config)))
    return indices


def _single_cmd(out, mode, **opts):
    return [sys.executable, WORKER, str(out), mode, *(f"{k}={v}" for k, v in opts.items())]


def _single(out, mode, *, timeout=300, **opts):
    result = _procs.run(_single_cmd(out, mode, **opts), timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return dict(np.load(out))


def _weights(result, prefix="w"):
    keys = [k for k in result if re.fullmatch(prefix + r"\d+", k)]
    return [result[k] for k in sorted(keys, key=lambda k: int(k[len(prefix) :]))]


REFERENCES = {"one": {"mesh": "none", "local": 1}, "single8": {"mesh": HYBRID, "local": 8}}


@pytest.fixture(scope="module")
def reference_procs(tmp_path_factory):
    """Starts the same training in one process: on one device, and on 8 devices with the hybrid mesh.

    Each in its own process (their devices differ); they train while the first 2-process run does.
    """
    tmp = tmp_path_factory.mktemp("references")
    procs = _procs.Procs(tmp)
    try:
        for name, opts in REFERENCES.items():
            procs.start(_single_cmd(tmp / f"{name}.npz", "reference", **opts), _procs.clean_env())
        yield tmp, procs
    finally:
        procs.kill_all()


@pytest.fixture(scope="module")
def references(reference_procs):
    """The reference runs' results, by name (see `reference_procs`)."""
    tmp, procs = reference_procs
    codes = procs.wait(timeout=300)
    assert codes == [0] * len(REFERENCES), [procs.log(i)[-3000:] for i in range(len(REFERENCES))]
    return {name: dict(np.load(tmp / f"{name}.npz")) for name in REFERENCES}


@pytest.fixture(scope="module")
def load_procs(tmp_path_factory):
    """Where `hybrid_run` starts the process that loads its checkpoints (`loaded`), killed by PID at teardown."""
    procs = _procs.Procs(tmp_path_factory.mktemp("load"))
    yield procs
    procs.kill_all()


ONTO = f"{HYBRID};batch:4,model:2;none"


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory, reference_procs, load_procs):
    """2 processes x 4 devices, {"batch": 2, "model": 4}, checkpoints written to a shared directory.

    Input: a tf.data pipeline per process that yields only its rows of each global batch (sharding="off").
    Started after the reference runs (`reference_procs`), which train meanwhile. Once it ends, one process
    (8 devices) starts loading its checkpoints onto the meshes `ONTO` while the next tests run (`loaded`).
    """
    tmp = tmp_path_factory.mktemp("hybrid")
    procs = _procs.Procs(tmp)
    try:
        _start(procs, _procs.workers(2), tmp / "w", "fit", mesh=HYBRID, ckpt=tmp / "ckpt", tfdata="own",
               sharding="off")
        codes = procs.wait(timeout=300)
        assert codes == [0, 0], [procs.log(i)[-3000:] for i in range(2)]
        assert not any("DataShardingWarning" in procs.log(i) for i in range(2))
        load = _single_cmd(load_procs.tmp_path / "load.npz", "load", mesh="none", local=8, ckpt=tmp / "ckpt", onto=ONTO)
        load_procs.start(load, _procs.clean_env())
        return tmp, [dict(np.load(tmp / f"w{i}.npz")) for i in range(2)]
    finally:
        procs.kill_all()


@pytest.fixture(scope="module")
def loaded(hybrid_run, load_procs):
    """What the process that `hybrid_run` started found in the checkpoints, loaded onto each mesh of `ONTO`."""
    assert load_procs.wait(timeout=300) == [0], load_procs.log(0)[-3000:]
    return dict(np.load(load_procs.tmp_path / "load.npz"))


def _check_matches(results, references, fraction):
    for r in results:
        np.testing.assert_array_equal(r["loss"], results[0]["loss"])  # every process reports the same losses
        for a, b in zip(_weights(results[0]), _weights(r)):
            np.testing.assert_array_equal(a, b)
        for ref in references.values():
            np.testing.assert_allclose(r["loss"], ref["loss"], rtol=LOSS_RTOL)
            np.testing.assert_allclose(r["eval_loss"], ref["eval_loss"], rtol=LOSS_RTOL)
            for a, b in zip(_weights(ref), _weights(r)):
                np.testing.assert_allclose(b, a, rtol=0, atol=WEIGHT_ATOL)
            np.testing.assert_allclose(r["pred"], ref["pred"], rtol=0, atol=WEIGHT_ATOL)
        fractions = json.loads(str(r["fractions"]))
        for path, got in fractions.items():
            want = fraction if any(path.endswith(s) for s in SHARDED) else None
            if want is not None:
                assert got == want, (path, got, want)
        assert sum(got == fraction for got in fractions.values()) >= len(SHARDED)
    # It trained: the comparison is not trivially true.
    assert results[0]["loss"][-1] < results[0]["loss"][0] - 0.05


def test_hybrid_mesh_matches_one_process_and_one_device(hybrid_run, references):
    """Model split within each process, batch split across the two: kernels hold 1/4 per device."""
    _, results = hybrid_run
    _check_matches(results, references, 0.25)


def test_model_split_across_processes_matches(procs, tmp_path, references):
    """{"batch": 1, "model": 8}: activations and weight shards cross processes; kernels hold 1/8 per device."""
    _start(procs, _procs.workers(2), tmp_path / "w", "fit", mesh=ACROSS)
    assert procs.wait(timeout=300) == [0, 0], [procs.log(i)[-3000:] for i in range(2)]
    _check_matches([dict(np.load(tmp_path / f"w{i}.npz")) for i in range(2)], references, 0.125)


def test_checkpoint_of_two_processes_loads_on_other_meshes_and_one_device(hybrid_run, loaded):
    """.keras, .weights.h5, tf.train.Checkpoint, Keras' ModelCheckpoint, tfdist's Checkpoint of the 2-process run.

    Every process gathers the shards; one writes each shared file (worker 0's paths; Keras' callback elects
    the writer of its shared directory).
    """
    _, results = hybrid_run
    saved = _weights(results[0])
    for name in ONTO.split(";"):
        for kind in ("keras", "h5", "tf", "callback", "tfdist"):
            got = [loaded[f"{name}/{kind}{i}"] for i in range(len(saved))]
            for a, b in zip(saved, got):
                np.testing.assert_array_equal(a, b)
        slots = _weights(results[0], "opt")  # tfdist's Checkpoint holds the optimizer state too
        for i, want in enumerate(slots):
            np.testing.assert_array_equal(loaded[f"{name}/tfdist_opt{i}"], want)
        np.testing.assert_allclose(loaded[f"{name}/pred"], results[0]["pred"], rtol=0, atol=1e-5)


def test_conv_rules_across_processes_match_one_device(procs, tmp_path):
    """A tutorial-shaped CNN with tfdist.layouts.conv() on {"batch": 2, "model": 4} over 2 processes.

    Input: the same tf.data pipeline of global batches on each process; each keeps its rows (DATA sharding,
    with the DataShardingWarning of sharding="auto").
    """
    _start(procs, _procs.workers(2), tmp_path / "w", "conv", mesh=HYBRID, tfdata="global")
    one = _single(tmp_path / "one.npz", "conv", mesh="none", local=1)  # while the 2 processes train
    assert procs.wait(timeout=300) == [0, 0], [procs.log(i)[-3000:] for i in range(2)]
    assert all("DataShardingWarning" in procs.log(i) for i in range(2))
    for i in range(2):
        r = dict(np.load(tmp_path / f"w{i}.npz"))
        np.testing.assert_allclose(r["loss"], one["loss"], rtol=LOSS_RTOL)
        for a, b in zip(_weights(one), _weights(r)):
            np.testing.assert_allclose(b, a, rtol=0, atol=WEIGHT_ATOL)
        assert min(json.loads(str(r["fractions"])).values()) < 1.0  # something is split


@pytest.mark.serial  # bounds how long the survivor takes to end
def test_killed_process_ends_the_other_within_60s_naming_it(procs, tmp_path):
    addresses = _procs.workers(2)
    indices = _start(procs, addresses, tmp_path / "w", "fit", mesh=HYBRID, epochs=1000, heartbeat=5)
    deadline = time.monotonic() + 240
    while "TRAINING 1" not in procs.log(1) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "TRAINING 1" in procs.log(1), procs.log(1)[-3000:]
    procs.procs[indices[1]].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    code = procs.wait([indices[0]], timeout=60)[0]
    took = time.monotonic() - killed
    log = procs.log(0)
    assert code is not None and code != 0, f"worker 0 still running {took:.0f}s after worker 1 was killed"
    assert took < 60
    assert "tfdist.ModelParallelStrategy: worker 0 (" in log and f"lost worker 1 ({addresses[1]})" in log, log[-3000:]


def test_backup_and_restore_resumes_exactly_after_a_kill(procs, tmp_path, hybrid_run):
    """Worker 0 SIGKILLs itself at step 5 of 8; both are relaunched and resume from the last backup."""
    backup = tmp_path / "backup"
    addresses = _procs.workers(2)
    _start(procs, addresses, tmp_path / "a", "backup", mesh=HYBRID, backup=backup, kill_at=5, heartbeat=3)
    codes = procs.wait(timeout=240)
    assert codes[0] == -signal.SIGKILL and codes[1] not in (None, 0), [procs.log(i)[-2000:] for i in range(2)]
    _start(procs, _procs.workers(2), tmp_path / "b", "backup", mesh=HYBRID, backup=backup)
    codes = procs.wait([2, 3], timeout=240)
    assert codes == [0, 0], [procs.log(i)[-3000:] for i in (2, 3)]
    _, uninterrupted = hybrid_run
    for i in range(2):
        resumed = dict(np.load(tmp_path / f"b{i}.npz"))
        for a, b in zip(_weights(uninterrupted[0]), _weights(resumed)):
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


def test_last_batch_that_does_not_split_runs_whole_on_every_device(procs, tmp_path):
    """65 examples in batches of 16: the last batch (1 example) does not split over the batch axis (2).

    Every device of both processes computes it whole: the training equals one device's on the 65 examples.
    """
    _start(procs, _procs.workers(2), tmp_path / "w", "fit", mesh=HYBRID, examples=65)
    one = _single(tmp_path / "one.npz", "reference", mesh="none", local=1, examples=65)
    assert procs.wait(timeout=240) == [0, 0], [procs.log(i)[-3000:] for i in range(2)]
    for i in range(2):
        result = dict(np.load(tmp_path / f"w{i}.npz"))
        np.testing.assert_allclose(result["loss"], one["loss"], rtol=LOSS_RTOL)
        for a, b in zip(_weights(one), _weights(result)):
            np.testing.assert_allclose(b, a, rtol=0, atol=WEIGHT_ATOL)


@pytest.mark.serial  # a step timeout of its own, bounded
def test_stuck_process_ends_the_other_after_the_step_timeout(procs, tmp_path):
    """Worker 1 stops taking steps but stays alive (heartbeats go on): worker 0's step overruns `timeout`."""
    addresses = _procs.workers(2)
    indices = _start(procs, addresses, tmp_path / "w", "fit", mesh=HYBRID, epochs=1000, stall=600, timeout=15)
    deadline = time.monotonic() + 240
    while "TRAINING 1" not in procs.log(1) and time.monotonic() < deadline:
        time.sleep(0.2)
    stalled = time.monotonic()
    code = procs.wait([indices[0]], timeout=90)[0]
    took = time.monotonic() - stalled
    assert code not in (None, 0), f"worker 0 still running {took:.0f}s after worker 1 stalled"
    # The test sees the stall a little after worker 0's step began waiting: `took` can be slightly under 15 s.
    assert 10 <= took < 60, took
    log = procs.log(0)
    assert "a distributed step has run for more than timeout=15s" in log
    # Before it was killed, worker 0's flight recorder said what it waited in (its watchdog waited for that).
    head = f"tfdist flight recorder: worker 0 ({addresses[0]}): a distributed step has run for more than timeout=15s"
    assert head in log and log.index(head) < log.index("Ending this process."), log[-3000:]
    assert re.search(r"\n  waiting in: train step \d+, for 1\d\.\d s\n", log[log.index(head) :]), log[-3000:]


@pytest.mark.serial  # a join timeout of its own, bounded
def test_peers_that_never_come_end_the_process_after_join_timeout(procs, tmp_path):
    """Worker 0 of one cluster and worker 1 of another start alone: each ends naming itself after 10 s."""
    from tfdist import cluster as cluster_lib

    started = {}
    for present in (0, 1):
        addresses = _procs.workers(2)
        tf_config = cluster_lib.Cluster(workers=addresses, task_index=present).to_tf_config()
        cmd = [sys.executable, WORKER, str(tmp_path / f"w{present}.npz"), "fit", f"mesh={HYBRID}"]
        started[present] = (procs.start(cmd, _procs.clean_env(TF_CONFIG=tf_config, TFDIST_JOIN_TIMEOUT="10")),
                            addresses[present])
    start = time.monotonic()
    codes = procs.wait([i for i, _ in started.values()], timeout=60)
    took = time.monotonic() - start
    assert all(c not in (None, 0) for c in codes) and took < 60, (codes, took)
    for present, (i, address) in started.items():
        assert f"worker {present} ({address})" in procs.log(i), procs.log(i)[-3000:]
        assert "join" in procs.log(i)


BAD_INPUT = r"""
import os, sys
import tfdist
from tfdist import cluster as cluster_lib
tfdist.simulate_devices(4)
two = cluster_lib.Cluster(workers=("127.0.0.1:1", "127.0.0.1:2"), task_index=1)

def expect(check, call, *needles):
    try:
        call()
    except Exception as e:
        text = f"{type(e).__name__}: {e}"
        missing = [n for n in needles if n not in text]
        print(check, "OK" if not missing else f"MISSING {missing} IN {text}")
    else:
        print(check, "NO ERROR")

expect("size", lambda: tfdist.ModelParallelStrategy(mesh={"batch": 2, "model": 2}, cluster=two),
       "needs 4 devices", "2 processes", "have 4 each", "8")
expect("rows", lambda: tfdist.ModelParallelStrategy(mesh={"batch": 12, "model": 2},
       devices=["CPU:0", "CPU:1", "CPU:2"], cluster=cluster_lib.Cluster(
           workers=("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:4", "127.0.0.1:5", "127.0.0.1:6",
                    "127.0.0.1:7", "127.0.0.1:8"), task_index=0)),
       "parts of several rows", "3 devices")
os.environ["DTENSOR_NUM_CLIENTS"] = "3"
expect("env", lambda: tfdist.ModelParallelStrategy(mesh={"batch": 2, "model": 4}, cluster=two),
       "DTENSOR_NUM_CLIENTS='3'", "'2'", "127.0.0.1:2")
del os.environ["DTENSOR_NUM_CLIENTS"]
import tensorflow as tf
tf.constant(1.0) + 1  # TensorFlow's runtime starts
expect("late", lambda: tfdist.ModelParallelStrategy(mesh={"batch": 2, "model": 4}, cluster=two),
       "already initialized", "worker 1", "first thing")
"""


def test_bad_input_gets_clear_errors(python_subprocess):
    result = python_subprocess(BAD_INPUT, timeout=120)
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.split(" ", 1)[0] in (
        "size", "rows", "env", "late"))
    assert lines == {k: "OK" for k in ("size", "rows", "env", "late")}, result.stdout + result.stderr[-3000:]


def test_a_poisoned_call_naming_no_task_is_explained_by_the_peer_that_no_longer_listens():
    """A call cancelled after a peer's failure ("Function was cancelled before it was started") names no task."""
    import socket
    import types

    from tensorflow.python.framework import errors

    from tfdist import cluster as cluster_lib
    from tfdist.strategies.model_parallel import multi_process

    listening, peer = socket.socket(), socket.socket()
    for s in (listening, peer):
        s.bind(("127.0.0.1", 0))
        s.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    alive, other = (f"127.0.0.1:{s.getsockname()[1]}" for s in (listening, peer))
    try:
        cancelled = errors.CancelledError(None, None, "Function was cancelled before it was started")
        cluster = cluster_lib.Cluster(workers=[alive, other, dead], task_index=0)
        me = types.SimpleNamespace(_cluster=cluster, _me=f"worker 0 ({alive})")
        explained = multi_process.ProcessWatchdog._explain(me, cancelled)
        assert isinstance(explained, errors.CancelledError)
        assert explained.message.startswith(f"tfdist.ModelParallelStrategy: worker 0 ({alive}) lost worker 2 ({dead}) ")
        every_peer_listens = cluster_lib.Cluster(workers=[alive, other], task_index=0)
        me = types.SimpleNamespace(_cluster=every_peer_listens, _me=f"worker 0 ({alive})")
        assert multi_process.ProcessWatchdog._explain(me, cancelled) is None
    finally:
        listening.close()
        peer.close()
