"""Error messages stay short: a sentence of what happened and the fix, with a link
to docs/misuse.md for the long story (issue 28).

The messages are collected from the source, as written: the string literals,
f-strings (each placeholder counted as its source text, `{name}`), concatenations
and module constants passed to `raise X(...)` or `warnings.warn(...)`. A link such as
`See docs/misuse.md#vmap-size.` is part of the message and counts. Messages built
elsewhere (in a local variable, or by an exception class) are not seen.
"""

import ast
import re
import statistics

from tests.helpers import ROOT


SRC = ROOT / "src" / "jaxstate"
MISUSE = ROOT / "docs" / "misuse.md"

MEDIAN = 100
LONGEST = 300


def _text(node, consts):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        out = ""
        for v in node.values:
            if isinstance(v, ast.Constant):
                out += v.value
            else:
                assert isinstance(v, ast.FormattedValue)
                out += "{" + ast.unparse(v.value) + "}"
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        a, b = _text(node.left, consts), _text(node.right, consts)
        if a is not None and b is not None:
            return a + b
    if isinstance(node, ast.Name) and node.id in consts:
        return consts[node.id]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "format"
    ):
        return _text(node.func.value, consts)
    return None


def _messages() -> list[tuple[str, str]]:
    """(where, text) of every message raised or warned in src/jaxstate."""
    out = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        consts = {}
        for n in tree.body:
            if (
                isinstance(n, ast.Assign)
                and len(n.targets) == 1
                and isinstance(n.targets[0], ast.Name)
            ):
                t = _text(n.value, {})
                if t is not None:
                    consts[n.targets[0].id] = t
        for n in ast.walk(tree):
            call = None
            if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call):
                call = n.exc
            elif (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "warn"
            ):
                call = n
            if call is None or not call.args:
                continue
            t = _text(call.args[0], consts)
            if t is not None:
                out.append((f"{path.relative_to(SRC)}:{n.lineno}", t))
    return out


def test_messages_are_short():
    messages = _messages()
    assert len(messages) > 100  # the collector still finds them
    lengths = [len(t) for _, t in messages]
    assert statistics.median(lengths) <= MEDIAN
    long = [(len(t), where, t) for where, t in messages if len(t) > LONGEST]
    assert not long, long


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading (also MkDocs' for these headings)."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors() -> set[str]:
    headings = re.findall(r"^#+ (.+)$", MISUSE.read_text(), re.M)
    return {_slug(h) for h in headings}


_LINK = re.compile(r"docs/misuse\.md#([\w-]+)")


def test_links_to_the_misuse_catalogue_exist():
    anchors = _anchors()
    assert "vmap-size" in anchors  # an entry's id is its anchor
    links = {}
    for path in sorted(SRC.rglob("*.py")):
        for anchor in _LINK.findall(path.read_text()):
            links.setdefault(anchor, path.relative_to(SRC))
    assert len(links) >= 10
    missing = {a: str(p) for a, p in links.items() if a not in anchors}
    assert not missing, missing


def test_linking_messages_end_with_the_link():
    # The short form, `... See docs/misuse.md#id.`, last, so the message reads first.
    for where, text in _messages():
        if "docs/misuse.md" in text:
            assert re.search(r"See docs/misuse\.md#[\w-]+\.$", text), (where, text)
