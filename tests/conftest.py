"""Test setup: the pytest process splits its CPU into 8 logical devices before TensorFlow starts.

The one conftest.py, at the root of tests/ (the test modules are laid out by area in its folders: README.md):
it puts tests/_support, the shared helpers, on sys.path, so that every test module can `import _procs`.

Tests that need another device configuration, or that must start TensorFlow in a particular
way, run in a subprocess of their own (the `python_subprocess` fixture: `_procs.run_python`).
"""

import gc
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_support"))

import _procs  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdist  # noqa: E402

NUM_TEST_DEVICES = 8
TEST_DEVICES = tfdist.simulate_devices(NUM_TEST_DEVICES)


@pytest.fixture(autouse=True)
def _frozen_heap():
    """Collects, then freezes, what survives up to each test: Python's cyclic collector skips it from then on.

    The pytest process' heap grows with every test (TensorFlow and Keras alone leave ~500,000 objects, and
    traced graphs and models stay in their caches). Tracing allocates heavily, which keeps triggering full
    collections, each rescanning that whole heap: a fit of 8 steps on a 2-replica strategy took 16 s after
    15 tests of its file and 1.2 s with the heap frozen (125 s once late in the suite, 0.3 s alone).
    """
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(autouse=True)
def _collective_keys_of_their_own():
    """Gives the plain TensorFlow strategies each test builds collective keys no earlier test used.

    TensorFlow starts every `MirroredStrategy`'s and `MultiWorkerMirroredStrategy`'s group keys at 1, and
    DTensor's collectives start there too; a process keeps each group's members for its lifetime. A plain
    `MirroredStrategy(["CPU:0", "CPU:1"])` after a test whose ModelParallelStrategy step had formed group 1 over
    other devices fails with "joining a group that is already full (group_key=1)" (seen when pytest-xdist put
    a model-parallel module before tests/callbacks/test_callbacks_topology.py in one worker). TensorFlow's own
    tests do the same (`strategy_combinations`: `_collective_key_base += 100000`); tfdist's strategies take
    key bases of their own (`tfdist.strategies._mirrored.next_key_base`).
    """
    for cls in (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy):
        cls._collective_key_base += 100_000


@pytest.fixture
def python_subprocess():
    return _procs.run_python


@pytest.fixture
def procs(tmp_path):
    """Processes started by a test (each in its own session); every one still running is killed at teardown."""
    p = _procs.Procs(tmp_path)
    yield p
    p.kill_all()

