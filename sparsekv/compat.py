"""The transformers releases sparsekv supports, checked when sparsekv is imported.

sparsekv hooks transformers' decoder, cache and attention interfaces, which change between minor releases (5.24
renamed the cache argument), so a release outside the tested range is refused at import with the range to install,
rather than failing later inside a forward pass.
"""

from __future__ import annotations

from importlib.metadata import version

from packaging.specifiers import SpecifierSet

# The range of pyproject.toml's dependency (tests/test_compat.py holds them equal). CI runs the test suite on the
# newest release it allows and the integration tests on the oldest.
TRANSFORMERS_RANGE = ">=5.17,<5.25"


def check_transformers() -> None:
    """Raises ImportError naming the installed transformers and the supported range when they do not match."""
    installed = version("transformers")
    # Pre-releases of a supported release (5.24.1.dev0) are accepted: the range bounds releases, not their builds.
    if not SpecifierSet(TRANSFORMERS_RANGE).contains(installed, prereleases=True):
        raise ImportError(f"sparsekv supports transformers {TRANSFORMERS_RANGE}, but transformers {installed} is "
                          f"installed; install a supported release: pip install 'transformers{TRANSFORMERS_RANGE}'")


check_transformers()
