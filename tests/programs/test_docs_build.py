"""The documentation site builds with no warnings (`mkdocs build --strict`)."""

import pytest

from tests.helpers import ROOT, run_python


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    site = str(tmp_path / "site")
    run_python("-m", "mkdocs", "build", "--strict", "-d", site, cwd=ROOT, timeout=300)
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "api" / "core" / "index.html").exists()
