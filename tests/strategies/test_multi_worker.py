"""tfdist.MultiWorkerStrategy with real worker processes on 127.0.0.1.

Each test starts plain subprocesses (tests/scenarios/multi_worker_fit.py, `_procs.WORKER`) with their own
TF_CONFIG on free loopback ports, bounds them with a hard timeout, and kills them (by process group) in teardown.
The 2-worker fit cases share one pair of workers, which trains them one after the other (`two_worker_runs`).
Weights are compared with a single-process Keras run on the same global batch.
"""

import dataclasses
import re
import sys
import time

import _procs
import numpy as np
import pytest

import tfdist
from tfdist import _compat

ATOL = 1e-6


# Worker options of each reference run: dataset size, and Keras features used with the strategy.
CONFIGS = {
    "n20": {"n": 20},
    "n23": {"n": 23},
    "features": {"n": 23, "spe": 2, "clip": 0.5, "val": 1},  # steps_per_execution, clipnorm, validation
    # gradient accumulation over 3 steps (each worker accumulates locally, all-reduces on the update step)
    "accumulate": {"n": 23, "accum": 3, "clip": 0.5},
    # jit_compile=True: each worker's replica step compiled with XLA (the reference compiled too)
    "xla": {"n": 23, "jit": 1, "clip": 0.5},
    # BatchNormalization after the first layer: with batch_statistics="global", the global batch's moments
    "bn": {"n": 23, "bn": 1},
}


def _run(name, opts):
    """One run of several in one worker process: `NAME:key=value,...` (tests/scenarios/multi_worker_fit.py)."""
    return f"{name}:" + ",".join(f"{k}={v}" for k, v in opts.items())


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Single-process runs (no strategy), by config name: one process trains them one after the other."""
    tmp = tmp_path_factory.mktemp("reference")
    p = _procs.Procs(tmp)
    runs = [_run(name, opts) for name, opts in CONFIGS.items()]
    try:
        p.start([sys.executable, _procs.WORKER, str(tmp), "references", *runs], _procs.clean_env())
        codes = p.wait(timeout=240)
        assert codes == [0], p.log(0)[-3000:]
    finally:
        p.kill_all()
    return {name: dict(np.load(tmp / f"{name}.npz")) for name in CONFIGS}


# The 2-worker cases of test_fit_evaluate_predict_match_single_process, by (config, tfdata): one pair of workers
# trains them one after the other under one strategy (each from the same seed, as the references are).
TWO_WORKER_RUNS = {
    ("n23", ""): "n23",
    ("n23", "1"): "n23-tfdata",
    ("features", ""): "features",
    ("accumulate", ""): "accumulate",
    ("xla", ""): "xla",
}


@pytest.fixture(scope="module")
def two_worker_runs(tmp_path_factory):
    """{(config, tfdata): (each worker's results, worker 0's log of that run)} from one pair of workers."""
    tmp = tmp_path_factory.mktemp("two_workers")
    p = _procs.Procs(tmp)
    addresses = _procs.workers(2)
    runs = [_run(name, {"batch": 6, "epochs": 2, "tfdata": tfdata, **CONFIGS[config]})
            for (config, tfdata), name in TWO_WORKER_RUNS.items()]
    try:
        for i in range(2):
            (tmp / f"w{i}").mkdir()
            p.start_worker(addresses, i, tmp / f"w{i}", "multis", *runs)
        codes = p.wait(timeout=400)
        assert codes == [0, 0], [p.log(i)[-3000:] for i in range(2)]
        log = p.log(0)
    finally:
        p.kill_all()
    parts = re.split(r"^run (\S+) begins\n", log, flags=re.MULTILINE)  # [before, name, its log, name, ...]
    assert parts[1::2] == list(TWO_WORKER_RUNS.values()), log[-3000:]
    segments = dict(zip(parts[1::2], parts[2::2]))
    return {key: ([dict(np.load(tmp / f"w{i}" / f"{name}.npz")) for i in range(2)], segments[name])
            for key, name in TWO_WORKER_RUNS.items()}


def _weights(result):
    return [result[k] for k in sorted(result) if k.startswith("arr_")]


@pytest.mark.parametrize(
    "num_workers, config, tfdata",
    [
        (2, "n23", ""),  # numpy input; 6,6,6,5 examples per step: the last step splits 3/2
        (3, "n20", ""),  # 6,6,6,2: the last step splits 1/1/0 (one worker has no example)
        (2, "n23", "1"),  # an in-memory tf.data pipeline batched by the global batch
        (2, "features", ""),
        (2, "accumulate", ""),
        (2, "xla", ""),
    ],
)
def test_fit_evaluate_predict_match_single_process(procs, references, request, tmp_path, num_workers, config,
                                                   tfdata):
    if num_workers == 2:  # trained with the other 2-worker cases by one pair of workers
        results, log = request.getfixturevalue("two_worker_runs")[config, tfdata]
    else:
        addresses = _procs.workers(num_workers)
        outs = [tmp_path / f"w{i}.npz" for i in range(num_workers)]
        for i in range(num_workers):
            procs.start_worker(addresses, i, outs[i], "multi", batch=6, epochs=2, tfdata=tfdata, **CONFIGS[config])
        codes = procs.wait(timeout=240)
        assert codes == [0] * num_workers, [procs.log(i)[-3000:] for i in range(num_workers)]
        results, log = [dict(np.load(o)) for o in outs], procs.log(0)
    # Keras shards numpy input by DATA itself; a tf.data pipeline without files gets the warning.
    assert ("DataShardingWarning" in log) == bool(tfdata)
    ref = references[config]
    for r in results:
        # Identical on every worker, bit for bit.
        for a, b in zip(_weights(results[0]), _weights(r)):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(_weights(ref), _weights(r)):
            np.testing.assert_allclose(b, a, rtol=0, atol=ATOL)
        np.testing.assert_allclose(r["loss"], ref["loss"], rtol=1e-5)
        np.testing.assert_allclose(r["eval_loss"], ref["eval_loss"], rtol=1e-5)
        np.testing.assert_allclose(r["val_loss"], ref["val_loss"], rtol=1e-5)
        np.testing.assert_allclose(r["pred"], ref["pred"], rtol=0, atol=ATOL)
        assert int(r["xla_calls"]) == (1 if config == "xla" else 0)
    # The reference itself moved: the comparison is not trivially true.
    assert max(np.abs(w).max() for w in _weights(ref)) > 0.1


def test_batch_normalization_with_global_statistics_matches_single_process(procs, references, tmp_path):
    # 6, 6, 6, 5 examples a step over 2 workers: the last step's moments come from 3 + 2 examples, weighted as
    # one device's 5. The moving mean and variance are weights too: compared with the rest.
    addresses = _procs.workers(2)
    outs = [tmp_path / f"w{i}.npz" for i in range(2)]
    for i in range(2):
        procs.start_worker(addresses, i, outs[i], "multi", batch=6, epochs=2, bstats="global", **CONFIGS["bn"])
    codes = procs.wait(timeout=240)
    assert codes == [0, 0], [procs.log(i)[-3000:] for i in range(2)]
    ref = references["bn"]
    assert len(_weights(ref)) == 8  # 2 kernels, 2 biases, gamma, beta, moving mean and variance
    for r in map(np.load, outs):
        for a, b in zip(_weights(ref), _weights(dict(r))):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=ATOL)
        np.testing.assert_allclose(r["loss"], ref["loss"], rtol=1e-5)
        np.testing.assert_allclose(r["pred"], ref["pred"], rtol=0, atol=1e-5)
    assert "compute from the batch" not in procs.log(0)  # no per-replica warning under "global"


def test_bfloat16_gradient_all_reduce(procs, references, tmp_path):
    addresses = _procs.workers(2)
    outs = [tmp_path / f"w{i}.npz" for i in range(2)]
    for i in range(2):
        procs.start_worker(addresses, i, outs[i], "multi", gdtype="bfloat16", **CONFIGS["n23"])
    assert procs.wait(timeout=240) == [0, 0], [procs.log(i)[-3000:] for i in range(2)]
    w0, w1 = (_weights(dict(np.load(o))) for o in outs)
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)
    drift = max(np.abs(a - b).max() for a, b in zip(w0, _weights(references["n23"])))
    # bfloat16 keeps 8 bits of mantissa: the weights move, but only a little, in 8 SGD steps.
    assert 1e-5 < drift < 1e-2, drift


def _kill_time(log):
    m = re.search(r"worker dies at ([0-9.]+)", log)
    assert m, log[-2000:]
    return float(m.group(1))


@pytest.mark.serial  # bounds how long the survivors take to end (heartbeat 5 s)
def test_killed_worker_ends_the_others_within_60s(procs, tmp_path):
    addresses = _procs.workers(3)
    for i in range(3):
        procs.start_worker(addresses, i, tmp_path / f"w{i}.npz", "die", die_rank=1, epochs=1000, heartbeat=5)
    codes = procs.wait(timeout=150)
    assert codes[1] == 17, procs.log(1)[-2000:]
    died = _kill_time(procs.log(1))
    for i in (0, 2):
        assert codes[i] not in (None, 0), procs.log(i)[-2000:]
        assert procs.ended[i] - died < 60, procs.ended[i] - died
        assert re.search(r"UnavailableError|unhealthy|Socket closed", procs.log(i)), procs.log(i)[-2000:]


@pytest.mark.serial  # a step timeout of 8 s
def test_stuck_worker_ends_in_collective_timeout(procs, tmp_path):
    addresses = _procs.workers(2)
    for i in range(2):
        procs.start_worker(addresses, i, tmp_path / f"w{i}.npz", "stuck", die_rank=1, epochs=1000, timeout=8)
    start = time.time()
    codes = procs.wait([0], timeout=120)
    assert codes[0] not in (None, 0), procs.log(0)[-2000:]
    assert "DeadlineExceededError" in procs.log(0), procs.log(0)[-3000:]
    assert "a distributed step ran for more than timeout=8s" in procs.log(0), procs.log(0)[-3000:]
    assert procs.ended[0] - start < 90
    assert "worker is stuck now" in procs.log(1)  # teardown kills it


@pytest.mark.serial  # a join timeout of 5 s
def test_absent_peers_are_bounded(procs, tmp_path):
    # Worker 0 (TensorFlow's coordination leader) and worker 1 each wait for a peer that never comes.
    leader = procs.start_worker(_procs.workers(2), 0, tmp_path / "a.npz", "multi", join=5)
    follower = procs.start_worker(_procs.workers(2), 1, tmp_path / "b.npz", "multi", join=5)
    start = time.time()
    codes = procs.wait(timeout=90)
    assert codes[leader] == -9, procs.log(leader)[-2000:]  # killed by the join watchdog
    assert "not every worker joined within 15s" in procs.log(leader)
    assert codes[follower] == 1, procs.log(follower)[-2000:]
    assert "could not join the cluster within join_timeout=5s" in procs.log(follower)
    assert max(procs.ended) - start < 60


def test_multi_worker_hooks_are_registered_and_checked(monkeypatch):
    names = {h.name for h in _compat.hooks_for("multi_worker")}
    assert {"multi_worker_reduce", "multi_worker_check", "symbolic_build"} <= names
    _compat.check_hooks()
    broken = "a line Keras never had"
    hooks = tuple(
        dataclasses.replace(h, needles=h.needles + (broken,)) if h.name == "multi_worker_reduce" else h
        for h in _compat.HOOKS
    )
    monkeypatch.setattr(_compat, "HOOKS", hooks)
    with pytest.raises(_compat.CompatError, match="multi_worker_reduce"):
        _compat.check_hooks()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"communication": "nccl2"}, r"communication='nccl2'.*\('auto', 'ring', 'nccl'\)"),
        ({"communication": "nccl"}, r"'nccl' needs GPUs, and this machine has none"),
        ({"timeout": 0}, r"timeout=0"),
        ({"heartbeat_timeout": -1}, r"heartbeat_timeout=-1"),
        ({"join_timeout": "10"}, r"join_timeout='10'"),
        ({"cluster": {"worker": ["a:1"]}}, r"Expected a tfdist.cluster.Cluster"),
        ({"gradient_dtype": "float8"}, r"gradient_dtype='float8'.*\(None, 'bfloat16', 'float16'\)"),
        ({"sharding": "files"}, r"sharding='files'.*\('auto', 'file', 'data', 'off'\)"),
    ],
)
def test_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tfdist.MultiWorkerStrategy(**kwargs)


def test_sharding_policy(tmp_path):
    import tensorflow as tf

    from tfdist.strategies import multi_worker

    policy = tf.data.experimental.AutoShardPolicy
    files = [str(tmp_path / f"part{i}.txt") for i in range(2)]
    for f in files:
        tf.io.write_file(f, "a\nb\n")
    from_files = tf.data.Dataset.list_files(files).interleave(tf.data.TextLineDataset).batch(2)
    records = tf.data.TFRecordDataset(files)
    in_memory = tf.data.Dataset.range(10).map(lambda v: v * 2).batch(2)
    assert multi_worker.reads_files(from_files) and multi_worker.reads_files(records)
    assert not multi_worker.reads_files(in_memory)

    def chosen(ds, sharding="auto"):
        return multi_worker.shard_dataset(ds, sharding, 2).options().experimental_distribute.auto_shard_policy

    assert chosen(from_files) == policy.FILE
    with pytest.warns(multi_worker.DataShardingWarning, match="each of the 2 workers reads all of it"):
        assert chosen(in_memory) == policy.DATA
    assert chosen(in_memory, "off") == policy.OFF
    assert chosen(from_files, "data") == policy.DATA
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy.OFF
    assert chosen(in_memory.with_options(options)) == policy.OFF  # the dataset's own choice wins


def test_a_port_in_use_is_named(tmp_path):
    # A TF_CONFIG address whose port another process listens on: TensorFlow says only
    # "UnknownError: Could not start gRPC server".
    import socket
    import subprocess
    import sys

    from tfdist import cluster as cluster_lib

    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        tf_config = cluster_lib.Cluster(workers=(f"127.0.0.1:{port}", "127.0.0.1:1"), task_index=0).to_tf_config()
        done = subprocess.run(
            [sys.executable, "-m", "tfdist.train", "--strategy=multi_worker", f"--model_dir={tmp_path}"],
            env=_procs.clean_env(TF_CONFIG=tf_config),
            cwd=_procs.REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tfdist-train: error:") and f"port {port}" in last and "in use" in last, last


@pytest.mark.serial  # a step deadline of 0.5 s
def test_step_deadline_aborts_only_functions_with_collectives(python_subprocess):
    # In its own process: aborting collectives poisons them for the rest of the process.
    done = python_subprocess(
        """
        import tfdist
        tfdist.simulate_devices(2)
        import time
        import tensorflow as tf
        from tfdist._compat import step_deadline
        from tfdist.strategies import _deadline

        step_deadline.set_step_deadline(_deadline.StepDeadline(timeout=0.5, what="this test"))

        def slow(x):
            time.sleep(1.5)
            return x

        @tf.function
        def no_collectives(x):
            return tf.py_function(slow, [x], tf.float32)

        print("plain", float(no_collectives(tf.constant(1.0))))  # 1.5 s, not aborted
        strategy = tfdist.DataParallelStrategy(communication="ring")  # ring: collective ops ("auto" sums on CPU:0)

        @tf.function
        def with_collectives(x):
            def replica(x):
                return tf.distribute.get_replica_context().all_reduce("sum", tf.py_function(slow, [x], tf.float32))
            return strategy.run(replica, args=(x,))

        try:
            with_collectives(tf.constant(1.0))
        except tf.errors.DeadlineExceededError as e:
            expected = "this test: a distributed step ran for more than timeout=0.5s"
            print("aborted, message names the deadline:", expected in e.message)
        """,
        timeout=120,
    )
    assert "plain 1.0" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "aborted, message names the deadline: True" in done.stdout, (
        done.stdout + done.stderr[-3000:]
    )
