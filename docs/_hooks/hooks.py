"""MkDocs hooks for the jaxstate site (registered in mkdocs.yml).

- Some pages of the site are files of the repository outside docs/ (`PAGES`): the
  home page is the README, and the notes beside the code of a subsystem
  (`src/jaxstate/*/README.md`) are pages under `internals/`. Each is written once,
  where GitHub shows it, and never copied into docs/.
- Relative links are written as they work on GitHub, from the file's place in the
  repository. On the site, a link to a file that is a page of the site points to
  that page (`docs/design.md` in the README becomes `design.md`, `../README.md` in
  a page of docs/ the home page). Any other link outside docs/ still fails
  `mkdocs build --strict`.
- The `# runnable` marker on the first line of a code block (which
  tests/programs/test_docs_snippets.py uses to pick the blocks it executes) is not
  shown.
"""

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File


ROOT = Path(__file__).resolve().parents[2]

# Files of the repository shown as pages of the site: path -> page.
PAGES = {
    "README.md": "index.md",
    "src/jaxstate/_core/README.md": "internals/core.md",
    "src/jaxstate/_jit/README.md": "internals/jit.md",
}

_LINK = re.compile(r"\]\((?P<target>[^)\s#:]+)(?P<anchor>#[^)\s]*)?\)")
_MARKER = re.compile(
    r"^(?P<fence>[ \t]*```python[^\n]*\n)[ \t]*# runnable[ \t]*\n", re.M
)


def on_files(files, config):
    for path, page in PAGES.items():
        files.append(File.generated(config, page, abs_src_path=str(ROOT / path)))
    return files


def repository_path(page: str) -> str:
    """Where the file of a page of the site is in the repository."""
    for path, uri in PAGES.items():
        if uri == page:
            return path
    return "docs/" + page


def site_page(path: str) -> str | None:
    """The page of the site that shows a file of the repository, if any."""
    if path in PAGES:
        return PAGES[path]
    if path.startswith("docs/"):
        return path.removeprefix("docs/")
    return None


def relink(markdown: str, page: str) -> str:
    """`markdown`, the text of `page`, with its links to files of the repository
    that are pages of the site pointing to those pages."""
    here = posixpath.dirname(repository_path(page))

    def link(match: re.Match) -> str:
        target = posixpath.normpath(posixpath.join(here, match.group("target")))
        uri = site_page(target)
        if uri is None:
            return match.group(0)
        relative = posixpath.relpath(uri, posixpath.dirname(page) or ".")
        return "](" + relative + (match.group("anchor") or "") + ")"

    return _LINK.sub(link, markdown)


def on_page_markdown(markdown, page, config, files):
    markdown = relink(markdown, page.file.src_uri)
    return _MARKER.sub(r"\g<fence>", markdown)
