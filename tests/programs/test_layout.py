"""The layout docs/design.md describes holds: no import circle between jaxstate's
modules, no import inside a function, JAX's private parts reached only through
`_jax.py`, no private name imported from another module, and the design's map names
every file."""

import ast
import pathlib
import re

import pytest


ROOT = pathlib.Path(__file__).parents[2]
SRC = ROOT / "src" / "jaxstate"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, ast.ImportFrom]]:
    """(module imported, the statement) for each `from ... import` of `name`."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            out.append((target, node))
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name in MODULES:
        for target, node in _imports(name):
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:
                    graph[name].add(sub)
                elif target in MODULES:
                    graph[name].add(target)
            graph[name].discard(name)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return None
        for other in sorted(graph[name]):
            found = visit(other, path + [name])
            if found:
                return found
        done.add(name)
        return None

    for name in sorted(graph):
        found = visit(name, [])
        if found:
            return found
    return None


def test_the_modules_are_found():
    # (So that the tests below cannot pass by reading nothing.)
    assert {"jaxstate", "jaxstate._jax", "jaxstate._core._storage"} <= set(MODULES)
    assert "jaxstate._core._storage" in _graph()["jaxstate._core._access"]


def test_no_import_circle():
    assert _cycle(_graph()) is None


def test_a_circle_would_be_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_import_inside_a_function(name):
    tree = ast.parse(MODULES[name].read_text())
    nested = [
        (fn.name, node.lineno)
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(fn)
        if isinstance(node, ast.Import | ast.ImportFrom)
    ]
    assert nested == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_private_name_from_another_module(name):
    private = [
        f"{target}.{alias.name}"
        for target, node in _imports(name)
        if target.startswith("jaxstate")
        for alias in node.names
        if alias.name.startswith("_") and f"{target}.{alias.name}" not in MODULES
    ]
    assert private == []


@pytest.mark.parametrize("name", sorted(set(MODULES) - {"jaxstate._jax"}))
def test_jax_private_parts_only_through_the_jax_module(name):
    text = MODULES[name].read_text()
    tree = ast.parse(text)
    modules = [
        node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
    ] + [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    ]
    assert [m for m in modules if m.startswith(("jax._src", "jaxlib"))] == []
    # A reference's buffer attribute is JAX's private detail (`_jax.buffer`).
    assert re.search(r"\._buf\b", text) is None


@pytest.mark.parametrize("name", sorted(set(MODULES) - {"jaxstate._equinox"}))
def test_equinox_private_parts_only_through_the_equinox_module(name):
    tree = ast.parse(MODULES[name].read_text())
    private = [
        f"{node.module}.{alias.name}"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith("equinox")
        for alias in node.names
        if alias.name.startswith("_") or "._" in (node.module or "")
    ] + [
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name.startswith("equinox._")
    ]
    assert private == []


def test_a_private_equinox_import_would_be_found():
    assert "jaxstate._equinox" in MODULES
    text = MODULES["jaxstate._equinox"].read_text()
    assert "from equinox import _caches, _jit" in text


def test_the_design_map_names_every_file():
    design = (ROOT / "docs" / "design.md").read_text()
    files = [
        path.relative_to(SRC)
        for path in SRC.rglob("*")
        if path.is_file() and path.suffix == ".py" and path.name != "__init__.py"
    ]
    assert len(files) > 20
    assert [str(f) for f in files if f.name not in design] == []
