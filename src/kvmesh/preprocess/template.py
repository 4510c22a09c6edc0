"""Chat templates: Jinja source from a model folder, compiled once, rendered per request.

Templates are code shipped with a model, so they run only in jinja2's
``ImmutableSandboxedEnvironment`` (no private attributes, no mutation of lists and
dicts passed in), with the options and helpers Hugging Face templates expect:

* ``trim_blocks`` and ``lstrip_blocks``, and the ``loopcontrols`` extension;
* ``raise_exception(message)``: the template rejects the request -> InvalidArgument;
* ``strftime_now(format)``: the current local time, formatted;
* ``tojson`` that keeps non-ASCII text as is (jinja's own escapes it for HTML);
* ``{% generation %}...{% endgeneration %}`` blocks, rendered as their body.

Every failure is an :class:`~kvmesh.errors.InvalidArgument`: a broken template when it
is compiled, a template that rejects or chokes on the messages when it is rendered.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

from jinja2 import TemplateError, TemplateSyntaxError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvmesh.errors import InvalidArgument, KvmeshError

__all__ = ["ChatTemplate"]


class _GenerationBlock(Extension):
    """``{% generation %}`` marks assistant text for training masks; serving ignores it."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Fails at the first unsafe attribute lookup.

    The stock sandbox returns an Undefined that renders as '' and fails only when
    used further, so ``{{ x.__class__ }}`` would pass silently.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _raise_exception(message: str) -> NoReturn:
    raise InvalidArgument(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
    ensure_ascii: bool = False,
) -> str:
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


def _environment() -> _StrictSandbox:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlock])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env


class ChatTemplate:
    """A compiled chat template. Thread-safe and read-only after construction.

    ``origin`` names where the source came from (the model folder) in error messages.
    ``variables`` are passed to every render (the special tokens: ``bos_token``,
    ``eos_token``...); per-call keyword arguments override them.
    """

    __slots__ = ("_template", "_origin", "_variables")

    def __init__(self, source: str, *, origin: str = "<string>", variables: Mapping[str, Any] | None = None):
        self._origin = origin
        # NOTE: tools/documents default to None, not undefined, as transformers passes
        # them; templates test ``tools is not none``.
        self._variables: dict[str, Any] = {"tools": None, "documents": None, **(variables or {})}
        try:
            self._template = _environment().from_string(source)
        except TemplateSyntaxError as exc:
            raise InvalidArgument(
                f"the chat template of {origin} does not compile (line {exc.lineno}: {exc.message}): "
                f"fix chat_template in its tokenizer_config.json or chat_template.jinja"
            ) from exc
        except TemplateError as exc:
            raise InvalidArgument(f"the chat template of {origin} does not compile ({exc}): fix it") from exc

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for ``messages`` (OpenAI-shaped dicts: role, content, ...)."""
        context = {**self._variables, **extra, "messages": messages, "add_generation_prompt": add_generation_prompt}
        try:
            return self._template.render(context)
        except KvmeshError:
            raise  # raise_exception: the template's own message, meant for the client
        except SecurityError as exc:
            raise InvalidArgument(f"the chat template of {self._origin} was stopped by the sandbox: {exc}") from exc
        except Exception as exc:
            # A template is model-supplied code; whatever it trips over in these
            # messages (a missing key, a None where it wanted a string) is a bad request.
            raise InvalidArgument(
                f"the chat template of {self._origin} cannot render these messages "
                f"({type(exc).__name__}: {exc}): check the messages' roles and content"
            ) from exc
