"""The worked examples of the layer guides run.

Every ```python block of the pages below whose first line is `# runnable` is
executed, each in a fresh namespace (the convention of
tests/programs/test_docs_snippets.py).
"""

import re
import textwrap
from pathlib import Path

import pytest

from tests.helpers import ROOT, UNSET_MODE_IS_AN_ERROR


# Not in the typechecked pass (conftest.py): the layer pages' whole programs.
# Readers copy this code: BatchNorm's warning for an unset `mode` must not show.
pytestmark = [pytest.mark.not_typechecked, UNSET_MODE_IS_AN_ERROR]


DOCS = ROOT / "docs"
PAGES = [
    DOCS / name for name in ("layers.md", "batch-norm.md", "random.md", "kv-cache.md")
]
_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```python[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.M | re.S,
)


def _blocks(page: Path) -> list[tuple[int, str]]:
    text = page.read_text(encoding="utf-8")
    return [
        (text.count("\n", 0, m.start()) + 1, textwrap.dedent(m.group("body")))
        for m in _FENCE.finditer(text)
    ]


RUNNABLE = [
    pytest.param(source, id=f"{page.name}:{line}")
    for page in PAGES
    for line, source in _blocks(page)
    if source.startswith("# runnable\n")
]


def test_every_page_has_a_worked_example():
    for page in PAGES:
        assert page.exists(), page
        assert any(f"{page.name}:" in p.id for p in RUNNABLE), page.name
        # Blocks that use jaxstate are run; the others are signatures or output.
        for line, source in _blocks(page):
            if "import jaxstate" in source:
                assert source.startswith("# runnable\n"), f"{page.name}:{line}"


@pytest.mark.parametrize("source", RUNNABLE)
def test_snippet_runs(source, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    exec(compile(source, "<doc snippet>", "exec"), {"__name__": "__doc_snippet__"})
