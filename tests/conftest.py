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


@pytest.fixture
def python_subprocess():
    return _procs.run_python


@pytest.fixture
def procs(tmp_path):
    """Processes started by a test (each in its own session); every one still running is killed at teardown."""
    p = _procs.Procs(tmp_path)
    yield p
    p.kill_all()

