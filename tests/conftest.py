"""Test setup: the pytest process splits its CPU into 8 logical devices before TensorFlow starts.

Tests that need another device configuration, or that must start TensorFlow in a particular
way, run in a subprocess of their own (see `run_python`).
"""

import os
import subprocess
import sys
import textwrap

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

import tfdist  # noqa: E402

NUM_TEST_DEVICES = 8
TEST_DEVICES = tfdist.simulate_devices(NUM_TEST_DEVICES)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, *, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh Python process (repo on sys.path) and returns the finished process."""
    full_env = {**os.environ, "PYTHONPATH": REPO, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO,
    )


@pytest.fixture
def python_subprocess():
    return run_python
