"""The package is what its metadata says: typed (PEP 561) and licensed."""

import importlib.metadata
import importlib.resources

from tests.helpers import ROOT


def test_the_package_is_typed():
    # Without `py.typed`, type checkers ignore jaxstate's annotations in users' code.
    assert (importlib.resources.files("jaxstate") / "py.typed").is_file()


def test_the_package_ships_the_license_its_metadata_names():
    metadata = importlib.metadata.metadata("jaxstate")
    assert metadata["License"] == "Apache-2.0"
    assert metadata.get_all("License-File") == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
