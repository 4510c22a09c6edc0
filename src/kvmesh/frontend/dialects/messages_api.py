"""Anthropic Messages requests (``POST /v1/messages``): the schema kvmesh serves, its
limits, its translation into the internal chat request, and Anthropic's error shape
(pure: no I/O).

A Messages request runs as a chat request (:class:`~kvmesh.frontend.schemas.ChatCompletionRequest`)
through the same request path as ``/v1/chat/completions``: ``system`` becomes the first
system message; a message's text blocks become its content, an assistant's
``tool_use`` blocks its tool calls, a user's ``tool_result`` blocks ``tool`` messages
(in block order); ``tools`` (``input_schema``) and ``tool_choice`` (``auto``, ``any``,
``tool``, ``none``) become the chat request's tools and tool choice; ``max_tokens``,
``stop_sequences``, ``temperature``, ``top_p``, ``top_k`` keep their meaning.

Unknown fields are ignored (``metadata``, ``cache_control``); content blocks other than
``text``, ``tool_use`` and ``tool_result`` (images, documents, thinking) are a 400
naming them. Errors leave as ``{"type": "error", "error": {"type": ..., "message":
...}}`` (:func:`error_body`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta

from kvmesh.config import SecurityConfig
from kvmesh.errors import InvalidArgument
from kvmesh.frontend import schemas
from kvmesh.frontend.dialects.common import check_prompt_text
from kvmesh.frontend.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDef,
    JsonSchema,
    NamedFunction,
    NamedToolChoice,
    NonNegInt,
    PositiveInt,
    Seed,
    Tool,
    TopP,
    function_text_fields,
)

__all__ = ["MessagesRequest", "Block", "parse", "check_limits", "to_chat", "error_body", "error_type"]

_ToolName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
_Id = Annotated[str, Meta(min_length=1, max_length=128)]


class TextPart(msgspec.Struct):
    type: str
    text: str | None = None


class Block(msgspec.Struct, omit_defaults=True):
    """One content block; the fields its ``type`` needs are checked when translated."""

    type: str
    text: str | None = None
    id: _Id | None = None  # tool_use
    name: _ToolName | None = None  # tool_use
    input: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # tool_use: the arguments object, kept as JSON text (empty: none)
    tool_use_id: _Id | None = None  # tool_result
    content: Union[str, list[TextPart], None] = None  # tool_result
    is_error: bool | None = None  # tool_result

    def text_fields(self, at: str) -> Iterator[tuple[str, int]]:
        if self.text is not None:
            yield f"{at}.text", len(self.text)
        if self.input:
            yield f"{at}.input", len(self.input)
        if self.content is not None:
            yield f"{at}.content", _chars(self.content)
        for field, value in (("name", self.name), ("id", self.id), ("tool_use_id", self.tool_use_id)):
            if value is not None:
                yield f"{at}.{field}", len(value)


class MessageParam(msgspec.Struct):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]

    def text_fields(self, at: str) -> Iterator[tuple[str, int]]:
        if isinstance(self.content, str):
            yield f"{at}.content", len(self.content)
            return
        for i, block in enumerate(self.content):
            yield from block.text_fields(f"{at}.content[{i}]")


class ToolParam(msgspec.Struct, omit_defaults=True):
    name: _ToolName
    input_schema: JsonSchema
    description: str | None = None
    type: Literal["custom"] | None = None

    def text_fields(self, at: str) -> Iterator[tuple[str, int]]:
        return function_text_fields(at, self.name, self.description, self.input_schema, "input_schema")


class ToolChoice(msgspec.Struct, omit_defaults=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(msgspec.Struct, kw_only=True):
    """The fields kvmesh reads (Anthropic's names, plus kvmesh's sampling extensions)."""

    model: str
    max_tokens: PositiveInt
    messages: Annotated[list[MessageParam], Meta(min_length=1)]
    system: Union[str, list[TextPart], None] = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=0, le=2**31 - 1)] | None = None
    tools: Annotated[list[ToolParam], Meta(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    # extensions (the chat route's names)
    seed: Seed | None = None
    min_tokens: NonNegInt = 0
    ignore_eos: bool = False
    priority: Literal["premium", "standard", "best_effort"] | None = None

    def text_fields(self) -> Iterator[tuple[str, int]]:
        """(path, characters) of every field that reaches the prompt."""
        if self.system is not None:
            yield "system", _chars(self.system)
        for i, message in enumerate(self.messages):
            yield from message.text_fields(f"messages[{i}]")
        for i, tool in enumerate(self.tools or ()):
            yield from tool.text_fields(f"tools[{i}]")


def _chars(content: str | list[TextPart]) -> int:
    return len(content) if isinstance(content, str) else sum(len(p.text or "") for p in content)


_decoder = msgspec.json.Decoder(MessagesRequest)


def parse(body: bytes) -> MessagesRequest:
    """Decode and validate a body; every failure is an InvalidArgument naming the field."""
    return schemas.decode_body(body, _decoder)


def check_limits(req: MessagesRequest, limits: SecurityConfig) -> None:
    """The chat route's limits in this request's own terms: stop sequences, messages,
    the characters of every field that reaches the prompt (naming the largest)."""
    stops = req.stop_sequences or []
    if len(stops) > limits.max_stop:
        raise InvalidArgument(f"stop_sequences holds {len(stops)} strings; at most {limits.max_stop} - at `$.stop_sequences`")
    for i, stop in enumerate(stops):
        if not stop or len(stop) > limits.max_stop_chars:
            raise InvalidArgument(
                f"stop sequence {i} has {len(stop)} characters; send 1 to {limits.max_stop_chars} - at `$.stop_sequences`"
            )
    if len(req.messages) > limits.max_messages:
        raise InvalidArgument(f"messages holds {len(req.messages)} messages; at most {limits.max_messages} - at `$.messages`")
    check_prompt_text(req.text_fields(), limits)


def to_chat(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat request this request runs as."""
    messages = [] if req.system is None else [ChatMessage(role="system", content=_text(req.system, "system"))]
    for i, message in enumerate(req.messages):
        messages.extend(_messages(message, f"messages[{i}]"))
    return ChatCompletionRequest(
        model=req.model, messages=messages, stream=req.stream, max_tokens=req.max_tokens, stop=req.stop_sequences,
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, seed=req.seed, min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos, priority=req.priority, tools=_tools(req.tools), tool_choice=_tool_choice(req),
    )  # fmt: skip


def _messages(message: MessageParam, at: str) -> Iterator[ChatMessage]:
    """One Anthropic message as chat messages: its text and tool calls, or (a user's
    tool results) one ``tool`` message per result, in block order."""
    if isinstance(message.content, str):
        yield ChatMessage(role=message.role, content=message.content)
        return
    texts: list[str] = []
    calls: list[msgspec.Raw] = []
    for i, block in enumerate(message.content):
        where = f"{at}.content[{i}]"
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "tool_use" and message.role == "assistant":
            calls.append(_call(block, where))
        elif block.type == "tool_result" and message.role == "user":
            if texts:
                yield ChatMessage(role="user", content="".join(texts))
                texts = []
            yield _result(block, where)
        else:
            raise InvalidArgument(
                f"a {message.role} message may not carry a {block.type!r} block here; send text"
                f"{', tool_use' if message.role == 'assistant' else ', tool_result'} blocks - at `$.{where}.type`"
            )
    if texts or calls or not message.content:
        yield ChatMessage(role=message.role, content="".join(texts), tool_calls=calls or None)


def _call(block: Block, at: str) -> msgspec.Raw:
    if block.id is None or block.name is None:
        raise InvalidArgument(f"a tool_use block needs id and name - at `$.{at}`")
    arguments = bytes(block.input) if block.input else b"{}"
    if not arguments.lstrip().startswith(b"{"):
        raise InvalidArgument(f"a tool_use block's input must be a JSON object - at `$.{at}.input`")
    call = {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments.decode()}}
    return msgspec.Raw(msgspec.json.encode(call))


def _result(block: Block, at: str) -> ChatMessage:
    if block.tool_use_id is None:
        raise InvalidArgument(f"a tool_result block needs its tool_use_id - at `$.{at}.tool_use_id`")
    text = _text(block.content, f"{at}.content") if block.content is not None else ""
    if block.is_error:
        text = "error: " + text
    return ChatMessage(role="tool", tool_call_id=block.tool_use_id, content=text)


def _text(content: str | list[TextPart], at: str) -> str:
    if isinstance(content, str):
        return content
    for i, part in enumerate(content):
        if part.type != "text":
            raise InvalidArgument(f"block type {part.type!r} is not supported here; send text blocks - at `$.{at}[{i}].type`")
    return "".join(part.text or "" for part in content)


def _tools(tools: list[ToolParam] | None) -> list[Tool] | None:
    if not tools:
        return None
    return [Tool("function", FunctionDef(t.name, t.description, t.input_schema)) for t in tools]


def _tool_choice(req: MessagesRequest) -> Literal["none", "auto", "required"] | NamedToolChoice | None:
    choice = req.tool_choice
    if choice is None or choice.type == "auto":
        return None if choice is None else "auto"
    if choice.type == "none":
        return "none"
    if choice.type == "any":
        return "required"
    if choice.name is None:
        raise InvalidArgument("tool_choice of type tool needs the tool's name - at `$.tool_choice.name`")
    return NamedToolChoice("function", NamedFunction(choice.name))


# ---- errors in Anthropic's shape

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's error type for an HTTP status."""
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str, request_id: str) -> bytes:
    """``{"type": "error", "error": {"type": ..., "message": ...}, "request_id": ...}``."""
    error = {"type": error_type(status), "message": message}
    return msgspec.json.encode({"type": "error", "error": error, "request_id": request_id})
