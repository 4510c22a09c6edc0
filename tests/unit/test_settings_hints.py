"""``kvmesh.settings`` works out a settings class's field types itself (each
annotation's text evaluated once per module, issue 36's start): they must be what
``typing.get_type_hints`` gives, for every settings class a command's flags use."""

from __future__ import annotations

import typing

import pytest

from kvmesh import settings
from kvmesh.cli.main import build_parser


@pytest.mark.timeout(60)
def test_field_types_are_get_type_hints_for_every_settings_class() -> None:
    build_parser()  # every command's flags: every settings class's hints worked out
    classes = list(settings._HINTS)
    assert len(classes) >= 10
    for cls in classes:
        assert settings._hints(cls) == typing.get_type_hints(cls), cls.__name__


@pytest.mark.timeout(60)
def test_optional_and_inherited_fields() -> None:
    @settings.dataclass(frozen=True)
    class Base(settings.EngineSettings):
        size: int | None = None

    @settings.dataclass(frozen=True)
    class Child(Base):
        names: tuple[str, ...] = ()
        ratio: float = 1.0

    assert settings._annotations(Child) == typing.get_type_hints(Child)
    assert list(settings._annotations(Child)) == ["size", "names", "ratio"]
