"""Every notebook in notebooks/ runs top to bottom (in its own kernel process) without an error."""

import pathlib

import _procs
import nbclient
import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(_procs.REPO) / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    notebook = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), (
        f"{path.name} is committed with outputs; strip them"
    )
    env = _procs.clean_env()  # the kernel imports this checkout's tfdist
    env.pop("MPLBACKEND", None)  # the kernel's inline backend draws PNG outputs
    client = nbclient.NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute(env=env)
    images = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if "image/png" in output.get("data", {})
    ]
    assert images, f"{path.name} drew no plot"
