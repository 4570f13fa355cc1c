"""The code on the documentation site runs.

Every ```python block of the pages below whose first line is the comment
`# runnable` is executed, each in a fresh namespace, in a temporary working
directory. Blocks without the marker are reference code for other frameworks
(PyTorch, Flax) that the test environment does not install. The site build hides
the marker (docs/_hooks/hooks.py).
"""

import importlib.util
import re
import textwrap
from pathlib import Path

import pytest

from tests.helpers import ROOT, UNSET_MODE_IS_AN_ERROR


# Not in the typechecked pass (conftest.py): the documentation's whole programs.
# Readers copy this code: BatchNorm's warning for an unset `mode` must not show.
pytestmark = [pytest.mark.not_typechecked, UNSET_MODE_IS_AN_ERROR]


DOCS = ROOT / "docs"
MARKER = "# runnable"
# Fenced blocks, also indented ones (inside admonitions or content tabs).
_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```python[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.M | re.S,
)
_IMPORT = re.compile(r"^\s*(?:from|import)\s+([A-Za-z_][\w]*)", re.M)


def _pages() -> list[Path]:
    # The site's home page is the README (docs/_hooks/hooks.py), whose code
    # tests/programs/test_readme.py runs; the layer guides' is run by
    # tests/programs/test_layer_docs.py.
    return [
        DOCS / "getting-started.md",
        DOCS / "porting.md",
        DOCS / "deep-models.md",
        DOCS / "extending.md",
    ]


def _blocks(page: Path) -> list[tuple[int, str]]:
    """(line number, source) of every python block of `page`."""
    text = page.read_text(encoding="utf-8")
    out = []
    for match in _FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        out.append((line, textwrap.dedent(match.group("body"))))
    return out


def _runnable() -> list:
    params = []
    for page in _pages():
        for line, source in _blocks(page):
            if source.lstrip("\n").startswith(MARKER + "\n"):
                name = f"{page.name}:{line}"
                params.append(pytest.param(page.name, line, source, id=name))
    return params


RUNNABLE = _runnable()


def test_pages_exist_and_have_runnable_code():
    for page in _pages():
        assert page.exists(), page
    counts: dict[str, int] = {}
    for name, _, _ in (p.values for p in RUNNABLE):
        counts[name] = counts.get(name, 0) + 1
    # The first module; the model trained and evaluated with jaxstate and with
    # Equinox, the ensembles, two models in one tree_map, inference, checkpoints.
    assert counts.get("getting-started.md", 0) >= 2
    assert counts.get("porting.md", 0) >= 7
    # A stack trained with `jaxstate.scan`; per example; a layer split to scan it.
    assert counts.get("deep-models.md", 0) >= 3
    # A ring buffer, a running quantile, an eager check (written with
    # `jaxstate.extend`).
    assert counts.get("extending.md", 0) >= 3


def test_every_page_with_runnable_code_is_run():
    # A new page's `# runnable` blocks run once it is listed here (or with the
    # layer guides, in test_layer_docs.py).
    from tests.programs.test_layer_docs import PAGES as LAYER_PAGES

    run = {*_pages(), *LAYER_PAGES}
    for page in sorted(DOCS.rglob("*.md")):
        marked = [
            line
            for line, source in _blocks(page)
            if source.lstrip("\n").startswith(MARKER + "\n")
        ]
        if marked:
            assert page in run, f"{page.name}:{marked[0]} is marked but not run"


def test_reference_code_is_not_marked_runnable():
    # Code for frameworks that are not installed here must not carry the marker,
    # and every block that uses jaxstate must carry it.
    for page in _pages():
        for line, source in _blocks(page):
            runnable = source.lstrip("\n").startswith(MARKER + "\n")
            modules = set(_IMPORT.findall(source))
            where = f"{page.name}:{line}"
            if runnable:
                assert not modules & {"torch", "flax"}, where
            elif "jaxstate" in source:
                pytest.fail(f"{where} uses jaxstate but is not marked `{MARKER}`")


@pytest.mark.parametrize("page, line, source", RUNNABLE)
def test_snippet_runs(page, line, source, tmp_path, monkeypatch):
    for module in sorted(set(_IMPORT.findall(source))):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    monkeypatch.chdir(tmp_path)  # snippets that save files write them here
    code = compile(source, f"docs/{page}:{line}", "exec")
    exec(code, {"__name__": "__docs_snippet__"})


def test_api_reference_covers_every_public_name():
    # Every public name of `jaxstate`, `jaxstate.nn` and `jaxstate.extend` has a
    # `::: jaxstate.X` entry on one of the API reference pages (docs/api/*.md).
    import types

    import jaxstate

    documented = set()
    for page in (DOCS / "api").glob("*.md"):
        documented |= set(re.findall(r"^:::\s*(\S+)", page.read_text(), re.M))
    public = [
        f"{module.__name__}.{name}"
        for module in (jaxstate, jaxstate.nn, jaxstate.extend)
        for name in vars(module)
        if not name.startswith("_")
        and not isinstance(getattr(module, name), types.ModuleType)
    ]
    missing = sorted(set(public) - documented)
    assert not missing, f"add to docs/api/*.md: {missing}"
