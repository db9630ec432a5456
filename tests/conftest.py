"""Test setup: the pytest process splits its CPU into 8 logical devices before TensorFlow starts.

The one conftest.py, at the root of tests/ (the test modules are laid out by area in its folders: README.md):
it puts tests/_support, the shared helpers, on sys.path, so that every test module can `import _procs`.

Tests that need another device configuration, or that must start TensorFlow in a particular
way, run in a subprocess of their own (the `python_subprocess` fixture: `_procs.run_python`).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "_support"))

import _procs  # noqa: E402
import pytest  # noqa: E402

import tfdist  # noqa: E402

NUM_TEST_DEVICES = 8
TEST_DEVICES = tfdist.simulate_devices(NUM_TEST_DEVICES)


@pytest.fixture
def python_subprocess():
    return _procs.run_python


@pytest.fixture
def procs(tmp_path):
    """Processes started by a test (each in its own session); every one still running is killed at teardown."""
    p = _procs.Procs(tmp_path)
    yield p
    p.kill_all()

