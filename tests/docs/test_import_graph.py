"""No import cycle among tfdist's modules.

The graph is read with `ast` from every tfdist/**.py file: an edge for each `import` of a tfdist
module, at module level or inside a function (a deferred import that closes a cycle is still a
cycle between the two modules, only hidden until the function runs), except imports under
`if TYPE_CHECKING:`. `from package import name` is an edge to `package.name` when that is a
module, else to `package`. No module is imported, so this is cheap and sees every file.
"""

import ast
import pathlib

import _procs

PACKAGE = pathlib.Path(_procs.REPO) / "tfdist"


def _module_names(root: pathlib.Path) -> dict[str, pathlib.Path]:
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, modules: set[str], package: str):
    """The tfdist modules that `tree` imports (the module's own package `package` for relative imports)."""
    pending = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            pending.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in modules:
                    yield target
                elif base in modules:
                    yield base
        pending.extend(ast.iter_child_nodes(node))


def import_graph(root: pathlib.Path = PACKAGE) -> dict[str, set[str]]:
    """Module name -> the tfdist modules it imports."""
    names = _module_names(root)
    graph = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = set(_imports(ast.parse(path.read_text(), str(path)), set(names), package)) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as `[a, b, ..., a]`, or None when it is acyclic."""
    state = {}  # name -> "open" while on the DFS stack, "done" after
    stack: list[str] = []

    def visit(name):
        state[name] = "open"
        stack.append(name)
        for child in sorted(graph.get(name, ())):
            if state.get(child) == "open":
                return stack[stack.index(child) :] + [child]
            if child not in state:
                found = visit(child)
                if found:
                    return found
        stack.pop()
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name)
            if found:
                return found
    return None


def test_tfdist_modules_import_no_cycle():
    graph = import_graph()
    assert "tfdist.strategies.data_parallel" in graph and "tfdist._compat" in graph
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_a_cycle_is_found(tmp_path):
    # The shape of the circle this test guards against: a module-level import one way and a deferred
    # import (inside a function) back.
    package = tmp_path / "tfdist"
    (package / "strategies").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "strategies" / "__init__.py").write_text("")
    (package / "strategies" / "compat.py").write_text(
        "def unused_iterators():\n    from tfdist.strategies import model_parallel\n    return model_parallel\n"
    )
    (package / "strategies" / "model_parallel.py").write_text("from tfdist.strategies import compat\n")
    (package / "strategies" / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tfdist.strategies import typed_back\n"
    )
    (package / "strategies" / "typed_back.py").write_text("from tfdist.strategies import typed\n")
    cycle = find_cycle(import_graph(package))
    assert cycle == ["tfdist.strategies.compat", "tfdist.strategies.model_parallel", "tfdist.strategies.compat"]
