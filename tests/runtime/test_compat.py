"""An older transformers would silently ignore ``cache=`` and decode wrong tokens: it is refused by name."""

import pytest

from selfspec.runtime.compat import MIN_TRANSFORMERS, check_transformers


def test_the_installed_transformers_is_accepted():
    check_transformers()


@pytest.mark.parametrize("version", ["5.17.0", "5.23.1", "4.57.0"])
def test_an_older_transformers_is_refused_with_the_fix(version):
    with pytest.raises(RuntimeError, match=rf"needs transformers>=5\.24 .*found transformers {version}.*pip install"):
        check_transformers(version)


@pytest.mark.parametrize("version", ["5.24.0", "5.25.0.dev0", "6.0.0"])
def test_newer_versions_pass(version):
    assert MIN_TRANSFORMERS == (5, 24)
    check_transformers(version)
