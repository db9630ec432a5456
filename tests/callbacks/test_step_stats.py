"""tfdist.callbacks.StepStats: the statistics on synthetic numbers, timings inside fit, and real 2-process runs.

The multi-process runs (`tests/scenarios/step_stats_slow_and_even_workers.py`, one after the other so that their
timings do not share the cores): two MultiWorkerStrategy workers, worker 1 sleeping DELAY_MS in its input pipeline
for every batch, then the same two processes without a delay for 200 steps; and two ModelParallelStrategy processes
(a DTensor mesh over both) with the same delay on process 1.
"""

import json
import sys
import time
import warnings

import _procs
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdist
from tfdist.callbacks import step_stats
from tfdist.strategies import topology

WORKER = f"{_procs.REPO}/tests/scenarios/step_stats_slow_and_even_workers.py"
DELAY_MS = 100.0
EVERY = 10


# ---------------------------------------------------------------- statistics on synthetic numbers
def test_summary_compares_the_slowest_own_time_with_the_median_of_the_others():
    # step, input, compute, collective (s): unit 3 waits 30 ms for input, the others wait for it in the all-reduce
    table = [
        [0.050, 0.001, 0.014, 0.035],
        [0.050, 0.002, 0.010, 0.038],
        [0.050, 0.001, 0.012, 0.037],
        [0.050, 0.030, 0.015, 0.005],
        [0.050, 0.001, 0.020, 0.029],
    ]
    s = step_stats.summarize(table, threshold=0.2, min_lag=0.005)
    np.testing.assert_allclose(s.own_time, [0.015, 0.012, 0.013, 0.045, 0.021])
    assert s.slowest == 3
    assert s.lag == pytest.approx(0.045 - 0.014)  # the median of the others' 15, 12, 13, 21 ms
    assert s.lag_fraction == pytest.approx(0.031 / 0.050)
    assert s.over_threshold
    assert not step_stats.summarize(table, threshold=0.7, min_lag=0.005).over_threshold  # 62% of the step
    assert not step_stats.summarize(table, threshold=0.2, min_lag=0.040).over_threshold  # 31 ms
    assert step_stats.summarize(table, threshold=0.0, min_lag=0.031).over_threshold


def test_summary_without_a_collective_wait_compares_input_waits():
    table = [[0.08, 0.002, 0.078, np.nan], [0.08, 0.060, 0.020, np.nan], [0.08, 0.004, 0.076, np.nan]]
    s = step_stats.summarize(table, threshold=0.2, min_lag=0.005)
    assert s.slowest == 1 and s.lag == pytest.approx(0.060 - 0.003) and s.over_threshold
    one = step_stats.summarize([[0.08, 0.06, 0.02, 0.0]], threshold=0.2, min_lag=0.005)
    assert (one.slowest, one.lag, one.over_threshold) == (0, 0.0, False)
    unmeasured = step_stats.summarize(np.full((2, 4), np.nan), threshold=0.2, min_lag=0.005)
    assert np.isnan(unmeasured.lag) and not unmeasured.over_threshold


def _reports(stats, tables):
    for table in tables:
        stats._add_report(table, step=0, steps=10, kind="worker", units=("worker 0 (h:1)", "worker 1 (h:2)"))
    return [r.straggler for r in stats.history]


def test_patience_names_the_straggler_and_warns_once_per_episode():
    slow0 = [[0.05, 0.03, 0.01, 0.00], [0.05, 0.00, 0.01, 0.03]]
    slow1 = [[0.05, 0.00, 0.01, 0.03], [0.05, 0.03, 0.01, 0.00]]
    even = [[0.05, 0.00, 0.01, 0.03], [0.05, 0.00, 0.012, 0.03]]
    stats = tfdist.callbacks.StepStats(patience=3)
    stats._where = topology.Topology(worker_index=0, num_workers=2, data_parallel_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        named = _reports(stats, [slow1, slow1, slow1, slow1, even, slow1, slow0, slow1, slow1, slow1])
    assert named == [None, None, 1, 1, None, None, None, None, None, 1]
    messages = [str(w.message) for w in caught if w.category is tfdist.callbacks.StragglerWarning]
    assert len(messages) == 2 and all(m.startswith("tfdist StepStats: worker 1 (h:2) is the slowest") for m in messages)
    assert "mostly waiting for its input" in messages[0]
    assert [r.over_threshold for r in stats.history] == [True] * 4 + [False] + [True] * 5

    stats = tfdist.callbacks.StepStats(patience=1)
    stats._where = topology.Topology(worker_index=1, num_workers=2, data_parallel_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _reports(stats, [slow0]) == [0]
    assert not caught  # only the chief warns


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every": 0}, "`every`. Received: every=0"),
        ({"patience": 1.5}, "`patience`. Received: patience=1.5"),
        ({"threshold": -0.1}, "`threshold`. Received: threshold=-0.1"),
        ({"min_lag": float("inf")}, "`min_lag`. Received: min_lag=inf"),
        ({"threshold": 0, "min_lag": 0}, "at least one of them above 0"),
        ({"log_dir": 3}, "`log_dir`. Received: log_dir=3"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tfdist.callbacks.StepStats(**kwargs)


# ---------------------------------------------------------------- inside fit, in this process
def _slow_dataset(steps, delay, batch=8):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, 4)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((x, x[:, :1] * 2.0)).batch(batch)

    def sleep(value):
        time.sleep(delay)
        return value

    data = data.map(lambda a, b: (tf.ensure_shape(tf.py_function(sleep, [a], tf.float32), a.shape), b))
    options = tf.data.Options()
    options.autotune.enabled = False
    return data.with_options(options)


def _model(strategy, **compile_kwargs):
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", **compile_kwargs)
    return model


def test_data_parallel_replicas_split_their_steps_and_train_as_without(tmp_path):
    strategy = tfdist.DataParallelStrategy(devices=["CPU:0", "CPU:1"])
    delay = 0.03
    reference = _model(strategy)
    reference.fit(_slow_dataset(20, 0.0), epochs=1, shuffle=False, verbose=0)
    model = _model(strategy)
    stats = tfdist.callbacks.StepStats(every=10, log_dir=tmp_path / "tb")
    history = model.fit(_slow_dataset(20, delay), epochs=1, shuffle=False, verbose=0, callbacks=[stats])

    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_array_equal(a, b)  # the timestamps change nothing in the step
    assert [(r.step, r.steps, r.kind) for r in stats.history] == [(10, 9, "replica"), (20, 10, "replica")]
    assert [u.split(" (")[0] for u in stats.history[0].units] == ["replica 0", "replica 1"]
    assert stats.history[0].units[1].endswith("device:CPU:1)")
    for r in stats.history:
        assert np.all(np.isfinite(r.collective_wait)) and np.all(r.collective_wait >= 0), r
        assert np.all(r.compute > 0) and np.all(r.input_wait < r.step_time), r
        assert r.straggler is None  # both replicas wait for the same host pipeline
    # The first steps may find batches drawn while the step traced; then each waits for its batch.
    assert np.all(stats.history[-1].input_wait >= 0.5 * delay), stats.history[-1]
    assert set(history.history) == {"loss", "slowest_replica", "slowest_replica_lag_ms"}
    last = stats.history[-1]
    assert history.history["slowest_replica_lag_ms"] == [pytest.approx(1e3 * last.lag)]

    tags = set()
    for path in (tmp_path / "tb").iterdir():
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            tags.update(v.tag for v in event.summary.value)
    assert {"step_stats/lag_ms", "step_stats/slowest_replica", "step_stats/replica_1/input_wait_ms"} <= tags

    timer = stats._timer
    timed = timer.calls_timed
    model.fit(_slow_dataset(3, 0.0), epochs=1, shuffle=False, verbose=0)  # a fit without StepStats: nothing is timed
    assert timer.calls_timed == timed == 20 and not timer.active


@pytest.mark.parametrize("first", ["backup", "stats"])
def test_backup_and_restore_wraps_the_timed_train_function(tmp_path, first):
    strategy = tfdist.DataParallelStrategy(devices=["CPU:0", "CPU:1"])
    model = _model(strategy)
    stats = tfdist.callbacks.StepStats(every=4)
    backup = tfdist.callbacks.BackupAndRestore(tmp_path / "backup", save_freq=4)
    callbacks = [backup, stats] if first == "backup" else [stats, backup]
    model.fit(_slow_dataset(8, 0.0), epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    assert [(r.step, r.steps) for r in stats.history] == [(4, 3), (8, 4), (12, 4), (16, 4)]  # first call: traces
    timed = stats._timer.calls_timed
    model.fit(_slow_dataset(2, 0.0), epochs=1, shuffle=False, verbose=0)
    assert stats._timer.calls_timed == timed == 16


def test_steps_per_execution_reports_per_optimizer_step():
    strategy = tfdist.DataParallelStrategy(devices=["CPU:0", "CPU:1"])
    model = _model(strategy, steps_per_execution=2)
    stats = tfdist.callbacks.StepStats(every=4)
    model.fit(_slow_dataset(9, 0.01), epochs=1, shuffle=False, verbose=0, callbacks=[stats])
    # Calls of 2, 2, 2, 2 and 1 steps: the first (tracing) is left out; reports at steps 4 and 8.
    assert [(r.step, r.steps) for r in stats.history] == [(4, 1), (8, 2)]
    last = stats.history[-1]
    assert np.all(np.isfinite(last.collective_wait)) and np.all(last.step_time > 0.01 / 2)


def test_pipeline_micro_batches_count_once_per_step():
    strategy = tfdist.PipelineStrategy(stages=2, microbatches=2, replicas=2, devices=[f"CPU:{i}" for i in range(4)])
    model = _model(strategy)
    stats = tfdist.callbacks.StepStats(every=4)
    model.fit(_slow_dataset(8, 0.01), epochs=1, shuffle=False, verbose=0, callbacks=[stats])
    assert [(r.step, r.steps, r.kind) for r in stats.history] == [(4, 3, "replica"), (8, 4, "replica")]
    for r in stats.history:  # two rows per step and replica (one per micro-batch), split as one step
        assert np.all(r.input_wait < r.step_time) and np.all(r.compute > 0), r
        assert np.all(np.isfinite(r.collective_wait)) and np.all(r.collective_wait < r.step_time), r


class _Rebuild(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.model.make_train_function(force=True)  # drops the train function StepStats put in place


def test_steps_that_stepstats_did_not_time_fail_loudly():
    model = _model(tf.distribute.get_strategy())
    stats = tfdist.callbacks.StepStats(every=2)
    with pytest.raises(tfdist.CompatError, match="without calling the train function StepStats put in"):
        model.fit(_slow_dataset(4, 0.0), epochs=1, shuffle=False, verbose=0, callbacks=[stats, _Rebuild()])


# ---------------------------------------------------------------- real processes
def _run_pair(procs, mode, **opts):
    addresses = _procs.workers(2)
    from tfdist import cluster as cluster_lib

    outs = [procs.tmp_path / f"{mode}{i}.json" for i in range(2)]
    first = len(procs.procs)
    for i in range(2):
        tf_config = cluster_lib.Cluster(workers=addresses, task_index=i).to_tf_config()
        args = [f"{k}={v}" for k, v in opts.items()]
        procs.start([sys.executable, WORKER, str(outs[i]), mode, *args], _procs.clean_env(TF_CONFIG=tf_config))
    indices = [first, first + 1]
    codes = procs.wait(indices, timeout=240)
    assert codes == [0, 0], [procs.log(i)[-3000:] for i in indices]
    return addresses, [json.loads(out.read_text()) for out in outs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 2-worker MultiWorkerStrategy pair, then the 2-process ModelParallelStrategy pair, one after the other."""
    procs = _procs.Procs(tmp_path_factory.mktemp("step_stats"))
    try:
        opts = {"delay_ms": DELAY_MS, "every": EVERY, "reports": 3, "slow_rank": 1}
        return {mode: _run_pair(procs, mode, **opts) for mode in ("multi", "model")}
    finally:
        procs.kill_all()


@pytest.mark.serial  # names a worker slowed by 100 ms a step
@pytest.mark.parametrize("mode", ["multi", "model"])
def test_a_worker_slowed_in_its_input_is_named_with_its_lag(runs, mode):
    addresses, results = runs[mode]
    reports = [r["slow"]["reports"] for r in results]
    assert reports[0] == reports[1]  # every worker reports the same figures
    assert reports[0][0]["units"] == [f"worker {i} ({a})" for i, a in enumerate(addresses)]
    named = [r for r in reports[0][:2] if r["slowest"] == 1 and r["over"]]
    assert named, reports[0]  # within two reporting intervals
    for r in named:
        assert abs(1e3 * r["lag"] - DELAY_MS) <= 0.3 * DELAY_MS, r
        step, wait, _, collective = np.array(r["table"]).T
        assert wait[1] >= 0.7 * DELAY_MS / 1e3 and wait[0] < 0.3 * DELAY_MS / 1e3, r
        if mode == "multi":  # worker 0 waits for worker 1 in the collectives
            assert collective[0] >= 0.7 * DELAY_MS / 1e3 and collective[1] < 0.3 * DELAY_MS / 1e3, r
        else:  # inside one SPMD program: not separable
            assert np.isnan(collective).all(), r
    assert reports[0][1]["straggler"] == 1  # patience=2
    chief, other = (r["slow"]["warnings"] for r in results)
    assert len(chief) == 1 and chief[0].startswith(f"tfdist StepStats: worker 1 ({addresses[1]}) is the slowest")
    assert "mostly waiting for its input" in chief[0] and not other
    assert results[0]["slow"]["logs"]["slowest_worker"] == [1]


@pytest.mark.serial  # no straggler among even workers
def test_workers_without_a_delay_name_no_straggler_over_200_steps(runs):
    _, results = runs["multi"]
    reports = results[0]["even"]["reports"]
    assert [r["step"] for r in reports] == list(range(20, 220, 20))
    assert all(r["straggler"] is None for r in reports), reports
    assert not results[0]["even"]["warnings"]
    assert all(np.isfinite(r["table"]).all() for r in reports)
