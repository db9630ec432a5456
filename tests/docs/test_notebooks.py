"""Every notebook in notebooks/ runs top to bottom (in its own kernel process) without an error.

Each notebook runs in a child process of its own (`CHILD`: nbclient, which starts the kernel), two at a
time on the machine's two cores, in order, as their tests ask for them; each child is killed
`TIMEOUT_S` after it started, and every one still running is killed at the end of the module (a child's
kernel runs in a session of its own and ends itself when that child is gone: ipykernel watches the
process that started it, JPY_PARENT_PID).
"""

import pathlib
import sys

import _procs
import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(_procs.REPO) / "notebooks").glob("*.ipynb"))
PARALLEL = 2
TIMEOUT_S = 900
# Runs the notebook argv[1] in a fresh kernel (this process's environment) and writes it, with its outputs, to argv[2].
CHILD = """
import pathlib, sys
import nbclient, nbformat
source, executed = map(pathlib.Path, sys.argv[1:])
notebook = nbformat.read(source, as_version=4)
client = nbclient.NotebookClient(
    notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(source.parent)}}
)
client.execute()
nbformat.write(notebook, executed)
"""


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The notebooks whose tests were collected, queued (`_procs.Queue`); their executed copies' directory."""
    wanted = [item.callspec.params["path"] for item in request.session.items if item.module is request.module
              and item.originalname == "test_notebook_runs"]
    out = tmp_path_factory.mktemp("notebooks")
    env = _procs.clean_env()  # the kernel imports this checkout's tfdist
    env.pop("MPLBACKEND", None)  # the kernel's inline backend draws PNG outputs
    queue = _procs.Queue(out, parallel=PARALLEL, timeout=TIMEOUT_S)
    for path in wanted:
        queue.add(path, [sys.executable, "-c", CHILD, str(path), str(out / path.name)], env)
    yield queue, out
    queue.kill_all()


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, runs):
    notebook = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
        f"{path.name} is committed with outputs; strip them"
    )
    queue, out = runs
    code, output = queue.result(path)
    status = f"killed after {TIMEOUT_S}s" if code is None else f"exit status {code}"
    assert code == 0, f"{path.name}: {status}\n{output[-6000:]}"
    executed = nbformat.read(out / path.name, as_version=4)
    images = [
        output
        for cell in executed.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if "image/png" in output.get("data", {})
    ]
    assert images, f"{path.name} drew no plot"
