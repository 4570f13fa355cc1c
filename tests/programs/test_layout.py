"""The layout docs/design.md describes holds: each folder builds only on the folders
below it (the core at the bottom, the layers of `jaxstate.nn` on the public API and
`jaxstate.extend` only, as a layer outside the package is written), no import circle
between jaxstate's modules, no import inside a function, JAX's private parts reached
only through `_jax.py` (and in `_dispatch.py` and `_discharge.py`, which replace a
stage of JAX's dispatch and one of its lowering), no private name imported from
another module, and the design's map names every file."""

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


# Which layer each module is in, and what each layer may import: its own modules
# and those of the layers it builds on, never those above or beside it. The root
# (`jaxstate/__init__.py`) gathers every layer's public names.
BUILDS_ON: dict[str, set[str]] = {
    # `_jax.py`, `_equinox.py`, `_dispatch.py`, `_discharge.py`
    "internals": set(),
    "_core": {"internals"},
    "_loops": {"internals", "_core"},
    "_tree": {"internals", "_core"},
    "_jit": {"internals", "_core"},
    "_checkpoint": {"internals", "_core", "_tree"},
    "_pure": {"internals", "_core", "_tree", "_jit"},
    "public": {"_core"},  # `jaxstate.extend`, `jaxstate.kinds`
    # Only what a layer outside the package has: the public names and
    # `jaxstate.extend` (and `jaxstate.kinds`).
    "nn": {"root", "public"},
}


def _layer(name: str) -> str:
    if name == "jaxstate":
        return "root"
    if name in (
        "jaxstate._jax",
        "jaxstate._equinox",
        "jaxstate._dispatch",
        "jaxstate._discharge",
    ):
        return "internals"
    if name in ("jaxstate.extend", "jaxstate.kinds"):
        return "public"
    return name.split(".")[1]


def _violations(graph: dict[str, set[str]]) -> list[str]:
    """`module -> imported module` for each import against the layers."""
    out = []
    for name, targets in sorted(graph.items()):
        layer = _layer(name)
        if layer == "root":
            continue
        allowed = BUILDS_ON[layer] | {layer}
        out += [f"{name} -> {t}" for t in sorted(targets) if _layer(t) not in allowed]
    return out


def test_the_modules_are_found():
    # (So that the tests below cannot pass by reading nothing.)
    assert {"jaxstate", "jaxstate._jax", "jaxstate._core._storage"} <= set(MODULES)
    assert "jaxstate._core._storage" in _graph()["jaxstate._core._access"]


def test_every_module_is_in_a_layer():
    assert {_layer(name) for name in MODULES} == {"root", *BUILDS_ON}


def test_each_layer_builds_only_on_those_below_it():
    assert _violations(_graph()) == []


def test_an_import_against_the_layers_would_be_found():
    graph = {
        "jaxstate._core._access": {"jaxstate._core._storage"},
        "jaxstate._checkpoint._reset": {"jaxstate.nn._util", "jaxstate._tree._walk"},
        "jaxstate._pure._pure": {"jaxstate._checkpoint._walk"},
        "jaxstate.nn._kv_cache": {"jaxstate._core._access", "jaxstate.extend"},
    }
    assert _violations(graph) == [
        "jaxstate._checkpoint._reset -> jaxstate.nn._util",
        "jaxstate._pure._pure -> jaxstate._checkpoint._walk",
        "jaxstate.nn._kv_cache -> jaxstate._core._access",
    ]


def test_the_root_imports_the_layers_last():
    # `jaxstate.nn` imports the public names from the root, which imports it
    # last, once they are all bound: the one import circle, by design.
    tree = ast.parse(MODULES["jaxstate"].read_text())
    imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    last = imports[-1]
    assert isinstance(last, ast.ImportFrom) and [a.name for a in last.names] == ["nn"]
    assert all(alias.name != "nn" for node in imports[:-1] for alias in node.names)


def test_no_import_circle():
    graph = _graph()
    # (But the one of `test_the_root_imports_the_layers_last`.)
    for name in graph:
        if _layer(name) == "nn":
            graph[name].discard("jaxstate")
    assert _cycle(graph) is None


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


@pytest.mark.parametrize(
    "name",
    sorted(
        set(MODULES) - {"jaxstate._jax", "jaxstate._dispatch", "jaxstate._discharge"}
    ),
)
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
        path.relative_to(SRC).as_posix()
        for path in SRC.rglob("*")
        if path.is_file() and path.suffix == ".py" and path.name != "__init__.py"
    ]
    assert len(files) > 20
    assert [f for f in files if f"`{f}`" not in design] == []
    # And names no file that is not there.
    named = re.findall(r"^\| `([\w/]+\.py)` \|", design, re.M)
    assert len(named) > 20
    assert [f for f in named if f not in files and f != "__init__.py"] == []
