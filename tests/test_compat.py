"""The supported transformers range: checked at import, equal to pyproject.toml's dependency."""

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from sparsekv import compat


def test_installed_transformers_is_supported():
    compat.check_transformers()


@pytest.mark.parametrize("installed", ["5.17.0", "5.23.0", "5.24.0", "5.24.3", "5.24.1.dev0"])
def test_releases_in_the_range_pass(monkeypatch, installed):
    monkeypatch.setattr(compat, "version", lambda name: installed)
    compat.check_transformers()


@pytest.mark.parametrize("installed", ["5.16.2", "5.25.0", "5.25.0.dev0", "6.0.0", "4.57.1"])
def test_releases_outside_the_range_are_refused_naming_both(monkeypatch, installed):
    monkeypatch.setattr(compat, "version", lambda name: installed)
    expected = f"supports transformers {compat.TRANSFORMERS_RANGE}, but transformers {installed} is installed"
    with pytest.raises(ImportError, match=re.escape(expected)):
        compat.check_transformers()


def test_range_is_pyprojects_dependency():
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    deps = [Requirement(d) for d in pyproject["project"]["dependencies"]]
    assert [d.specifier for d in deps if d.name == "transformers"] == [SpecifierSet(compat.TRANSFORMERS_RANGE)]
