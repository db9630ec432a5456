"""Every tfdist module's `>>>` examples run and print what their docstrings say.

Each module runs in a fresh Python process, bounded by `TIMEOUT_S`: examples start TensorFlow,
configure devices and build strategies, and must neither see each other's state nor disturb the
pytest process (8 simulated devices, TensorFlow started). The modules are found by walking the
package's files when the tests are collected, so a new or moved module is checked without an
edit here. An example that cannot run in one process on one CPU machine (it is one worker of a
multi-process job) is marked `# doctest: +SKIP` in its docstring, and the rest of its module still
runs; `NOT_RUN` lists, with the reason, the modules left with no example that runs.
"""

import json
import pathlib
import re
import sys

import _procs
import pytest

PACKAGE = pathlib.Path(_procs.REPO) / "tfdist"
TIMEOUT_S = 300
EXAMPLE = re.compile(r"^\s*>>> ", re.MULTILINE)
NOT_RUN = {
    "tfdist.strategies.multi_worker": "its example is one worker of a two-process job (tfdist-launch -n 2); "
    "tests/test_multi_worker.py runs such jobs",
}
# Runs one module's examples; the last line of output says how many doctest found, ran and saw fail.
CHILD = """
import doctest, importlib, json, sys
module = importlib.import_module(sys.argv[1])
found = sum(len(test.examples) for test in doctest.DocTestFinder().find(module))
result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
print(json.dumps({"found": found, "attempted": result.attempted, "failed": result.failed}))
"""


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package (packages by their __init__.py), by dotted name."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if all((PACKAGE.parent.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts))):
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def test_the_walk_finds_the_package():
    assert {"tfdist", "tfdist._validate", "tfdist.devices", "tfdist.callbacks"} <= set(MODULES)
    assert sum(bool(EXAMPLE.search(path.read_text())) for path in MODULES.values()) >= 20
    assert set(NOT_RUN) <= set(MODULES), "a module in NOT_RUN was moved or removed: update NOT_RUN"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_examples_run(name):
    examples = len(EXAMPLE.findall(MODULES[name].read_text()))
    if not examples:  # nothing to run: no process started
        return
    proc = _procs.run([sys.executable, "-c", CHILD, name], timeout=TIMEOUT_S)
    output = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, output
    result = json.loads(proc.stdout.splitlines()[-1])
    # Every `>>>` line in the file is an example doctest finds (none hides where doctest does not look) ...
    assert result["found"] == examples, (result, output)
    # ... and each one that is not marked +SKIP ran and printed what its docstring says.
    assert result["failed"] == 0, (result, output)
    if name in NOT_RUN:
        assert result["attempted"] == 0, f"{name} has examples that run now: remove it from NOT_RUN"
    else:
        assert result["attempted"] > 0, f"every example of {name} is skipped: run one, or list it in NOT_RUN"
