"""Every tfdist module's `>>>` examples run and print what their docstrings say.

The examples run in fresh Python processes, never in the pytest process (8 simulated devices,
TensorFlow started), each process bounded by `TIMEOUT_S`. A module whose examples configure
devices (`DEVICE_SETUP`: that must happen before TensorFlow starts) runs alone in a process of its
own; the other modules run one after the other in a few shared processes (`GROUPS` of them, two
processes at a time on the machine's two cores), Keras' session cleared before each module (layer
names count from 0 again, as in a fresh process). doctest gives each docstring its own copy of
its module's globals, so no example sees another's names. The modules are found by walking the
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
GROUPS, PARALLEL = 2, 2
EXAMPLE = re.compile(r"^\s*>>> ", re.MULTILINE)
# An example line (">>> " or "... ") that sets up devices: its module needs a process of its own.
DEVICE_SETUP = re.compile(
    r"^\s*(>>>|\.\.\.) .*(simulate_devices|set_logical_device_configuration|set_visible_devices|tf\.config\.)",
    re.MULTILINE,
)
NOT_RUN = {
    "tfdist.strategies.multi_worker": "its example is one worker of a two-process job (tfdist-launch -n 2); "
    "tests/strategies/test_multi_worker.py runs such jobs",
}
MARK = "DOCTEST-RESULT "
# Runs the examples of each module named in argv, in order. Before each: a "DOCTEST-MODULE" line; after
# each: a MARK line saying how many examples doctest found, ran and saw fail.
CHILD = """
import doctest, importlib, json, sys
for name in sys.argv[1:]:
    print("DOCTEST-MODULE", name, flush=True)
    if "keras" in sys.modules:
        sys.modules["keras"].backend.clear_session()
    module = importlib.import_module(name)
    found = sum(len(test.examples) for test in doctest.DocTestFinder().find(module))
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    print("MARK" + json.dumps({"name": name, "found": found, "attempted": result.attempted,
                               "failed": result.failed}), flush=True)
""".replace('"MARK"', repr(MARK))


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the package (packages by their __init__.py), by dotted name."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if all((PACKAGE.parent.joinpath(*parts[:i]) / "__init__.py").is_file() for i in range(1, len(parts))):
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _processes(names) -> list[list[str]]:
    """The modules with examples among `names`, as the lists of modules each child process runs."""
    names = [n for n in sorted(names) if EXAMPLE.search(MODULES[n].read_text())]
    alone = [[n] for n in names if DEVICE_SETUP.search(MODULES[n].read_text())]
    shared = [n for n in names if [n] not in alone]
    return alone + [group for group in (shared[i::GROUPS] for i in range(GROUPS)) if group]


@pytest.fixture(scope="module")
def example_results(request, tmp_path_factory):
    """Module name -> (result, exit status, log) for each module whose test was collected (only those run)."""
    wanted = {item.callspec.params["name"] for item in request.session.items if item.module is request.module
              and item.originalname == "test_module_examples_run"}
    queue = _procs.Queue(tmp_path_factory.mktemp("docstrings"), parallel=PARALLEL, timeout=TIMEOUT_S)
    processes = _processes(wanted)
    try:
        for names in processes:
            queue.add(tuple(names), [sys.executable, "-c", CHILD, *names], _procs.clean_env())
        outcome = {}
        for names in processes:
            code, log = queue.result(tuple(names))
            results = [json.loads(line[len(MARK) :]) for line in log.splitlines() if line.startswith(MARK)]
            results = {r["name"]: r for r in results}
            outcome.update({name: (results.get(name), code, log) for name in names})
        return outcome
    finally:
        queue.kill_all()


def _module_output(log: str, name: str, ended: bool) -> str:
    """What a child process printed while it ran `name`'s examples (to the end of its log if they did not end)."""
    start = max(log.find(f"DOCTEST-MODULE {name}\n"), 0)
    end = log.find("DOCTEST-MODULE ", start + 1)
    return log[start : end if ended and end >= 0 else len(log)]


def test_the_walk_finds_the_package():
    assert {"tfdist", "tfdist._validate", "tfdist.devices", "tfdist.callbacks"} <= set(MODULES)
    assert sum(bool(EXAMPLE.search(path.read_text())) for path in MODULES.values()) >= 20
    assert set(NOT_RUN) <= set(MODULES), "a module in NOT_RUN was moved or removed: update NOT_RUN"


def test_device_setting_modules_run_alone():
    processes = _processes(MODULES)
    assert ["tfdist.devices"] in processes  # simulate_devices(4) in its examples
    assert sorted(n for names in processes for n in names) == sorted(
        n for n, path in MODULES.items() if EXAMPLE.search(path.read_text())
    )


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_examples_run(name, example_results):
    examples = len(EXAMPLE.findall(MODULES[name].read_text()))
    if not examples:  # nothing to run: no process started for it
        assert name not in example_results
        return
    result, code, log = example_results[name]
    output = _module_output(log, name, ended=result is not None)
    output = output[:6000] + ("\n...\n" + output[-3000:] if len(output) > 9000 else output[6000:])
    status = f"killed after {TIMEOUT_S}s" if code is None else f"exit status {code}"
    assert result is not None, f"the process running {name}'s examples ended ({status}) before reporting:\n{output}"
    assert code == 0, f"the process that ran {name}'s examples ended with {status}:\n{log[-6000:]}"
    # Every `>>>` line in the file is an example doctest finds (none hides where doctest does not look) ...
    assert result["found"] == examples, (result, output)
    # ... and each one that is not marked +SKIP ran and printed what its docstring says.
    assert result["failed"] == 0, (result, output)
    if name in NOT_RUN:
        assert result["attempted"] == 0, f"{name} has examples that run now: remove it from NOT_RUN"
    else:
        assert result["attempted"] > 0, f"every example of {name} is skipped: run one, or list it in NOT_RUN"
