"""Structured outputs and tool calls on the OpenAI surface (pure: no I/O, no asyncio).

* :func:`guided_of`: the request's one constraint as a typed
  :class:`~kvmesh.protocol.GuidedDecoding`: a forced tool call (``tool_choice``
  ``"required"`` or a named function), ``response_format`` (``json_object`` /
  ``json_schema``), or vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
  ``guided_grammar`` (Lark, llguidance's dialect). Two of them at once is a 400.
* :func:`chat_messages`: the messages a chat template receives; with ``tools`` a system
  message lists them and says how to call one (``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, the Hermes/Qwen convention); earlier assistant tool calls and
  ``tool`` results are written back in that form.
* :func:`parse_tool_call`: a finished output → a tool call (name, arguments JSON), or
  None (plain content); :class:`ToolReader`: a request's tools as its output is read
  back. A forced call's grammar makes the output the bare object
  ``{"name": ..., "arguments": {...}}``, its arguments constrained by the function's
  ``parameters`` schema.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Literal

import msgspec

from kvmesh.errors import InvalidArgument
from kvmesh.frontend.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, JsonSchema, Tool
from kvmesh.protocol import GuidedDecoding

__all__ = [
    "ToolMode", "guided_of", "tool_mode", "chat_messages", "parse_tool_call", "ToolCall", "ToolReader", "new_call_id",
]  # fmt: skip

ToolMode = Literal["none", "auto", "forced"]
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_ANY_PARAMETERS: JsonSchema = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's ``function.arguments``


class ToolReader:
    """A chat request's tools, as its output is read back (:meth:`of` is None when no
    tool is in play: the output is plain content)."""

    __slots__ = ("mode", "names")

    def __init__(self, mode: ToolMode, names: frozenset[str]) -> None:
        self.mode = mode
        self.names = names

    @classmethod
    def of(cls, req: ChatCompletionRequest | CompletionRequest) -> ToolReader | None:
        mode = tool_mode(req)
        if mode == "none" or not isinstance(req, ChatCompletionRequest):
            return None
        return cls(mode, frozenset(t.function.name for t in req.tools or ()))

    def read(self, text: str) -> ToolCall | None:
        """The call in the finished output ``text``, or None."""
        return parse_tool_call(text, self.mode, self.names)


def new_call_id() -> str:
    return "call_" + os.urandom(12).hex()


def tool_mode(req: ChatCompletionRequest | CompletionRequest) -> ToolMode:
    """How the output is read: ``forced`` (the grammar makes it a call), ``auto`` (a
    call if the model writes one), ``none`` (plain content)."""
    if not isinstance(req, ChatCompletionRequest) or not req.tools or req.tool_choice == "none":
        return "none"
    if req.tool_choice is None or req.tool_choice == "auto":
        return "auto"
    return "forced"


def guided_of(req: ChatCompletionRequest | CompletionRequest) -> GuidedDecoding | None:
    """The request's constraint, or None; InvalidArgument for a contradiction."""
    found: list[tuple[str, GuidedDecoding]] = []
    if isinstance(req, ChatCompletionRequest):
        forced = _forced_call(req)
        if forced is not None:
            found.append(("tool_choice", forced))
        fmt = req.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", GuidedDecoding("json_object")))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema is None:
                raise InvalidArgument(
                    "response_format json_schema needs json_schema.schema (a JSON Schema) - at `$.response_format`"
                )
            found.append(("response_format", GuidedDecoding("json_schema", _schema_text(fmt.json_schema.schema))))
    if req.guided_json is not None:
        found.append(("guided_json", GuidedDecoding("json_schema", _schema_text(req.guided_json))))
    if req.guided_regex is not None:
        found.append(("guided_regex", GuidedDecoding("regex", req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", GuidedDecoding("choice", choices=tuple(req.guided_choice))))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", GuidedDecoding("grammar", req.guided_grammar)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidArgument(f"a request may carry one output constraint; this one sets {names}: keep one")
    return found[0][1] if found else None


def _schema_text(schema: JsonSchema) -> str:
    return msgspec.json.encode(schema).decode()


def _forced_call(req: ChatCompletionRequest) -> GuidedDecoding | None:
    """The grammar of a forced call: ``{"name": <one of the tools>, "arguments": <its parameters>}``."""
    choice = req.tool_choice
    if choice is None or isinstance(choice, str) and choice in ("auto", "none"):
        return None
    tools = req.tools or []
    if not tools:
        raise InvalidArgument("tool_choice forces a tool call but the request lists no tools - at `$.tool_choice`")
    if not isinstance(choice, str):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise InvalidArgument(
                f"tool_choice names function {choice.function.name!r}, which is not in tools - at `$.tool_choice`"
            )
        tools = named[:1]
    options = [_call_schema(t) for t in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return GuidedDecoding("json_schema", json.dumps(schema, separators=(",", ":")))


def _call_schema(tool: Tool) -> dict[str, object]:
    parameters = tool.function.parameters if tool.function.parameters is not None else _ANY_PARAMETERS
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    """The messages for the chat template (text content; tools described in a system message)."""
    messages = [{"role": m.role, "content": _content(m)} for m in req.messages]
    if req.tools and req.tool_choice != "none":
        prompt = _tools_prompt(req.tools)
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + prompt}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages


def _content(m: ChatMessage) -> str:
    text = m.text()
    if m.role == "assistant" and m.tool_calls:
        calls = []
        for raw in m.tool_calls:
            call = msgspec.json.decode(bytes(raw))
            fn = call.get("function", {}) if isinstance(call, dict) else {}
            args = fn.get("arguments", "{}") if isinstance(fn, dict) else "{}"
            try:
                parsed = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError:
                parsed = args
            calls.append(_OPEN + json.dumps({"name": fn.get("name"), "arguments": parsed}) + _CLOSE)
        text = (text + "\n" if text else "") + "\n".join(calls)
    if m.role == "tool":
        return f"<tool_response>{text}</tool_response>"
    return text


def _tools_prompt(tools: list[Tool]) -> str:
    listed = []
    for t in tools:
        entry: dict[str, object] = {"name": t.function.name}
        if t.function.description:
            entry["description"] = t.function.description
        entry["parameters"] = t.function.parameters if t.function.parameters is not None else _ANY_PARAMETERS
        listed.append(json.dumps(entry))
    return (
        "You may call these functions:\n" + "\n".join(listed) + "\nTo call one, answer only with "
        f'{_OPEN}{{"name": <function name>, "arguments": <arguments object>}}{_CLOSE}'
    )


def parse_tool_call(text: str, mode: ToolMode, names: frozenset[str]) -> ToolCall | None:
    """The call in a finished output, or None when it is plain content (or, forced, did
    not complete)."""
    if mode == "none":
        return None
    body = text.strip()
    if mode == "auto":
        start = body.find(_OPEN)
        if start < 0:
            return None
        end = body.find(_CLOSE, start)
        body = body[start + len(_OPEN) : end if end >= 0 else len(body)].strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", {})
    return ToolCall(str(obj["name"]), args if isinstance(args, str) else json.dumps(args))
