"""Every notebook in notebooks/ runs top to bottom (in its own kernel process) without an error.

Each notebook runs in a child process of its own (`CHILD`: nbclient, which starts the kernel), two at a
time on the machine's two cores, in order, as their tests ask for them; each child is killed
`TIMEOUT_S` after it started, and every one still running is killed at the end of the module (a child's
kernel runs in a session of its own and ends itself when that child is gone: ipykernel watches the
process that started it, JPY_PARENT_PID).
"""

import pathlib
import sys
import time

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


class _Runs:
    """The notebooks' child processes, started `PARALLEL` at a time, in order."""

    def __init__(self, tmp_path, paths):
        self.procs = _procs.Procs(tmp_path)
        self.todo, self.running, self.ended = list(paths), {}, {}
        self.env = _procs.clean_env()  # the kernel imports this checkout's tfdist
        self.env.pop("MPLBACKEND", None)  # the kernel's inline backend draws PNG outputs

    def _executed(self, path) -> pathlib.Path:
        return self.procs.tmp_path / f"executed-{path.name}"

    def _poll(self):
        for path, i in list(self.running.items()):
            code = self.procs.procs[i].poll()
            if code is None and time.monotonic() - self.procs.started[i] < TIMEOUT_S:
                continue
            if code is None:
                self.procs.kill(i)
            del self.running[path]
            self.ended[path] = (code, i)
        while self.todo and len(self.running) < PARALLEL:
            path = self.todo.pop(0)
            self.running[path] = self.procs.start([sys.executable, "-c", CHILD, str(path), str(self._executed(path))],
                                                  self.env)

    def result(self, path):
        """Waits for `path`'s run: (exit status, None if killed; its output; the executed notebook or None)."""
        while path not in self.ended:
            self._poll()
            time.sleep(0.2)
        code, i = self.ended[path]
        executed = nbformat.read(self._executed(path), as_version=4) if code == 0 else None
        return code, self.procs.log(i), executed


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The runs of the notebooks whose tests were collected (only those run)."""
    wanted = [item.callspec.params["path"] for item in request.session.items if item.module is request.module
              and item.originalname == "test_notebook_runs"]
    r = _Runs(tmp_path_factory.mktemp("notebooks"), wanted)
    yield r
    r.procs.kill_all()


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, runs):
    notebook = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
        f"{path.name} is committed with outputs; strip them"
    )
    code, output, executed = runs.result(path)
    status = f"killed after {TIMEOUT_S}s" if code is None else f"exit status {code}"
    assert code == 0, f"{path.name}: {status}\n{output[-6000:]}"
    images = [
        output
        for cell in executed.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if "image/png" in output.get("data", {})
    ]
    assert images, f"{path.name} drew no plot"
