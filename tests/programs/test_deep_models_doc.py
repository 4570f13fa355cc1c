"""docs/deep-models.md runs: its `# runnable` blocks, in order, in one namespace
(the page builds one stack and goes on using it, as a reader's session does)."""

import re

import pytest

from tests.helpers import ROOT


# Not in the typechecked pass (conftest.py): the documentation's whole programs.
pytestmark = pytest.mark.not_typechecked


PAGE = ROOT / "docs" / "deep-models.md"
_BLOCK = re.compile(r"^```python\n# runnable\n(?P<body>.*?)^```$", re.M | re.S)


def test_the_deep_models_page_runs():
    text = PAGE.read_text(encoding="utf-8")
    blocks = [m.group("body") for m in _BLOCK.finditer(text)]
    assert len(blocks) >= 3
    namespace: dict = {"__name__": "__docs_deep_models__"}
    for n, source in enumerate(blocks):
        exec(compile(source, f"docs/deep-models.md, block {n + 1}", "exec"), namespace)
    # What the page says it computed.
    assert namespace["y"].shape == namespace["x"].shape
