"""One declaration per setting.

A setting is a field of a frozen dataclass declared with :func:`setting`: its type
(the annotation), default, help, ``KVMESH_*`` environment variable, CLI flag and
validation live in that one place. Everything else is derived from it:

* :func:`add_flags` adds the argparse flags of a config class to a parser (the
  help shows the default and the variable);
* :func:`resolve` builds the config object from parsed flags, a ``--config`` file
  section and the environment, in this order of precedence:
  **flag > environment variable > config file > declared default**;
* :func:`check` (called from the class's ``__post_init__``) runs each field's
  validation, so a config built in code is checked exactly like one from the CLI.

Flags default to ``None`` in argparse ("not given"), so precedence is decided here,
not by argparse. A field without :func:`setting` metadata is not a setting (e.g. a
nested config, or a value the CLI derives from other flags).

Adding a setting is one declaration, in the config class that carries it::

    # kvmesh/config.py, class FrontendConfig
    otel_endpoint: str = setting("", "OTLP endpoint for traces", env="KVMESH_OTEL_ENDPOINT", group="observability")

and reading ``config.otel_endpoint`` where it is used: the flag (``--otel-endpoint``),
the variable, the config-file key, ``--help`` and the check follow. An engine's
setting goes into its class in :mod:`kvmesh.engines.settings` (the factory in
:mod:`kvmesh.engines.registry` passes it on); a worker receives it with its config.

This module is the ground floor: standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar, Union

__all__ = [
    "Setting",
    "EngineSettings",
    "setting",
    "declared",
    "add_flags",
    "resolve",
    "check",
    "settings_of",
    "positive",
    "non_negative",
    "within",
    "at_least",
    "port",
    "one_of",
    "load_file",
    "NO_FLAG",
    "file_keys",
    "split_commas",
]

Check = Callable[[object], str | None]  # value -> what is wrong with it, or None
T = TypeVar("T")

_META: Final = "kvmesh.setting"
NO_FLAG: Final = "-"  # setting(flag=NO_FLAG): environment (and config file) only, e.g. a password


@dataclass(frozen=True)
class Setting:
    """How one field is set: see :func:`setting`."""

    help: str
    flag: str  # "" : derived from the field name (see _flag_of)
    env: str  # "" : no environment variable
    check: Check | None
    choices: tuple[str, ...]
    group: str
    parse: Callable[[str], object] | None  # str -> value, for types the annotation does not say how to parse
    hidden: bool
    metavar: str


def setting(
    default: T,
    help: str,  # noqa: A002 - argparse's own name for it
    *,
    flag: str = "",
    env: str = "",
    check: Check | None = None,
    choices: Sequence[str] = (),
    group: str = "",
    parse: Callable[[str], object] | None = None,
    hidden: bool = False,
    metavar: str = "",
) -> T:
    """A dataclass field that is a setting. ``flag`` defaults to ``--name`` with
    ``_`` as ``-`` and a trailing ``_s`` (seconds) dropped; ``choices`` also
    validates; ``group`` titles the flag's section in ``--help``."""
    meta = Setting(help, flag, env, check, tuple(choices), group, parse, hidden, metavar)
    if isinstance(default, (list, dict, set)):
        raise TypeError("use a tuple (immutable) as a setting's default")
    field: T = dataclasses.field(default=default, metadata={_META: meta})
    return field


def declared(cls: type, name: str, *, group: str = "") -> Any:
    """``cls.name``'s declaration as a field of another settings class (a command that
    shares a setting with the live system: the same default, help, flag, variable and
    check; ``group``: the section it is listed in, if not the live one's)."""
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_META)
        if f.name == name and isinstance(meta, Setting):
            return dataclasses.field(default=f.default, metadata={_META: dataclasses.replace(meta, group=group or meta.group)})
    raise KeyError(f"{cls.__name__} declares no setting {name!r}")


class EngineSettings:
    """Base of every engine's settings class (a frozen dataclass of :func:`setting`
    fields), so a :class:`~kvmesh.config.WorkerConfig` can carry any engine's
    settings without importing the engine."""

    __slots__ = ()


# --- validation ------------------------------------------------------------


def positive(value: object) -> str | None:
    ok = isinstance(value, (int, float)) and value > 0 and math.isfinite(value)
    return None if ok else "must be positive"


def non_negative(value: object) -> str | None:
    ok = isinstance(value, (int, float)) and value >= 0 and math.isfinite(value)
    return None if ok else "must not be negative"


def at_least(low: int) -> Check:
    def check_low(value: object) -> str | None:
        return None if isinstance(value, int) and value >= low else f"must be at least {low}"

    return check_low


def within(low: float, high: float) -> Check:
    def check_range(value: object) -> str | None:
        ok = isinstance(value, (int, float)) and low <= value <= high
        return None if ok else f"must be within [{low:g}, {high:g}]"

    return check_range


def port(value: object) -> str | None:
    ok = isinstance(value, int) and 0 <= value < 65536
    return None if ok else "must be in 0..65535"


def one_of(*allowed: str) -> Check:
    def check_choice(value: object) -> str | None:
        return None if value in allowed else f"must be one of {', '.join(allowed)}"

    return check_choice


def require(name: str, value: object, *checks: Check) -> None:
    """``ValueError`` naming ``name`` when ``value`` fails one of ``checks``: the same
    checks and wording as a declared setting's, for values that are not settings."""
    for one in checks:
        problem = one(value)
        if problem:
            raise ValueError(f"{name} {problem}, got {value!r}")


def settings_of(cls: type) -> Iterator[tuple[dataclasses.Field[object], Setting]]:
    for f in dataclasses.fields(cls):
        meta = f.metadata.get(_META)
        if isinstance(meta, Setting):
            yield f, meta


def _flag_of(f: dataclasses.Field[object], meta: Setting) -> str:
    if meta.flag:
        return meta.flag
    name = f.name[:-2] if f.name.endswith("_s") else f.name
    return "--" + name.replace("_", "-")


def _dest(f: dataclasses.Field[object], meta: Setting) -> str:
    """The argparse attribute: the flag's name (unique in a parser, unlike field names:
    two engines both have ``num_blocks``)."""
    return _flag_of(f, meta)[2:].replace("-", "_")


def _where(f: dataclasses.Field[object], meta: Setting) -> str:
    if meta.flag == NO_FLAG:
        return meta.env or f.name
    flag = _flag_of(f, meta)
    return f"{flag} (or {meta.env})" if meta.env else flag


def check(obj: object) -> None:
    """Validate every setting of ``obj`` (a dataclass instance); ``ValueError`` with
    the flag (and variable) to fix. ``None`` passes for optional settings."""
    for f, meta in settings_of(type(obj)):
        value = getattr(obj, f.name)
        if value is None:
            continue
        problem = None
        if meta.choices and value not in meta.choices:
            problem = f"must be one of {', '.join(meta.choices)}"
        elif meta.check is not None:
            problem = meta.check(value)
        if problem:
            raise ValueError(f"{_where(f, meta)} {problem}, got {value!r}")


# --- types -----------------------------------------------------------------


_HINTS: dict[type, dict[str, object]] = {}  # read only by the callers
_TYPES: dict[tuple[str, str], object] = {}  # (module, annotation text) -> the type it names


def _hints(cls: type) -> dict[str, object]:
    """A class's hints, worked out once per process (its flags, then its resolve: issue 36,
    the run's start)."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = _annotations(cls)
    return hints


def _annotations(cls: type) -> dict[str, object]:
    """What ``typing.get_type_hints(cls)`` gives a settings class (annotations as text:
    ``from __future__ import annotations``), each text evaluated once per module: the
    settings classes of a start repeat a few (``int``, ``str | None``), and
    ``get_type_hints`` compiles every one (~4 ms of ``kvmesh run``'s start, issue 36)."""
    hints: dict[str, object] = {}
    for klass in reversed(cls.__mro__):
        namespace = vars(sys.modules[klass.__module__])
        for name, text in vars(klass).get("__annotations__", {}).items():
            if not isinstance(text, str):
                hints[name] = type(None) if text is None else text
                continue
            key = (klass.__module__, text)
            if key not in _TYPES:
                tp = eval(text, namespace)  # noqa: S307 - our own source's annotation, as get_type_hints does
                _TYPES[key] = type(None) if tp is None else tp
            hints[name] = _TYPES[key]
    return hints


def _base(tp: object) -> object:
    """``int | None`` -> ``int``; other types unchanged."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def split_commas(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError("is not an integer") from None


def _parse_float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("is not a number") from None


def _parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("is not a boolean (1/0, true/false, yes/no, on/off)")


def _parse_json_object(text: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"is not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    return value


def _parser_for(tp: object, meta: Setting) -> Callable[[str], object]:
    if meta.parse is not None:
        return meta.parse
    base = _base(tp)
    if base is bool:
        return _parse_bool
    if base is int:
        return _parse_int
    if base is float:
        return _parse_float
    if typing.get_origin(base) is tuple:
        return split_commas
    if typing.get_origin(base) in (dict, Mapping) or base is dict:
        return _parse_json_object
    return str


def _coerce(tp: object, value: object, meta: Setting) -> object:
    """A value from a config file (TOML types) into the field's type."""
    base = _base(tp)
    if isinstance(value, str) and base is not str:
        return _parser_for(tp, meta)(value)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typing.get_origin(base) is tuple and isinstance(value, list):
        return tuple(str(v) for v in value)
    ok = next((t for t in (int, float, bool, str) if base is t), None)
    if ok is not None and (not isinstance(value, ok) or (ok is int and isinstance(value, bool))):
        what = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}[ok]
        raise ValueError(f"must be {what}")
    return value


# --- argparse --------------------------------------------------------------


def _default_text(value: object) -> str:
    if value is None or value == "" or value == ():
        return ""
    if isinstance(value, bool):
        return "" if not value else "on"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    title: str = "",
    only: Sequence[str] = (),
    exclude: Sequence[str] = (),
    choices: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """Add the flags of ``cls``'s settings; those with a ``group`` go into a section
    of that title, the rest into ``title``'s section (or the parser itself).
    ``choices``: allowed values known only to the caller (e.g. the engine registry)."""
    # one section per title, whichever class (or call) adds to it first
    groups = {g.title: g for g in parser._action_groups if g.title}
    target: argparse.ArgumentParser | argparse._ArgumentGroup = parser
    if title:
        target = groups.get(title) or parser.add_argument_group(title)
    hints = _hints(cls)
    for f, meta in settings_of(cls):
        if (only and f.name not in only) or f.name in exclude or meta.flag == NO_FLAG:
            continue
        where = target
        if meta.group:
            if meta.group not in groups:
                groups[meta.group] = parser.add_argument_group(meta.group)
            where = groups[meta.group]
        if choices and f.name in choices:
            meta = dataclasses.replace(meta, choices=tuple(choices[f.name]))
        _add_flag(where, f, meta, hints[f.name])


def _add_flag(
    where: argparse.ArgumentParser | argparse._ArgumentGroup, f: dataclasses.Field[object], meta: Setting, tp: object
) -> None:
    default = f.default
    help_text = meta.help
    shown = _default_text(default)
    said = "(default" in help_text  # the help says the default itself
    notes = [f"default {shown}"] if shown and _base(tp) is not bool and not said else []
    if meta.env:
        notes.append(meta.env)
    if notes:
        help_text += f" ({'; '.join(notes)})"
    if meta.hidden:
        help_text = argparse.SUPPRESS
    flag = _flag_of(f, meta)
    base = _base(tp)
    if base is bool:
        where.add_argument(flag, dest=_dest(f, meta), action="store_true", default=None, help=help_text)
        return
    kwargs: dict[str, Any] = {"dest": _dest(f, meta), "default": None, "help": help_text}
    if meta.metavar:
        kwargs["metavar"] = meta.metavar
    elif not meta.choices:
        kwargs["metavar"] = "N" if base is int else "NUM" if base is float else "TEXT"
    if meta.choices:  # shown, and checked by check(): a bad value is one line, as from the environment
        kwargs["metavar"] = "{" + ",".join(meta.choices) + "}"
    if typing.get_origin(base) is tuple and meta.parse is None:
        kwargs["action"] = "append"  # the flag repeats
    else:
        kwargs["type"] = _parser_for(tp, meta)
    where.add_argument(flag, **kwargs)


# --- resolution ------------------------------------------------------------


def _from_env(f: dataclasses.Field[object], meta: Setting, tp: object, env: Mapping[str, str]) -> object:
    raw = env.get(meta.env, "") if meta.env else ""
    if raw == "":
        return dataclasses.MISSING
    try:
        return _parser_for(tp, meta)(raw)
    except ValueError as exc:
        raise ValueError(f"{meta.env}={raw!r} {exc}") from None


def _from_file(f: dataclasses.Field[object], meta: Setting, tp: object, file: Mapping[str, object]) -> object:
    for key in (_flag_of(f, meta)[2:], _flag_of(f, meta)[2:].replace("-", "_"), f.name):
        if key in file:
            try:
                return _coerce(tp, file[key], meta)
            except ValueError as exc:
                raise ValueError(f"config file: {key} = {file[key]!r} {exc}") from None
    return dataclasses.MISSING


def file_keys(cls: type) -> set[str]:
    """The keys a config file may use for ``cls``'s settings."""
    keys: set[str] = set()
    for f, meta in settings_of(cls):
        name = _flag_of(f, meta)[2:]
        keys |= {name, name.replace("-", "_"), f.name}
    return keys


def resolve(
    cls: type[T],
    ns: argparse.Namespace | None = None,
    *,
    file: Mapping[str, object] | None = None,
    env: Mapping[str, str] | None = None,
    given: Mapping[str, object] | None = None,
) -> T:
    """``cls`` from flags (``ns``), environment, config file and defaults, in that
    order; ``given`` fields are set as they are (values the CLI derives itself)."""
    env = os.environ if env is None else env
    given = given or {}
    hints = _hints(cls)
    values: dict[str, object] = {}
    for f, meta in settings_of(cls):
        if f.name in given:
            continue
        tp = hints[f.name]
        value: object = getattr(ns, _dest(f, meta), None) if ns is not None and meta.flag != NO_FLAG else None
        if value is None:
            value = _from_env(f, meta, tp, env)
        if value is dataclasses.MISSING and file:
            value = _from_file(f, meta, tp, file)
        if value is not dataclasses.MISSING and value is not None:
            values[f.name] = tuple(value) if isinstance(value, list) else value
    values.update(given)
    return cls(**values)


def load_file(path: str) -> dict[str, object]:
    """A ``--config`` TOML file as one flat table: top-level keys, and the keys of any
    tables in it (``[frontend]``, ``[worker]``, ... are only for the reader)."""
    import tomllib

    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ValueError(f"--config {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path}: {exc}") from None
    flat: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat
