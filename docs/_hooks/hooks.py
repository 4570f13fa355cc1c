"""MkDocs hooks for the jaxstate site (registered in mkdocs.yml).

- Links from docs/ pages to the repository's README (`../README.md`, right when the
  page is read on GitHub) point to the site's home page instead, the README's short
  version. Any other link outside docs/ still fails `mkdocs build --strict`.
- The `# runnable` marker on the first line of a code block (which
  tests/programs/test_docs_snippets.py uses to pick the blocks it executes) is not
  shown.
"""

import re


_README_LINK = re.compile(r"\]\(((?:\.\./)+)README\.md(?:#[^)]*)?\)")
_MARKER = re.compile(
    r"^(?P<fence>[ \t]*```python[^\n]*\n)[ \t]*# runnable[ \t]*\n", re.M
)


def on_page_markdown(markdown, page, config, files):
    depth = page.file.src_uri.count("/")  # folders between docs/ and the page

    def readme(match):
        if match.group(1).count("../") != depth + 1:  # not the repository's README
            return match.group(0)
        return "](" + "../" * depth + "index.md)"

    markdown = _README_LINK.sub(readme, markdown)
    return _MARKER.sub(r"\g<fence>", markdown)
