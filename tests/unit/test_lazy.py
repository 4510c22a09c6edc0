"""kvmesh.lazy.lazy_names: a package's names resolve from their submodules on first
use, once, and an unknown name is an AttributeError naming the package."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)


def test_a_name_is_imported_on_first_use_and_then_cached() -> None:
    code = (
        "import sys, kvmesh.health as h\n"
        "assert 'kvmesh.health.canary' not in sys.modules\n"
        "value = h.CanarySet\n"
        "assert 'kvmesh.health.canary' in sys.modules\n"
        "assert vars(h)['CanarySet'] is value is sys.modules['kvmesh.health.canary'].CanarySet\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_name_is_an_attribute_error() -> None:
    import kvmesh.preprocess

    with pytest.raises(AttributeError, match="'kvmesh.preprocess' has no attribute 'Nope'"):
        kvmesh.preprocess.Nope  # noqa: B018
    assert not hasattr(kvmesh.preprocess, "Nope")
