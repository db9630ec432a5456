"""Every kind of strategy reports this process' place in the run through `tfdist.strategies.topology.of`.

The callbacks read nothing else: worker index (who writes shared files), number of workers (whether
to run collectives) and data-parallel size (Throughput's replicas, LearningRateWarmup's scale).
ModelParallelStrategy is checked in its own process (`tests/scenarios/callbacks_under_model_parallel.py`), a 2-worker
MultiWorkerStrategy in `test_callbacks_fault.py`.
"""

import types

import keras
import numpy as np
import tensorflow as tf

import tfdist
import tfdist.callbacks as cb
from tfdist.strategies import topology
from tfdist.strategies.topology import Topology

CPUS = [f"CPU:{i}" for i in range(4)]


def test_data_parallel_over_four_devices():
    strategy = tfdist.DataParallelStrategy(devices=CPUS)
    assert topology.of(strategy) == strategy.topology == Topology(worker_index=0, num_workers=1, data_parallel_size=4)
    assert topology.of(strategy).is_chief


def test_pipeline_splits_each_batch_over_its_replicas_not_its_stages():
    strategy = tfdist.PipelineStrategy(stages=2, microbatches=2, replicas=2, devices=CPUS)
    assert topology.of(strategy) == Topology(worker_index=0, num_workers=1, data_parallel_size=2)


def test_plain_tf_distribute_strategies_through_public_api():
    mirrored = tf.distribute.MirroredStrategy(CPUS[:3])
    assert topology.of(mirrored) == Topology(worker_index=0, num_workers=1, data_parallel_size=3)
    assert topology.of(tf.distribute.get_strategy()) == Topology(worker_index=0, num_workers=1, data_parallel_size=1)


def test_a_cluster_resolver_gives_the_worker_index_counting_the_chief_first():
    spec = tf.train.ClusterSpec({"chief": ["h0:1"], "worker": ["h1:1", "h2:1"]})
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, task_type="worker", task_id=1)
    strategy = types.SimpleNamespace(cluster_resolver=resolver, num_replicas_in_sync=3)  # as MWMS reports
    where = topology.of(strategy)
    assert where == Topology(worker_index=2, num_workers=3, data_parallel_size=3) and not where.is_chief


def test_callbacks_use_the_topology_of_a_plain_mirrored_strategy(tmp_path):
    strategy = tf.distribute.MirroredStrategy(CPUS[:2])
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    speed = cb.Throughput(batch_size=8)
    warmup = cb.LearningRateWarmup(warmup_steps=2)
    check = cb.SyncCheck(every_n_steps=2)
    ckpt = cb.Checkpoint(tmp_path / "ckpt", every_n_steps=2, keep=1)
    x = np.ones((16, 4), "float32")
    model.fit(x, x[:, :1], batch_size=8, epochs=2, verbose=0, callbacks=[speed, warmup, check, ckpt])
    assert speed._replicas == 2  # the data-parallel size
    np.testing.assert_allclose(float(model.optimizer.learning_rate.numpy()), 0.02, rtol=1e-6)  # warmed up to 2x
    assert check.checks == 2
    assert cb.latest_checkpoint(tmp_path / "ckpt").endswith("ckpt-000000004.npz")  # worker 0 writes
