"""A package's public names, imported from their submodules on first use (PEP 562).

``__getattr__ = lazy_names(__name__, {"Name": "submodule", ...})`` in a package's
``__init__`` keeps ``from kvmesh.pkg import Name`` working while importing the package
loads none of its submodules; each name is imported once and then cached in the
package (issue 36: a process imports only what it uses)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_names(package: str, home: Mapping[str, str]) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package``: ``home`` maps each name to the
    submodule (relative to ``package``) that defines it."""

    def __getattr__(name: str) -> object:
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
