"""The README's code runs as written, shows no warning, and prints what it says;
the README, CI and the docs show one test command; the site's home page is the
README (docs/_hooks/hooks.py)."""

import importlib.util
import re
import types
import warnings

import pytest

from tests.helpers import ROOT


# Not in the typechecked pass (conftest.py): the README's whole programs.
pytestmark = pytest.mark.not_typechecked


README = ROOT / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def _printed(block: str) -> list[str]:
    """What a block says it prints: the comment of each line that calls `print`."""
    return re.findall(r"^print\(.*\)  # (.*)$", block, re.M)


BLOCKS = [pytest.param(b, id=f"block{i}") for i, b in enumerate(_python_blocks())]


def test_the_readme_has_a_tour():
    # The first example, and at least two more in the tour.
    assert len(BLOCKS) >= 3
    assert any(_printed(b) for b in _python_blocks())


@pytest.mark.parametrize("block", BLOCKS)
def test_block_runs_as_written(block, tmp_path, monkeypatch, capsys):
    # Each block on its own, in a fresh namespace: a reader copies one block.
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(block, "README.md", "exec"), {"__name__": "__readme__"})
    assert [str(w.message) for w in caught] == []
    assert capsys.readouterr().out.splitlines() == _printed(block)


def _test_command(text: str) -> str:
    (command,) = [
        line
        for block in re.findall(r"```bash\n(.*?)```", text, re.S)
        for line in block.splitlines()
        if "pytest" in line and '".[test]"' in line
    ]
    return command


def test_ci_runs_the_readmes_test_command_and_the_docs_show_it():
    root = README.parent
    command = _test_command(README.read_text())
    # Both passes: the suite, and the suite with jaxstate's annotations checked.
    assert "python -m pytest -q -n 2 &&" in command
    assert "--jaxtyping-packages=jaxstate,beartype.beartype" in command
    ci = (root / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == command
    for page in ["getting-started.md", "testing.md"]:
        assert _test_command((root / "docs" / page).read_text()) == command, page


def test_the_readme_runs_the_main_job():
    (line,) = [
        line
        for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
        for line in block.splitlines()
        if "examples/train_digits.py" in line
    ]
    assert line.endswith("&& python examples/train_digits.py")
    assert (ROOT / "examples" / "train_digits.py").exists()


def _hooks() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(
        "site_hooks", ROOT / "docs" / "_hooks" / "hooks.py"
    )
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return hooks


def test_the_site_shows_the_readme_as_its_home_page():
    hooks = _hooks()
    assert hooks.PAGES["README.md"] == "index.md"
    for path, page in hooks.PAGES.items():
        assert (ROOT / path).exists(), path
        # Written once: not copied into docs/ (where it would also clash).
        assert not (ROOT / "docs" / page).exists(), page
    home = hooks.relink(README.read_text(), "index.md")
    links = re.findall(r"\]\(([^)#]+)", home)
    assert "design.md" in links and "porting.md" in links
    # Every relative link of the README points to a page of docs/ (the strict
    # build refuses links to anything else).
    relative = [link for link in links if "://" not in link]
    assert relative
    for link in relative:
        assert (ROOT / "docs" / link).exists(), link


def test_links_are_rewritten_from_where_the_file_is():
    hooks = _hooks()
    text = "[a](../../README.md) [b](../design.md#vmap) [c](https://x.org/a.md) [d](#e)"
    assert hooks.relink(text, "api/jit.md") == (
        "[a](../index.md) [b](../design.md#vmap) [c](https://x.org/a.md) [d](#e)"
    )
    # From the README, at the repository's root.
    assert hooks.relink("[x](docs/api/jit.md#y)", "index.md") == "[x](api/jit.md#y)"
    # A file that is no page of the site is left alone (the build then fails).
    assert hooks.relink("[x](examples/a.py)", "index.md") == "[x](examples/a.py)"
