"""tfdist's public face: lazy loading, the names in `__all__`, the errors in one module, the names type checkers see."""

import ast
import json
import pathlib
import warnings

import _procs
import pytest

import tfdist
import tfdist.errors
from tfdist import cluster

INIT = pathlib.Path(_procs.REPO) / "tfdist" / "__init__.py"


def test_importing_tfdist_loads_no_tensorflow(python_subprocess):
    # Nor does reaching the errors: a binary catches them before it starts TensorFlow.
    proc = python_subprocess(
        """
        import json, sys
        import tfdist
        errors = (tfdist.CompatError, tfdist.ClusterError, tfdist.DataShardingWarning)
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras"))))
        """,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == []


def test_every_public_name_resolves():
    assert dir(tfdist) == tfdist.__all__ == sorted(tfdist.__all__)
    for name in tfdist.__all__:
        assert getattr(tfdist, name) is not None, name
    with pytest.raises(AttributeError, match=r"no attribute 'NoSuchName'; public names: \["):
        tfdist.NoSuchName  # noqa: B018


def test_errors_live_in_one_module_and_are_reexported():
    assert tfdist.CompatError is tfdist.errors.CompatError
    assert tfdist.ClusterError is tfdist.errors.ClusterError is cluster.ClusterError
    assert tfdist.DataShardingWarning is tfdist.errors.DataShardingWarning
    assert issubclass(tfdist.CompatError, RuntimeError)
    assert issubclass(tfdist.ClusterError, ValueError)  # callers that catch ValueError keep working
    assert issubclass(tfdist.DataShardingWarning, UserWarning)
    with pytest.raises(tfdist.ClusterError, match=r"Invalid task index '0'"):
        cluster.Cluster(workers=("127.0.0.1:1",), task_index="0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("x", tfdist.DataShardingWarning, stacklevel=1)
    assert [w.category for w in caught] == [tfdist.errors.DataShardingWarning]


def test_type_checkers_see_the_names_that_load_lazily():
    """The `if TYPE_CHECKING:` imports name exactly the public names, from the modules that `__getattr__` loads."""
    (block,) = [
        node
        for node in ast.parse(INIT.read_text()).body
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
    ]
    seen = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom), ast.dump(node)
        for alias in node.names:
            assert alias.asname == alias.name, f"{alias.name}: write `{alias.name} as {alias.name}` (a re-export)"
            seen[alias.name] = node.module if node.module != "tfdist" else f"tfdist.{alias.name}"
    expected = dict(tfdist._PUBLIC)
    expected.update({name: f"tfdist.{name}" for name in tfdist._SUBMODULES})
    assert seen == expected
    assert set(seen) | {"__version__"} == set(tfdist.__all__)
