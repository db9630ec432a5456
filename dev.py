#!/usr/bin/env python3
"""Sets up a virtual environment in .venv and runs tfdist's main job or its test suite.

    python3 dev.py train [tfdist-train flags]   # the default training job
    python3 dev.py test [pytest arguments]      # ruff, then the whole test suite (or the tests named)
    python3 dev.py conformance [arguments]      # KerasHub families x strategies -> CONFORMANCE.md (by hand)

Needs only Python 3.10+ with venv. The first run installs tfdist and its pinned
dependencies (a few minutes); later runs reuse .venv until setup.cfg changes.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import venv

ROOT = os.path.dirname(os.path.abspath(__file__))
VENV = os.path.join(ROOT, ".venv")
PYTHON = os.path.join(VENV, "bin", "python")
STAMP = os.path.join(VENV, ".tfdist-installed")


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True)


def ensure_venv(extra: str | None) -> None:
    """Creates .venv and installs tfdist (editable, with `extra`) unless already done."""
    with open(os.path.join(ROOT, "setup.cfg"), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    wanted = f"{digest} {extra or ''}"
    installed = open(STAMP).read().split("\n") if os.path.exists(STAMP) else []
    if wanted in installed or (extra is None and any(line.startswith(digest) for line in installed)):
        return
    if not os.path.exists(PYTHON):
        print(f"Creating {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
    _run([PYTHON, "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
    target = f".[{extra}]" if extra else "."
    _run([PYTHON, "-m", "pip", "install", "--quiet", "--editable", target])
    with open(STAMP, "a") as f:
        f.write(wanted + "\n")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("train", "test", "conformance"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    if command == "train":
        ensure_venv(None)
        return subprocess.run([PYTHON, "-m", "tfdist.train", *rest], cwd=ROOT, env=env).returncode
    ensure_venv("test")
    if command == "conformance":  # KerasHub comes with the test extra
        return subprocess.run([PYTHON, "-m", "conformance", *rest], cwd=ROOT, env=env).returncode
    lint_paths = ["tfdist", "tests", "benchmarks", "conformance", "examples", "dev.py"]
    lint = subprocess.run([PYTHON, "-m", "ruff", "check", *lint_paths], cwd=ROOT)
    if lint.returncode:
        print("ruff found problems (above).", file=sys.stderr)
        return lint.returncode
    if rest:  # the user's selection, as given
        # Exit code 5 (no test collected) counts as a failure like any other non-zero code.
        return subprocess.run([PYTHON, "-m", "pytest", *rest], cwd=ROOT, env=env).returncode
    return _whole_suite(env)


# The whole suite in two runs: the tests two at a time (one pytest worker per core, each test module on one
# worker, so that a module's shared child process runs once), then those marked `serial` (they bound how long
# a worker takes to end, or wait on short timeouts of their own) alone.
PHASES = (
    ("two at a time", ["-n", "2", "--dist", "loadfile", "-m", "not serial"]),
    ("alone", ["-m", "serial"]),
)


def _whole_suite(env: dict) -> int:
    took, code = [], 0
    for name, args in PHASES:
        print(f"+ pytest, the tests that run {name}: {' '.join(args)}", flush=True)
        start = time.monotonic()
        returncode = subprocess.run([PYTHON, "-m", "pytest", *args, "tests"], cwd=ROOT, env=env).returncode
        took.append(f"{name} {(time.monotonic() - start) / 60:.1f} min")
        code = code or returncode  # exit code 5 (no test collected) counts as a failure too
    print(f"pytest: {'; '.join(took)}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
